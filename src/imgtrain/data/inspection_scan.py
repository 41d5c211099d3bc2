"""The one streamed pass of ``imgtrain data inspect`` (``inspection.py``): every split's row
groups are read in a process pool (``pool.ordered_map``), and of each image only compact numpy
arrays are kept (``Scan``): id (8 bytes), split (1), label (4), row group and row (8), width and
height (8), colour mode and EXIF flag (2), content hash (8) and the 8 turned pHashes (64): 103
bytes an image (about 100 MB for a million images), whatever the images weigh. The page
(``inspection_page.py``) reads the images it shows back by their row group (``read_block``)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from imgtrain.data import format as fmt
from imgtrain.data import pool
from imgtrain.data.fingerprint import Prints, fingerprint_encoded, fingerprint_pixels
from imgtrain.data.label_sets import LabelSets
from imgtrain.data.named_splits import SPLIT_CODES
from imgtrain.errors import ImgtrainError


@dataclass
class Scan:
    """What the pass keeps of every image, by position (splits one after the other)."""

    split: np.ndarray  # int8 [n]: SPLIT_CODES
    ids: np.ndarray  # int64 [n]
    labels: np.ndarray  # int32 [n]
    block: np.ndarray  # uint32 [n]: index into ``blocks``
    row: np.ndarray  # uint32 [n]: row in its row group
    prints: Prints
    blocks: list  # (file, row group) of each block
    label_sets: LabelSets | None = None  # a multi-label data set's labels (``labels``: each set's number)

    def class_of(self, i: int, classes: list[str]) -> str:
        """An image's class, or a multi-label image's classes joined by spaces."""
        if self.label_sets is None:
            return classes[self.labels[i]]
        return " ".join(classes[k] for k in self.label_sets.row(i)) or "(no label)"


def scan(data_dir: Path, manifest: dict, workers: int = 0,
         progress: Callable[[int, int], None] | None = None) -> Scan:
    """Fingerprint every image of every split, row group by row group, in the pool."""
    tasks = [(SPLIT_CODES[s], str(f), g) for s in fmt.ALL_SPLITS if s in manifest["splits"]
             for f, g, _ in fmt.row_groups(data_dir, manifest, s)]
    total = sum(manifest["splits"][s]["num_samples"] for s in manifest["splits"])
    columns: list[list] = [[], [], [], [], [], []]  # split, ids, labels, block, row, prints: a part per block
    done = 0
    multi = fmt.is_multi_label(manifest)
    work = functools.partial(scan_block, storage=manifest["storage"], multi_label=multi)
    sets = []
    for k, (task, (ids, labels, prints)) in enumerate(pool.ordered_map(work, tasks, workers)):
        n = len(ids)
        if multi:  # each image's label set, and a number per distinct set (what duplicates compare)
            sets.append(labels)
            labels = np.zeros(n, np.int32)
        part = (np.full(n, task[0], np.int8), ids.astype(np.int64), labels.astype(np.int32), np.full(n, k, np.uint32),
                np.arange(n, dtype=np.uint32), prints)
        for column, values in zip(columns, part):
            column.append(values)
        done += n
        if progress:
            progress(done, total)
    empty = (np.int8, np.int64, np.int32, np.uint32, np.uint32)
    arrays = [np.concatenate(c) if c else np.zeros(0, t) for c, t in zip(columns, empty)]
    label_sets = LabelSets.concat(sets) if multi else None
    if multi:
        arrays[2] = _set_numbers(label_sets)
    labels = label_sets.values if multi else arrays[2]
    if len(labels) and not (0 <= labels.min() and labels.max() < manifest["num_classes"]):
        raise ImgtrainError(f"{data_dir} holds a label outside the manifest's {manifest['num_classes']} classes; "
                            "prepare the data set again")
    return Scan(*arrays, Prints.join(columns[5]), [(f, g) for _, f, g in tasks], label_sets)


def _set_numbers(sets: LabelSets) -> np.ndarray:
    """int32 [n]: the same number for images with the same label set."""
    seen: dict[bytes, int] = {}
    return np.array([seen.setdefault(sets.row(i).tobytes(), len(seen)) for i in range(len(sets))], np.int32)


def scan_block(task: tuple, storage: str, multi_label: bool = False) -> tuple[np.ndarray, np.ndarray, Prints]:
    """(ids, labels (multi-label: ``LabelSets``), fingerprints) of one row group (runs in a pool process)."""
    _, path, group = task
    ids, labels, pictures = read_block(path, group, storage, multi_label)
    prints = Prints.empty(len(ids))
    for k, picture in enumerate(pictures):
        (fingerprint_pixels if storage == "tensor" else fingerprint_encoded)(picture, prints, k)
    return ids, labels, prints


def read_block(path, group: int, storage: str, multi_label: bool = False):
    """(ids, labels, images) of one row group: images as encoded bytes, or uint8 [n, H, W, C];
    a multi-label data set's labels as ``LabelSets``."""
    table = fmt.read_row_group(Path(path), group, storage, multi_label)
    if storage == "tensor":
        from imgtrain.data.tables import tensor_column_to_numpy

        pictures = tensor_column_to_numpy(table.column("image"), table.schema.field("image"))
    else:
        pictures = table.column("image").to_pylist()
    if multi_label:
        import pyarrow.compute as pc

        column = table.column("labels").combine_chunks()
        sizes = pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)
        labels = LabelSets(np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
                           pc.list_flatten(column).to_numpy().astype(np.int64))
    else:
        labels = table.column("label").to_numpy()
    return table.column("id").to_numpy(), labels, pictures
