"""parquet: a Parquet table (a file or a folder of them) of images and labels, with optional
``id`` and train/test ``split`` columns (or the train/val/test column ``--split-column`` names;
with ``--multi-label`` a list of labels, or joined names, a row). Images stored as PNG/JPEG bytes (also Hugging Face's
{bytes, path} structs) are checked like files; pixel arrays (nested lists, a tensor column) are
kept as tensors. Read a row group at a time, never whole, once the row counts the files declare
passed ``limits.TableRows``' bounds."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from imgtrain.data import tables
from imgtrain.data.images import ImageRejected
from imgtrain.data.listing import Chunk, Listing, PixelListing, table_labels, table_splits
from imgtrain.errors import ImgtrainError, one_line


def list_parquet(path, opts) -> Listing | PixelListing:
    """Encoded images are checked and kept as they are; pixel arrays are stored as tensors."""
    if holds_encoded_images(path, opts.image_column):
        return list_parquet_images(path, opts.image_column, opts.label_column, opts)
    return list_parquet_pixels(path, opts.image_column, opts.label_column, opts)


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


def list_parquet_images(path, image_column: str, label_column: str, opts=None) -> Listing:
    """A table of PNG/JPEG bytes: one chunk per row group."""
    rows = _table_rows(path, image_column, label_column, opts)
    chunks = []
    for file, group, first, count in rows.groups:
        chunks.append(Chunk(first, [f"{file.name} row {first + k}" for k in range(count)],
                            functools.partial(read_encoded_row_group, str(file), group, image_column)))
    return Listing(rows.classes, rows.labels, chunks, rows.fixed_test, rows.ids, rows.fixed_val)


def read_encoded_row_group(file: str, group: int, column: str):
    """The bytes of each image of one row group, or why there are none (a ``Chunk.read``)."""
    values = tables.open_parquet(Path(file)).read_row_group(group, columns=[column]).column(column)
    if str(values.type).startswith("struct"):  # Hugging Face's {bytes, path} images
        values = pc.struct_field(values, "bytes")
    for value in values.to_pylist():
        yield value if isinstance(value, (bytes, bytearray)) else ImageRejected("empty (null) image")


def list_parquet_pixels(path, image_column: str, label_column: str, opts=None) -> PixelListing:
    """A table of pixel arrays, read a row group at a time."""
    rows = _table_rows(path, image_column, label_column, opts)
    return PixelListing(rows.classes, rows.labels, rows.ids, rows.fixed_test,
                        functools.partial(iter_parquet_pixels, rows.groups, image_column), f"column {image_column!r}",
                        rows.fixed_val)


@dataclass
class _TableRows:
    """A table listed: labels, ids and the row groups to read."""

    classes: list[str]
    labels: np.ndarray  # or LabelSets (--multi-label)
    ids: np.ndarray
    fixed_test: np.ndarray | None
    groups: list[tuple[Path, int, int, int]]  # (file, row group, first row position, rows)
    fixed_val: np.ndarray | None = None


def _table_rows(path, image_column: str, label_column: str, opts=None) -> _TableRows:
    """Labels, ids and a ``split`` column, read (column by column, safely) without the images."""
    path = Path(path)
    files = tables.parquet_files(path)
    if not files:
        raise ImgtrainError(f"no Parquet files at {path}; pass a .parquet file or a folder of them")
    split_column = getattr(opts, "split_column", None)
    try:
        wanted = [image_column, label_column] + ([split_column] if split_column else [])
        table = tables.read_parquet_columns(files, wanted,
                                            ["id", "split"], "choose with --image-column / --label-column"
                                            f"{' / --split-column' if split_column else ''}", skip=[image_column])
    except (pa.ArrowException, OSError) as e:
        raise ImgtrainError(f"cannot read Parquet data at {path}: {one_line(e, 200)}") from None
    if table.num_rows == 0:
        raise ImgtrainError(f"{path} has no rows")
    test, val = table_splits(table, split_column, f"--source {path}")
    labels, classes = table_labels(table, label_column, opts, (test, val),
                                   lambda r: f"row {r} of the table at {path}")
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
            groups.append((f, g, first, meta.row_group(g).num_rows))
            first += meta.row_group(g).num_rows
    return _TableRows(classes, labels, ids, test, groups, val)


def iter_parquet_pixels(groups: list[tuple[Path, int, int, int]], image_column: str):
    """(row positions int64 [n], pixels uint8 [n, H, W, C]) for each row group, in order."""
    opened: dict[Path, pq.ParquetFile] = {}  # the file being read: its footer parsed (and checked) once
    for file, group, first, _ in groups:
        if file not in opened:
            opened = {file: tables.open_parquet(file)}
        try:
            part = opened[file].read_row_group(group, columns=[image_column])
        except (pa.ArrowException, OSError) as e:
            raise ImgtrainError(f"cannot read {file}: {one_line(e, 200)}") from None
        pixels = tables.images_from_column(part.column(image_column), part.schema.field(image_column))
        yield np.arange(first, first + len(pixels), dtype=np.int64), pixels
