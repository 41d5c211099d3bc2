"""Several labels per image (``data prepare --multi-label``): each image's class indices, kept
ragged (``LabelSets``: an offsets array and the values, a few bytes per label, whatever the
number of classes), and read from a table's label column: a list (of names or of class ids),
or a string of names joined by a separator (fastai's ``label_delim``). An image may have no
label at all (every class negative)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from imgtrain.data.limits import check_class_count
from imgtrain.errors import ImgtrainError

DEFAULT_SEP = " "
MAX_LABELS_PER_IMAGE = 10_000  # a sample's labels read from a shard (a list in a .json), at most


@dataclass(frozen=True)
class LabelSets:
    """Image i's class indices are ``values[offsets[i]:offsets[i + 1]]``, sorted and unique.
    Indexed like a numpy array (an index array, a mask, a slice): what ``prepare`` does with
    single labels it does with these."""

    offsets: np.ndarray  # int64 [N + 1]
    values: np.ndarray  # int64

    @staticmethod
    def from_lists(lists) -> "LabelSets":
        """From an iterable of per-image index lists (sorted and deduplicated here)."""
        rows = [np.unique(np.asarray(x, np.int64)) for x in lists]
        sizes = np.array([len(r) for r in rows], np.int64)
        values = np.concatenate(rows) if rows else np.zeros(0, np.int64)
        return LabelSets(np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64), values.astype(np.int64))

    @staticmethod
    def concat(parts: list["LabelSets"]) -> "LabelSets":
        sizes = np.concatenate([p.sizes() for p in parts]) if parts else np.zeros(0, np.int64)
        values = np.concatenate([p.values[p.offsets[0]:p.offsets[-1]] for p in parts]) if parts else sizes
        return LabelSets(np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64), values.astype(np.int64))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def sizes(self) -> np.ndarray:
        """The number of labels of each image."""
        return np.diff(self.offsets)

    def __getitem__(self, index) -> "LabelSets":
        rows = np.arange(len(self))[index]
        if np.ndim(rows) == 0:
            rows = np.array([rows])
        starts, sizes = self.offsets[rows], self.sizes()[rows]
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        at = np.repeat(starts - offsets[:-1], sizes) + np.arange(offsets[-1])
        return LabelSets(offsets, self.values[at])

    def row(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i]:self.offsets[i + 1]]

    def counts(self, num_classes: int) -> np.ndarray:
        """Per class, the images that carry it."""
        return np.bincount(self.values, minlength=num_classes).astype(np.int64)

    def size_counts(self) -> list[int]:
        """The number of images with exactly k labels, k = 0 .. the most any image has."""
        return np.bincount(self.sizes(), minlength=1).astype(np.int64).tolist()

    def renumbered(self, new_index: np.ndarray) -> "LabelSets":
        """Each value v becomes ``new_index[v]`` (rows sorted again)."""
        values = new_index[self.values]
        rows = np.repeat(np.arange(len(self)), self.sizes())
        order = np.lexsort((values, rows))
        return LabelSets(self.offsets, values[order])

    def to_arrow(self) -> pa.Array:
        """The shards' ``labels`` column: list<int64>."""
        return pa.ListArray.from_arrays(pa.array(self.offsets - self.offsets[0], pa.int32()),
                                        pa.array(self.values[self.offsets[0]:self.offsets[-1]], pa.int64()))


def is_label_sets(labels) -> bool:
    return isinstance(labels, LabelSets)


def occurrences(labels) -> np.ndarray:
    """Every (image, class) label: the class of each, for counting per class."""
    return labels.values if isinstance(labels, LabelSets) else labels


def _sorted_unique_rows(rows: np.ndarray, values: np.ndarray, n: int) -> LabelSets:
    """LabelSets from (image, class) pairs in any order, duplicates dropped."""
    pairs = np.unique(np.stack([rows, values]), axis=1) if len(rows) else np.zeros((2, 0), np.int64)
    sizes = np.bincount(pairs[0], minlength=n)
    return LabelSets(np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64), pairs[1].astype(np.int64))


def _is_string(typ: pa.DataType) -> bool:
    return pa.types.is_string(typ) or pa.types.is_large_string(typ)


def _is_list(typ: pa.DataType) -> bool:
    return pa.types.is_list(typ) or pa.types.is_large_list(typ) or pa.types.is_fixed_size_list(typ)


def column_kind(typ: pa.DataType) -> str | None:
    """"names" (list of strings), "ids" (list of integers), "joined" (a string to split), or
    None: a column --multi-label cannot read."""
    if pa.types.is_dictionary(typ):
        typ = typ.value_type
    if _is_string(typ) or pa.types.is_null(typ):  # null: a CSV column left empty in every row
        return "joined"
    if _is_list(typ):
        item = typ.value_type
        if pa.types.is_dictionary(item):
            item = item.value_type
        if _is_string(item) or pa.types.is_null(item):
            return "names"
        if pa.types.is_integer(item):
            return "ids"
    return None


