"""Users' Parquet (and CSV) tables: read safely, and turned into numpy.

A table is untrusted input: only the columns asked for are read, after each file's schema was
checked for Arrow extension types imgtrain does not read (Ray's pickled-object type runs code
when its values are read). Pixel columns may be nested lists (the Ray tutorial's
``df.image = data.numpy().tolist()``), a Ray or Arrow tensor column, channels first or last;
labels integer class ids or class-name strings.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from imgtrain.data.limits import MIN_IMAGE_ROW_BYTES, TableRows, check_class_count
from imgtrain.errors import ImgtrainError, one_line

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


def open_parquet(path: Path, rows: TableRows | None = None, where: str | None = None) -> pq.ParquetFile:
    """A user's Parquet file, opened (its footer read) and its row groups' row counts held to
    ``rows``' bounds (the file's own, when None) before any row is read."""
    try:
        file = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ImgtrainError(f"cannot read {path}: {one_line(e, 200)}") from None
    rows, where = rows or TableRows(), where or str(path)
    counts = [file.metadata.row_group(g).num_rows for g in range(file.metadata.num_row_groups)]
    for count in counts:
        rows.group(count, where)
    rows.file(sum(counts), Path(path).stat().st_size, where)  # the groups' sum: what is read
    return file


def check_parquet_columns(files: list[Path], required: list[str], optional: list[str], hint: str,
                          rows: TableRows) -> list[list[str]]:
    """The ``required`` and (where present) ``optional`` columns of each of a user's Parquet
    files, after every file's footer was checked: its rows held to ``rows``' bounds, its columns
    for extension types imgtrain does not read. A missing required column is an error naming
    what exists + ``hint``. Nothing but the footers is read."""
    present_in = []
    for f in files:
        schema = open_parquet(f, rows).schema_arrow
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
        present_in.append(present)
    return present_in


def read_parquet_columns(files: list[Path], required: list[str], optional: list[str], hint: str,
                         skip: list[str] = (), min_row_bytes: float = MIN_IMAGE_ROW_BYTES) -> pa.Table:
    """The ``required`` and (where present) ``optional`` columns of a user's Parquet files,
    concatenated, once every file's footer passed ``check_parquet_columns`` (rows at least
    ``min_row_bytes`` each). Columns in ``skip`` are checked but not read (the images, when
    only the labels are wanted)."""
    present_in = check_parquet_columns(files, required, optional, hint, TableRows(min_row_bytes))
    parts = [pq.read_table(f, columns=[c for c in present if c not in skip]) for f, present in zip(files, present_in)]
    return pa.concat_tables(parts) if len(parts) > 1 else parts[0]


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
    """A column of pixel arrays (nested lists, a Ray or Arrow tensor column) -> uint8 [N, H, W, C]."""
    name, typ = field.name, column.type
    is_list = _is_list(typ)
    ray_tensor_storage = (field.metadata or {}).get(b"ARROW:extension:name") is not None
    if isinstance(typ, (pa.ExtensionType, pa.FixedShapeTensorType)) or ray_tensor_storage:
        arrays = tensor_column_to_numpy(column, field)
    elif is_list:  # the Ray tutorial's `df.image = data.numpy().tolist()`: [H][W] or [H][W][C]
        arrays = _nested_lists_to_numpy(column.combine_chunks(), name)
    else:
        raise ImgtrainError(
            f"column {name!r} has type {typ}; expected nested lists of pixels or a tensor column here "
            "(PNG/JPEG bytes are decoded as they stream)"
        )
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


def labels_from_column(column: pa.ChunkedArray, name: str) -> tuple[np.ndarray, list[str]]:
    """Label column -> (int64 [N], class names). Ints: classes '0'..str(max); strings: sorted unique."""
    if column.null_count:
        raise ImgtrainError(f"label column {name!r} has {column.null_count} empty (null) values")
    if pa.types.is_dictionary(column.type):
        column = column.cast(column.type.value_type)
    typ = column.type
    if pa.types.is_string(typ) or pa.types.is_large_string(typ):
        # A string per class, not per row: each row's is looked up by its dictionary index.
        distinct = pc.unique(column)
        check_class_count(len(distinct), f"label column {name!r}")
        classes = sorted(distinct.to_pylist())
        rank = np.searchsorted(np.array(classes, dtype=object), np.array(distinct.to_pylist(), dtype=object))
        return rank[pc.index_in(column, value_set=distinct).to_numpy()].astype(np.int64), classes
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
