"""What a large source hands to ``data prepare`` before any image is read: the labels the splits
are drawn from (and a source's own test split), and where each image is, cut into chunks the
preparation pool reads (encoded images) or batches read in turn (pixel arrays).

A listing holds no image: about a hundred bytes per image (its path or position), whatever the
images weigh. ids are the position of each image in the source's own order (sorted relative path
for folders, row order for tables) unless the source has stable ids of its own. Files are listed
in a seeded random order, the order they are written in: a folder is sorted by class, and the
streamed reader shuffles rows only within windows of row groups, so a window of a class-sorted
data set would hold a few classes only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from imgtrain.data import images
from imgtrain.data.label_sets import LabelSets, check_separator, column_kind, from_column, train_classes
from imgtrain.data.named_splits import SPLIT_CODES, fixed_splits, split_of_name
from imgtrain.data.tables import labels_from_column
from imgtrain.errors import ImgtrainError

CHUNK_FILES = 64  # images per chunk of the preparation pool
MAX_LISTED_BAD = 1000  # skipped files named in the manifest (and counted beyond)


@dataclass(frozen=True)
class Chunk:
    """Consecutive images (listing positions ``first`` on) for one task of the preparation pool."""

    first: int
    names: list[str]  # how messages name each image: a relative path, "file.parquet row 17"
    read: Callable[[], Iterable[bytes | images.ImageRejected]]
    """The encoded bytes of each image, or why there are none. It runs in a pool process, so it
    is a module-level function or a ``functools.partial`` of one (it is pickled)."""


@dataclass
class Skipped:
    """What a source dropped while listing (a sample without a label, a damaged archive): the
    first MAX_LISTED_BAD as (name, why), and how many in all. Bounded, whatever the source holds."""

    files: list[tuple[str, str]] = field(default_factory=list)
    count: int = 0

    def add(self, name: str, why: str, count: int = 1) -> None:
        """One entry: a file, or ``count`` images dropped together (a whole file's rows)."""
        self.count += count
        if len(self.files) < MAX_LISTED_BAD:
            self.files.append((name, why))


@dataclass
class Listing:
    """A source of encoded (PNG/JPEG) images, in chunks."""

    classes: list[str]
    labels: np.ndarray | LabelSets  # int64 [N], by position (multi-label: each image's classes)
    chunks: list[Chunk]
    fixed_test: np.ndarray | None = None  # bool [N]: the source's own test split, if it has one
    ids: np.ndarray | None = None  # int64 [N]: the images' stable ids; None: their positions
    fixed_val: np.ndarray | None = None  # bool [N]: the source's own validation split, if it has one
    skipped: Skipped = field(default_factory=Skipped)  # dropped while listing: never in a chunk

    def __post_init__(self):
        if self.ids is None:
            self.ids = np.arange(len(self.labels), dtype=np.int64)


@dataclass
class PixelListing:
    """A source of pixel arrays of one shape, read a batch at a time."""

    classes: list[str]
    labels: np.ndarray | LabelSets  # int64 [N], by position (multi-label: each image's classes)
    ids: np.ndarray  # int64 [N]
    fixed_test: np.ndarray | None
    batches: Callable[[], Iterator[tuple[np.ndarray, np.ndarray]]]
    """(positions int64 [n], pixels uint8 [n, H, W, C]) for consecutive positions, in order."""
    images_name: str
    """How messages name the images, e.g. "column 'image'"."""
    fixed_val: np.ndarray | None = None  # bool [N]: the source's own validation split, if it has one


def files_listing(classes, names: list[str], labels, fixed_test, base: Path, seed: int, fixed_val=None) -> Listing:
    """Image files (``names`` relative to ``base``, or absolute) in a seeded random order; their
    ids stay their positions as given."""
    order = np.random.default_rng([seed, 0x11572]).permutation(len(names))
    names = [names[i] for i in order]
    chunks = [Chunk(i, names[i:i + CHUNK_FILES],
                    functools.partial(images.read_image_files, [str(base / n) for n in names[i:i + CHUNK_FILES]]))
              for i in range(0, len(names), CHUNK_FILES)]
    return Listing(classes, labels[order], chunks, None if fixed_test is None else fixed_test[order],
                   order.astype(np.int64), None if fixed_val is None else fixed_val[order])


def fixed_test(table: pa.Table) -> np.ndarray | None:
    """A ``split`` column of train/test: its test rows; None when there is none."""
    if "split" not in table.column_names:
        return None
    split = table.column("split").cast(pa.string())
    odd = sorted({str(s) for s in pc.unique(split).to_pylist()} - {"train", "test"})  # a string per value, not per row
    if odd:
        raise ImgtrainError(f"column 'split' may only hold 'train' or 'test', found {', '.join(odd[:5])}; "
                            "fix it or rename the column to split at random")
    return pc.equal(split, "test").to_numpy()


def table_splits(table: pa.Table, split_column: str | None, what: str) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(fixed_test, fixed_val) of a table: ``--split-column``'s train/val/test rows, else those of
    a ``split`` column of train/test (``fixed_test``), else none."""
    if split_column is None:
        return fixed_test(table), None
    split = table.column(split_column).cast(pa.string())
    values = [v for v in pc.unique(split).to_pylist()]  # a string per value, not per row
    odd = sorted(str(v) for v in values if v is None or split_of_name(v) is None)
    if odd:
        raise ImgtrainError(f"--split-column {split_column!r} may only hold train, val or test, found "
                            f"{', '.join(odd[:5])}; fix it, or drop --split-column to split at random")
    codes = np.zeros(len(split), np.int8)
    for value in values:
        codes[pc.equal(split, value).to_numpy(zero_copy_only=False)] = SPLIT_CODES[split_of_name(value)]
    return fixed_splits(codes, what)


def table_labels(table: pa.Table, label_column: str, opts, splits, where) -> tuple[np.ndarray | LabelSets, list[str]]:
    """A table's labels and class names: one class per row, or with ``--multi-label`` the classes
    of each row (``label_sets``), named by the training rows' (``splits``: fixed_test, fixed_val;
    ``where(row)`` names a row in messages)."""
    column = table.column(label_column)
    if not getattr(opts, "multi_label", False):
        return labels_from_column(column, label_column)
    sets, classes = from_column(column, label_column, opts.label_sep)
    if column_kind(column.type) == "joined":
        check_separator(sets, opts.label_sep)
    held = [m for m in splits if m is not None]
    train = ~np.logical_or.reduce(held) if held else None
    if not classes or (train is not None and not len(np.unique(sets[np.flatnonzero(train)].values))):
        raise ImgtrainError(f"label column {label_column!r} holds no label of a training image; a classifier needs "
                            "labels to learn")
    return train_classes(sets, classes, train, where)
