"""A data set held in memory, as the small sources (the MNIST ones) load it: class names plus
train and test (and optionally val) :class:`Split` s holding ``images`` uint8 [N, H, W, C],
``labels`` int64 [N] and ``ids`` int64 [N] (stable ids, unique across the splits). An IDX
source's images stay on disk (``idx.DiskRows``) until each row group is written.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from imgtrain.data.idx import DiskRows


@dataclass(frozen=True)
class Split:
    """One split of a data set, rows already in their final (seeded, shuffled) order."""

    images: np.ndarray | DiskRows
    """uint8 [N, H, W, C], channels last, values 0..255 (``DiskRows``: still on disk)."""
    labels: np.ndarray
    """int64 [N], class indices into ``RawDataset.classes``."""
    ids: np.ndarray
    """int64 [N], stable row ids (unique across train + test) that trace a row to its source."""

    def __len__(self) -> int:
        return len(self.labels)


@dataclass(frozen=True)
class RawDataset:
    classes: list[str]
    """Class names; label ``i`` means ``classes[i]``."""
    train: Split
    test: Split
    val: Split | None = None
    """Drawn from the training rows when asked for (``--val-fraction``)."""


def gather(images: np.ndarray, labels: np.ndarray, ids: np.ndarray, index: np.ndarray) -> Split:
    """Gather rows ``index`` into a Split with the contract dtypes."""
    return Split(
        images=np.ascontiguousarray(images[index], dtype=np.uint8),
        labels=np.asarray(labels[index], dtype=np.int64),
        ids=np.asarray(ids[index], dtype=np.int64),
    )


def take_images(images, index: np.ndarray):
    """Rows ``index`` of an in-memory array (a copy) or of ``DiskRows`` (still on disk)."""
    return images.take(index) if isinstance(images, DiskRows) else images[index]
