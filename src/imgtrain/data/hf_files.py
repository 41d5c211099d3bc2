"""A Hugging Face data set on disk, read with pyarrow alone (the ``datasets`` library is not
needed): a ``save_to_disk`` folder (``state.json`` naming Arrow IPC stream files, the features
in ``dataset_info.json``), a DatasetDict folder (``dataset_dict.json`` and one such folder per
split), or Parquet/Arrow files as the Hub stores them (``data/train-00000-of-00001.parquet``,
the features in the schema's ``huggingface`` metadata).

Each file is read a unit at a time (a Parquet row group, an Arrow record batch), never whole,
once the rows its footer or headers declare passed ``limits.TableRows``' bounds; Arrow files
are memory-mapped, so skipping to a record batch reads only its header.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from imgtrain.data import tables
from imgtrain.data.images import ImageRejected
from imgtrain.data.limits import TableRows
from imgtrain.data.named_splits import split_of_name, splits_of_files
from imgtrain.errors import ImgtrainError, one_line

MAX_JSON_BYTES = 64 << 20  # dataset_info.json with 100,000 class names is a few MB
_ARROW_FILE_MAGIC = b"ARROW1"


@dataclass(frozen=True)
class Part:
    """One file of the data set: where it is, how messages name it, and the split it belongs to."""

    path: Path
    name: str
    split: str | None  # train, val, test; None: the source has no splits of its own


@dataclass
class Layout:
    parts: list[Part]
    features: dict | None  # dataset_info.json's features, when there is one
    not_read: list[tuple[str, str]]  # (name, why): splits other than train/validation/test


def find_parts(source: Path) -> Layout:
    """The files of a save_to_disk folder, a DatasetDict folder, or Parquet/Arrow files."""
    if (source / "dataset_dict.json").is_file():
        listed = read_json(source / "dataset_dict.json").get("splits")
        if not isinstance(listed, list) or not all(isinstance(s, str) and _plain(s) for s in listed):
            raise ImgtrainError(f"{source / 'dataset_dict.json'} does not list its splits as folder names")
        parts, features, not_read = [], None, []
        for name in listed:
            if split_of_name(name) is None:
                not_read.append((f"{name}/", f"split {name!r} is not train, validation or test: not read"))
                continue
            files, info = _dataset_folder(source / name)
            parts += [Part(f, f"{name}/{f.name}", split_of_name(name)) for f in files]
            features = features or info
        return Layout(parts, features, not_read)
    if (source / "state.json").is_file():
        files, info = _dataset_folder(source)
        return Layout([Part(f, f.name, None) for f in files], info, [])
    files = _table_files(source)
    names = [f.relative_to(source).as_posix() if source.is_dir() else f.name for f in files]
    return Layout([Part(f, n, s) for f, n, s in zip(files, names, splits_of_files(names, "files"))], None, [])


def _dataset_folder(folder: Path) -> tuple[list[Path], dict | None]:
    """The Arrow files a save_to_disk folder's state.json names, in order, and its features."""
    if not (folder / "state.json").is_file():
        raise ImgtrainError(f"{folder} is not a saved data set (no state.json); pass the folder save_to_disk wrote")
    entries = read_json(folder / "state.json").get("_data_files")
    names = [e.get("filename") if isinstance(e, dict) else None for e in entries or []]
    if not names or not all(isinstance(n, str) and _plain(n) for n in names):
        raise ImgtrainError(f"{folder / 'state.json'} does not name its data files (_data_files)")
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise ImgtrainError(f"{folder} lacks {missing[0]}, a data file its state.json names; copy the whole folder")
    info = read_json(folder / "dataset_info.json") if (folder / "dataset_info.json").is_file() else {}
    features = info.get("features")
    return [folder / n for n in names], features if isinstance(features, dict) else None