def from_column(column, name: str, sep: str | None, names: list[str] | None = None) -> tuple[LabelSets, list[str]]:
    """A label column -> (LabelSets, class names): names sorted (their indices into them), or,
    for lists of class ids, the ids as they are (named by ``names``, a ClassLabel's, else "0",
    "1", ...). A null or empty cell is an image without labels."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    if pa.types.is_dictionary(column.type):
        column = column.cast(column.type.value_type)
    kind = column_kind(column.type)
    if kind is None:
        raise ImgtrainError(f"--multi-label: label column {name!r} has type {column.type}; expected a list of "
                            "class names or ids, or names joined by --label-sep in a string")
    if pa.types.is_null(column.type):
        return LabelSets(np.zeros(len(column) + 1, np.int64), np.zeros(0, np.int64)), []
    if kind == "joined":
        column = split_joined(column, sep)
    elif sep is not None:
        raise ImgtrainError(f"--label-sep: label column {name!r} holds lists ({column.type}), nothing to split; "
                            "drop --label-sep")
    if pa.types.is_large_list(column.type) or pa.types.is_fixed_size_list(column.type):
        column = column.cast(pa.list_(column.type.value_type))
    column = column.fill_null([])
    rows = pc.list_parent_indices(column).to_numpy().astype(np.int64)
    flat = pc.list_flatten(column)
    if pa.types.is_dictionary(flat.type):
        flat = flat.cast(flat.type.value_type)
    if kind == "ids":
        return _ids(flat, rows, len(column), name, names)
    keep = flat.is_valid().to_numpy(zero_copy_only=False)  # a null name in a list: no label
    flat = pc.utf8_trim_whitespace(flat.filter(pa.array(keep)))
    rows = rows[keep]
    nonempty = pc.not_equal(flat, "").to_numpy(zero_copy_only=False)
    flat, rows = flat.filter(pa.array(nonempty)), rows[nonempty]
    distinct = pc.unique(flat)
    check_class_count(len(distinct), f"label column {name!r}")
    classes = sorted(distinct.to_pylist())
    rank = np.searchsorted(np.array(classes, dtype=object), np.array(distinct.to_pylist(), dtype=object))
    values = rank[pc.index_in(flat, value_set=distinct).to_numpy()].astype(np.int64)
    return _sorted_unique_rows(rows, values, len(column)), classes


def split_joined(column: pa.Array, sep: str | None) -> pa.Array:
    """Names joined by ``sep`` (a space by default) -> a list of names per row."""
    return pc.split_pattern(column, sep if sep is not None else DEFAULT_SEP)


def _ids(flat: pa.Array, rows: np.ndarray, n: int, name: str, names: list[str] | None) -> tuple[LabelSets, list[str]]:
    if flat.null_count:
        raise ImgtrainError(f"label column {name!r} has a null class id inside a list; clean the data")
    values = flat.to_numpy().astype(np.int64)
    if len(values) and values.min() < 0:
        raise ImgtrainError(f"label column {name!r} has class id {values.min()}; use ids 0..K-1")
    if names is not None:
        if len(values) and values.max() >= len(names):
            raise ImgtrainError(f"label column {name!r} has class id {values.max()}, beyond its "
                                f"{len(names)} class names")
        return _sorted_unique_rows(rows, values, n), list(names)
    top = int(values.max()) if len(values) else -1
    check_class_count(top + 1, f"label column {name!r}", "use class ids 0..K-1 or class-name strings")
    return _sorted_unique_rows(rows, values, n), [str(i) for i in range(top + 1)]


def check_separator(sets: LabelSets, sep: str | None) -> None:
    """A separator that splits no label (every image has exactly one) is most likely the wrong one."""
    if len(sets) and (sets.sizes() == 1).all():
        shown = repr(sep if sep is not None else DEFAULT_SEP)
        raise ImgtrainError(f"--label-sep {shown} splits no label; is the separator right? (every image has "
                            "exactly one label; for one label per image drop --multi-label)")


def train_classes(sets: LabelSets, classes: list[str], train: np.ndarray | None,
                  where: Callable[[int], str]) -> tuple[LabelSets, list[str]]:
    """Classes are the names the training images carry (all images, when the source has no splits
    of its own): a name only in the validation or test images has no training image to learn
    from, and is refused, naming it and where it is (``where(row)``)."""
    if train is None or train.all():
        used = np.unique(sets.values)
        if len(used) == len(classes):
            return sets, classes
    else:
        used = np.unique(sets[np.flatnonzero(train)].values)
        unknown = np.setdiff1d(np.unique(sets.values), used)
        if len(unknown):
            label = int(unknown[0])
            row = int(np.repeat(np.arange(len(sets)), sets.sizes())[sets.values == label][0])
            more = f" ({len(unknown) - 1} more such label(s))" if len(unknown) > 1 else ""
            raise ImgtrainError(f"label {classes[label]!r} of {where(row)} is not the label of any training image"
                                f"{more}; every label must have training images: fix the label or the split")
    new_index = np.full(len(classes), -1, np.int64)
    new_index[used] = np.arange(len(used))
    return sets.renumbered(new_index), [classes[i] for i in used]
