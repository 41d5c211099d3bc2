"""The large sources, listed before they are read: an image folder, a table of image paths
(CSV or Parquet), a Parquet table of encoded images or of pixel arrays.

A listing holds what the splits are drawn from (labels, a source's own test split) and where
each image is, cut into chunks the preparation pool processes. It holds no image: about a hundred
bytes per image (its path or position), whatever the images weigh. ids are the position of each
image in the listing: sorted relative path for folders, row order for tables (or a table's own
unique integer ``id`` column). Files are listed in a seeded random order, the order they are
written in: a folder is sorted by class, and the streamed reader shuffles rows only within
windows of row groups, so a window of a class-sorted data set would hold a few classes only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from imgtrain.data import tables
from imgtrain.data.sources import check_class_count
from imgtrain.errors import ImgtrainError, one_line

CHUNK_FILES = 64  # images per chunk of the preparation pool
_JUNK_FILES = {"thumbs.db", "desktop.ini"}


@dataclass(frozen=True)
class Chunk:
    """Consecutive images (listing positions ``first`` on) for one task of the preparation pool:
    files, or one row group of a Parquet column of encoded images."""

    first: int
    names: list[str]  # how messages name each image: a relative path, "file.parquet row 17"
    paths: list[str] | None = None
    parquet: tuple[str, int, str] | None = None  # (file, row group, column)


@dataclass
class Listing:
    classes: list[str]
    labels: np.ndarray  # int64 [N], by position
    chunks: list[Chunk]
    fixed_test: np.ndarray | None = None  # bool [N]: the source's own test split, if it has one
    ids: np.ndarray | None = None  # int64 [N]: the images' stable ids; None: their positions

    def __post_init__(self):
        if self.ids is None:
            self.ids = np.arange(len(self.labels), dtype=np.int64)


# ---------------------------------------------------------------- an image folder


def list_image_folder(root, seed: int = 0) -> Listing:
    """Class-per-subfolder PNG/JPEG images; class names are the sorted subfolder names. With
    ``root/train/`` and ``root/test/`` (each holding class subfolders) those are the splits."""
    root = Path(root)
    if not root.is_dir():
        raise ImgtrainError(f"image folder {root} does not exist; pass a folder with one subfolder per class")
    presplit = (root / "train").is_dir() and (root / "test").is_dir()
    tops = [root / "train", root / "test"] if presplit else [root]
    classes = [d.name for d in _class_dirs(tops[0])]
    if presplit:
        extra = sorted({d.name for d in _class_dirs(root / "test")} - set(classes))
        if extra:
            raise ImgtrainError(f"{root / 'test'} has class folders missing from {root / 'train'}: "
                                f"{', '.join(extra)}; every test class needs training images")
    check_class_count(len(classes), f"the class folders of {tops[0]}")
    if len(classes) < 2:
        raise ImgtrainError(f"{tops[0]} has {len(classes)} class folder(s); a classifier needs at least 2 "
                            "subfolders (one per class) holding PNG/JPEG images")
    entries = []  # (relative path, class index, is_test)
    for top in tops:
        for c, name in enumerate(classes):
            files = _image_files(top / name) if (top / name).is_dir() else []
            if not files and top == tops[0]:
                raise ImgtrainError(f"class folder {top / name} has no images; add some or remove it")
            entries += [(p.relative_to(root).as_posix(), c, top.name == "test" and presplit) for p in files]
    entries.sort()
    if presplit and not any(is_test for *_, is_test in entries):
        raise ImgtrainError(f"{root / 'test'} has no images; add some or remove the folder")
    labels = np.array([c for _, c, _ in entries], np.int64)
    test = np.array([t for *_, t in entries], bool) if presplit else None
    return _shuffled_files(classes, [rel for rel, _, _ in entries], labels, test, root, seed)


def _shuffled_files(classes, names: list[str], labels: np.ndarray, fixed_test, base: Path, seed: int) -> Listing:
    """A listing of files in a seeded random order; their ids stay their positions as given."""
    order = np.random.default_rng([seed, 0x11572]).permutation(len(names))
    names = [names[i] for i in order]
    chunks = [Chunk(i, names[i:i + CHUNK_FILES], paths=[str(base / n) for n in names[i:i + CHUNK_FILES]])
              for i in range(0, len(names), CHUNK_FILES)]
    return Listing(classes, labels[order], chunks, None if fixed_test is None else fixed_test[order],
                   order.astype(np.int64))


def _class_dirs(root: Path) -> list[Path]:
    return sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))


def _image_files(class_dir: Path) -> list[Path]:
    """Every non-hidden file under ``class_dir`` (non-images are reported, not skipped), FIFOs and
    other special files too: they are reported unread (``images.read_image_file``). rglob does not
    follow linked folders: a link to a parent cannot make it walk in circles."""
    return [p for p in class_dir.rglob("*")
            if not p.is_dir() and not any(part.startswith(".") for part in p.relative_to(class_dir).parts)
            and p.name.lower() not in _JUNK_FILES]


# ---------------------------------------------------------------- a table of image paths


def list_file_table(path, path_column: str = "path", label_column: str = "label", seed: int = 0) -> Listing:
    """A CSV or Parquet table of image paths (relative to the table's folder, or absolute) and
    labels; a ``split`` column of train/test, when present, is the test split."""
    path = Path(path)
    if path.suffix.lower() == ".csv":
        import pyarrow.csv as pacsv

        try:
            table = pacsv.read_csv(path)
        except (pa.ArrowException, OSError) as e:
            raise ImgtrainError(f"cannot read {path}: {one_line(e, 200)}") from None
        missing = [c for c in (path_column, label_column) if c not in table.column_names]
        if missing:
            raise ImgtrainError(f"{path} has no column {' or '.join(map(repr, missing))}; available columns: "
                                f"{', '.join(table.column_names)}; choose with --path-column / --label-column")
    else:
        files = tables.parquet_files(path)
        if not files:
            raise ImgtrainError(f"no Parquet or CSV table at {path}; pass a .csv or .parquet file")
        table = tables.read_parquet_columns(files, [path_column, label_column], ["split"],
                                            "choose with --path-column / --label-column")
    if table.num_rows == 0:
        raise ImgtrainError(f"{path} has no rows")
    paths = table.column(path_column)
    if not pa.types.is_string(paths.type) and not pa.types.is_large_string(paths.type) or paths.null_count:
        raise ImgtrainError(f"column {path_column!r} of {path} must hold a path in every row, got {paths.type}")
    labels, classes = tables.labels_from_column(table.column(label_column), label_column)
    return _shuffled_files(classes, paths.to_pylist(), labels, _fixed_test(table), path.parent, seed)


# ---------------------------------------------------------------- Parquet tables of images


@dataclass
class PixelTable:
    """A Parquet table of pixel arrays, listed: labels, ids and the row groups to stream."""

    classes: list[str]
    labels: np.ndarray
    ids: np.ndarray
    fixed_test: np.ndarray | None
    groups: list[tuple[Path, int, int]]  # (file, row group, first row position)


def holds_encoded_images(path, image_column: str) -> bool:
    """Whether a Parquet table's image column holds PNG/JPEG bytes (else pixel arrays)."""
    files = tables.parquet_files(Path(path))
    if not files:
        raise ImgtrainError(f"no Parquet files at {path}; pass a .parquet file or a folder of them")
    schema = pq.read_schema(files[0])
    if image_column not in schema.names:
        raise ImgtrainError(f"{files[0]} has no column {image_column!r}; available columns: "
                            f"{', '.join(schema.names)}; choose with --image-column / --label-column")
    typ = schema.field(image_column).type
    return (pa.types.is_binary(typ) or pa.types.is_large_binary(typ)
            or pa.types.is_struct(typ) and typ.get_field_index("bytes") >= 0)  # Hugging Face's images


def list_parquet_images(path, image_column: str = "image", label_column: str = "label") -> Listing:
    """A Parquet table (a file or a folder of them) of PNG/JPEG bytes: one chunk per row group."""
    table = list_parquet_table(path, image_column, label_column)
    chunks = []
    for file, group, first in table.groups:
        rows = pq.ParquetFile(file).metadata.row_group(group).num_rows
        chunks.append(Chunk(first, [f"{file.name} row {first + k}" for k in range(rows)],
                            parquet=(str(file), group, image_column)))
    return Listing(table.classes, table.labels, chunks, table.fixed_test, table.ids)


def list_parquet_table(path, image_column: str = "image", label_column: str = "label") -> PixelTable:
    """Labels, ids and a ``split`` column, read (column by column, safely) without the images."""
    path = Path(path)
    files = tables.parquet_files(path)
    if not files:
        raise ImgtrainError(f"no Parquet files at {path}; pass a .parquet file or a folder of them")
    try:
        table = tables.read_parquet_columns(files, [image_column, label_column], ["id", "split"],
                                            "choose with --image-column / --label-column", skip=[image_column])
    except (pa.ArrowException, OSError) as e:
        raise ImgtrainError(f"cannot read Parquet data at {path}: {one_line(e, 200)}") from None
    if table.num_rows == 0:
        raise ImgtrainError(f"{path} has no rows")
    labels, classes = tables.labels_from_column(table.column(label_column), label_column)
    ids = np.arange(table.num_rows, dtype=np.int64)
    if "id" in table.column_names and "id" not in (image_column, label_column):
        col = table.column("id")
        if pa.types.is_integer(col.type) and col.null_count == 0:
            candidate = col.to_numpy().astype(np.int64)
            if len(np.unique(candidate)) == len(candidate):
                ids = candidate
    groups, first = [], 0
    for f in files:
        meta = pq.ParquetFile(f).metadata
        for g in range(meta.num_row_groups):
            groups.append((f, g, first))
            first += meta.row_group(g).num_rows
    return PixelTable(classes, labels, ids, _fixed_test(table), groups)


def iter_parquet_pixels(table: PixelTable, image_column: str):
    """(row positions int64 [n], pixels uint8 [n, H, W, C]) for each row group, in order."""
    for file, group, first in table.groups:
        try:
            part = pq.ParquetFile(file).read_row_group(group, columns=[image_column])
        except (pa.ArrowException, OSError) as e:
            raise ImgtrainError(f"cannot read {file}: {one_line(e, 200)}") from None
        pixels = tables.images_from_column(part.column(image_column), part.schema.field(image_column))
        yield np.arange(first, first + len(pixels), dtype=np.int64), pixels


def _fixed_test(table: pa.Table) -> np.ndarray | None:
    """A ``split`` column of train/test: its test rows; None when there is none."""
    if "split" not in table.column_names:
        return None
    split = np.asarray(table.column("split").cast(pa.string()).to_pylist(), dtype=object)
    odd = sorted({str(s) for s in split} - {"train", "test"})
    if odd:
        raise ImgtrainError(f"column 'split' may only hold 'train' or 'test', found {', '.join(odd[:5])}; "
                            "fix it or rename the column to split at random")
    return split == "test"