def _table_files(source: Path) -> list[Path]:
    if source.is_file():
        files = [source]
    elif source.is_dir():
        files = sorted(p for p in source.rglob("*") if p.suffix in (".parquet", ".arrow") and p.is_file()
                       and not any(part.startswith((".", "_")) for part in p.relative_to(source).parts))
    else:
        raise ImgtrainError(f"{source} does not exist; pass a save_to_disk folder or Parquet/Arrow files")
    if not files or any(f.suffix not in (".parquet", ".arrow") for f in files):
        raise ImgtrainError(f"no Hugging Face data set at {source}: pass a save_to_disk folder (state.json or "
                            "dataset_dict.json), a .parquet/.arrow file or a folder of them")
    return files


def _plain(name: str) -> bool:
    """A file or folder name, never a path that leaves the data set's folder."""
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name


def read_json(path: Path) -> dict:
    """A small JSON object of the data set's (untrusted: size-capped, an object or an error)."""
    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            raise ImgtrainError(f"{path} is over {MAX_JSON_BYTES >> 20} MB; not a Hugging Face metadata file")
        value = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: nested thousands deep
        raise ImgtrainError(f"cannot read {path}: {one_line(e, 200)}") from None
    if not isinstance(value, dict):
        raise ImgtrainError(f"{path} does not hold a JSON object")
    return value


def features_of(schema: pa.Schema) -> dict | None:
    """The features the ``datasets`` library wrote into a file's schema metadata, if any."""
    raw = (schema.metadata or {}).get(b"huggingface")
    try:
        features = json.loads(raw)["info"]["features"] if raw and len(raw) <= MAX_JSON_BYTES else None
    except (ValueError, KeyError, TypeError, RecursionError):
        return None
    return features if isinstance(features, dict) else None


# ---------------------------------------------------------------- reading a file a unit at a time


def schema_of(path: Path) -> pa.Schema:
    try:
        if path.suffix == ".parquet":
            return pq.read_schema(path)
        with pa.memory_map(str(path)) as source:
            source.seek(_ipc_start(source))
            return pa.ipc.open_stream(source).schema  # the stream's own, as units() reads it
    except (pa.ArrowException, OSError) as e:
        raise ImgtrainError(f"cannot read {path}: {one_line(e, 200)}") from None


def check_rows(path: Path, rows: TableRows, where: str) -> None:
    """Hold the rows a file declares to ``rows``' bounds (shared by the files of one source), from
    its footer (Parquet) or its batches' headers (Arrow), before any row is read."""
    if path.suffix == ".parquet":
        tables.open_parquet(path, rows, where)
        return
    with pa.memory_map(str(path)) as source:
        _ipc_checked(source, rows, where)


def units(path: Path, columns: list[str]) -> Iterator[list[pa.Array]]:
    """``columns`` of each unit of a file, in order: Parquet row groups, Arrow record batches;
    the file's row counts checked (alone) first."""
    if path.suffix == ".parquet":
        pf = tables.open_parquet(path)
        for g in range(pf.metadata.num_row_groups):
            table = pf.read_row_group(g, columns=columns)
            yield [table.column(c).combine_chunks() for c in columns]
        return
    with pa.memory_map(str(path)) as source:
        source.seek(_ipc_checked(source, TableRows(), str(path)))
        for batch in pa.ipc.open_stream(source):
            yield [batch.column(c) for c in columns]


def _ipc_start(source) -> int:
    """Where an Arrow file's messages start: after the file format's magic (padded to 8 bytes);
    the stream format (what save_to_disk writes) has none. Both are read as a stream, so what
    was checked is what is read (the file format's footer, which could point elsewhere, is not used)."""
    head = source.read(len(_ARROW_FILE_MAGIC))
    return 8 if head == _ARROW_FILE_MAGIC else 0


def _ipc_checked(source, rows: TableRows, where: str) -> int:
    """Every batch's length held to ``rows``' bounds, read from its header alone (a compressed
    body would be decompressed whole to learn it: the memory map leaves bodies unread); returns
    where the messages start."""
    start = _ipc_start(source)
    source.seek(start)
    total = 0
    try:
        for message in pa.ipc.MessageReader.open_stream(source):
            if message.type in ("record batch", "dictionary"):
                count = _declared_length(message.metadata.to_pybytes(), message.type == "dictionary")
                rows.group(count, where, "record batch")
                total += count
    except (pa.ArrowException, OSError, ValueError, struct.error) as e:
        raise ImgtrainError(f"cannot read {where}: {one_line(e, 200)}") from None
    rows.file(total, source.size(), where)
    return start


def _declared_length(header: bytes, dictionary: bool) -> int:
    """The largest length a record (or dictionary) batch's header declares: the batch's rows, or
    any of its arrays' (a struct's child may claim more). Read from the flatbuffer as Arrow's
    Message.fbs lays it out, since pyarrow offers no reader of a header alone: Message.header
    (field 2) -> [DictionaryBatch.data (field 1) ->] RecordBatch.length (field 0) and .nodes
    (field 1, structs of two int64: length, null count)."""

    def table(pos: int) -> tuple[int, int]:  # (where the table is, where its vtable is)
        return pos, pos - struct.unpack_from("<i", header, pos)[0]

    def field(tbl: tuple[int, int], i: int) -> int | None:  # where field i is; None: absent (its default)
        pos, vtable = tbl
        size = struct.unpack_from("<H", header, vtable)[0]
        offset = struct.unpack_from("<H", header, vtable + 4 + 2 * i)[0] if 4 + 2 * i < size else 0
        return pos + offset if offset else None

    def child(tbl: tuple[int, int], i: int) -> tuple[int, int] | None:  # the table field i points to
        at = field(tbl, i)
        return None if at is None else table(at + struct.unpack_from("<I", header, at)[0])

    batch = child(table(struct.unpack_from("<I", header, 0)[0]), 2)
    if dictionary and batch is not None:
        batch = child(batch, 1)
    if batch is None:
        return 0
    at = field(batch, 0)
    length = struct.unpack_from("<q", header, at)[0] if at is not None else 0
    at = field(batch, 1)
    if at is not None:
        nodes = at + struct.unpack_from("<I", header, at)[0]
        count = struct.unpack_from("<I", header, nodes)[0]
        lengths = np.frombuffer(header, "<i8", count=2 * count, offset=nodes + 4)[0::2]
        if count:
            length = -1 if lengths.min() < 0 else max(length, int(lengths.max()))  # -1: refused as broken
    return length


def read_images(path: str, unit: int, column: str, rows: list[int]):
    """The image bytes of ``rows`` of one unit, or why there are none (a ``Chunk.read``): the
    ``datasets`` library's {bytes, path} struct, or plain bytes."""
    if path.endswith(".parquet"):
        values = tables.open_parquet(Path(path)).read_row_group(unit, columns=[column]).column(0).combine_chunks()
        yield from _image_bytes(values.take(pa.array(rows, pa.int64())))
        return
    for k, (values,) in enumerate(units(Path(path), [column])):  # memory-mapped: skipping reads headers only
        if k == unit:
            yield from _image_bytes(values.take(pa.array(rows, pa.int64())))
            return
    yield from (ImageRejected("the file has fewer rows than when listed") for _ in rows)


def _image_bytes(values: pa.Array):
    if pa.types.is_struct(values.type):
        data = pc.struct_field(values, "bytes").to_pylist()
        has_path = values.type.get_field_index("path") >= 0
        paths = pc.struct_field(values, "path").to_pylist() if has_path else [None] * len(data)
    else:
        data, paths = values.to_pylist(), [None] * len(values)
    for value, where in zip(data, paths):
        if isinstance(value, (bytes, bytearray)):
            yield value
        elif where:  # an image the datasets library left as a path (not embedded): not read from here
            yield ImageRejected(f"not embedded, only its path is stored ({str(where)[:80]})")
        else:
            yield ImageRejected("empty (null) image")
