"""What ``imgtrain predict`` (and ``evaluate``) read, in chunks: never all images at once.

Inputs, recognised in this order:
  * a prepared data set directory (has manifest.json): one split, with ids and labels;
  * a Parquet file, or a directory of them: an image column (PNG/JPEG bytes, pixel arrays or a
    tensor column), plus ``id`` and ``label`` columns when present;
  * a directory of PNG/JPEG files (searched recursively), a glob (``photos/*.png``), or one file.

The input is first listed (paths, or slices of row groups) into tasks of a few dozen images; each task
is read, decoded and converted to what the model takes (``read_task``), in this process or in
Ray Data's tasks, and predicted batch by batch. Conversion: ``L`` or ``RGB`` for the channel
count, then the model's evaluation transform (the data set's preset: a bilinear resize for
digits, resize and centre crop for photos). Files that cannot be used are reported by path
and skipped (``on_error="skip"``) or stop the command (``on_error="fail"``; nothing is written).
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from imgtrain.data.images import (
    IMAGE_SUFFIXES,
    ImageRejected,
    conform_image,
    damage,
    open_image,
    read_image_file,
)
from imgtrain.errors import ImgtrainError, one_line
from imgtrain.ops import spreadsheet

TASK_FILES = 64  # images per task
TASK_ROWS = 256  # rows of a Parquet row group per task (the Hub's image files hold 100 to 1,000 a group)
GROUP_SLICES = 16  # tasks of one row group at most: each decodes the rows before its own (no skipping in Parquet)
ROW_KEY = "_row"  # input position, so outputs come back in input order whatever Ray does
ERROR_KEY = "_error"  # why a row cannot be used ("" when it can)
CONVERTED_KEY = "_converted"  # whether the image had to be converted to the model's size or mode


@dataclass
class Inputs:
    """An input, listed: the tasks that read it and the columns each row carries along."""

    tasks: list[dict]  # plain dicts (they travel to Ray Data's tasks)
    columns: tuple[str, ...]  # "path", or "id" (and "label")
    total: int


def list_inputs(spec: str, split: str = "test", image_column: str = "image") -> Inputs:
    from imgtrain.ops.remote import is_remote
    from imgtrain.data.staging import local_data

    if is_remote(spec):  # a prepared data set in an object store: copied to this machine first
        spec = local_data(spec)
    path = Path(spec).expanduser()
    if (path / "manifest.json").is_file():
        return _dataset_inputs(path, split)
    if path.suffix == ".parquet" or (path.is_dir() and any(path.rglob("*.parquet"))):
        return _parquet_inputs(path, image_column)
    paths = _image_paths(spec)
    tasks = [{"kind": "files", "first": i, "paths": [str(p) for p in paths[i:i + TASK_FILES]]}
             for i in range(0, len(paths), TASK_FILES)]
    return Inputs(tasks, ("path",), len(paths))


def _dataset_inputs(path: Path, split: str) -> Inputs:
    from imgtrain.data import stream
    from imgtrain.data.format import is_multi_label, load_manifest

    manifest = load_manifest(path)
    if split not in manifest["splits"]:
        raise ImgtrainError(f"data set {path} has no split {split!r}; it has {', '.join(manifest['splits'])}")
    tasks, first = [], 0
    for f, g, rows in stream.blocks(path, manifest, split):
        tasks.append({"kind": "dataset", "first": first, "data": str(path),
                      "task": {"file": f, "group": g, "first": 0, "count": rows}})
        first += rows
    carried = ("id", "true_labels") if is_multi_label(manifest) else ("id", "label")
    return Inputs(tasks, carried, manifest["splits"][split]["num_samples"])


def _parquet_inputs(path: Path, image_column: str) -> Inputs:
    import pyarrow.parquet as pq

    from imgtrain.data.limits import TableRows
    from imgtrain.data.tables import check_parquet_columns, parquet_files

    files = parquet_files(path)
    if not files:
        raise ImgtrainError(f"no Parquet file at {path}")
    try:  # the footers only: columns and the rows they declare checked, nothing read
        present = check_parquet_columns(files, [image_column], ["id", "label"], "choose with --image-column",
                                        TableRows())
    except OSError as e:
        raise ImgtrainError(f"cannot read Parquet data at {path}: {one_line(e, 200)}") from None
    tasks, first = [], 0
    for f, columns in zip(files, present):
        meta = pq.read_metadata(f)
        for g in range(meta.num_row_groups):
            rows = meta.row_group(g).num_rows
            size = max(TASK_ROWS, -(-rows // GROUP_SLICES))  # a big row group in slices, not one task
            for start in range(0, rows, size):
                tasks.append({"kind": "parquet", "first": first + start, "file": str(f), "group": g, "start": start,
                              "count": min(size, rows - start), "columns": columns})
            first += rows
    carried = {c for columns in present for c in columns}
    return Inputs(tasks, tuple(c for c in ("id", "label") if c in carried and c != image_column), first)


def _image_paths(spec: str) -> list[Path]:
    path = Path(spec).expanduser()
    if any(ch in spec for ch in "*?["):
        # pathlib's ** does not descend into linked folders; glob.glob(recursive=True) does,
        # and a link to a parent folder made it walk in circles.
        first = next(i for i, part in enumerate(path.parts) if any(ch in part for ch in "*?["))
        base = Path(*path.parts[:first]) if first else Path(".")
        return _visible(base, base.glob(str(Path(*path.parts[first:]))))
    if path.is_dir():
        return _visible(path, path.rglob("*"))
    if path.exists():  # a FIFO or a device too: rejected unread, with the reason (read_image_file)
        return [path]
    raise ImgtrainError(
        f"input {spec} does not exist; pass a prepared data set, a Parquet file, an image folder, a glob or an image"
    )


def _visible(base: Path, found) -> list[Path]:
    """Files among ``found`` (paths under ``base``), hidden ones (.DS_Store, .git) left out; special
    files (FIFOs, sockets) are kept, to be reported unread like any file that cannot be used."""
    return sorted(p for p in found
                  if not p.is_dir() and not any(part.startswith(".") for part in p.relative_to(base).parts))


# ---------------------------------------------------------------- reading one task


def read_task(batch: dict, shape, preset: str) -> dict:
    """Ray Data ``map_batches`` function (batch_size=1), or called directly: one task's rows as
    {ROW_KEY, the carried columns, "image" uint8 [k, H, W, C], ERROR_KEY, CONVERTED_KEY}. A row
    that cannot be used keeps its place with a black image and the reason in ERROR_KEY."""
    task = json.loads(batch["task"][0])
    if task["kind"] == "dataset":
        return _read_dataset_task(task, shape, preset)
    sources = _task_sources(task)
    h, w, c = shape
    out = {ROW_KEY: np.arange(task["first"], task["first"] + len(sources["items"]), dtype=np.int64),
           "image": np.zeros((len(sources["items"]), h, w, c), np.uint8),
           ERROR_KEY: np.full(len(sources["items"]), "", dtype=object),
           CONVERTED_KEY: np.zeros(len(sources["items"]), bool)}
    for k, item in enumerate(sources["items"]):
        try:
            out["image"][k], out[CONVERTED_KEY][k] = _convert(item, shape, preset)
        except ImageRejected as e:
            out[ERROR_KEY][k] = f"cannot be used ({e})"
        except Exception as e:  # unreadable, truncated, not really an image
            out[ERROR_KEY][k] = f"cannot be decoded ({damage(e, None)})"
    out.update(sources["columns"])
    out[ERROR_KEY] = out[ERROR_KEY].astype(str)
    return out


def _task_sources(task: dict) -> dict:
    """{"items": one entry per row (bytes, a path, an array, or an ImageRejected), "columns"}."""
    if task["kind"] == "files":
        items = [Path(p) if Path(p).suffix.lower() in IMAGE_SUFFIXES else ImageRejected("not a .png/.jpg/.jpeg file")
                 for p in task["paths"]]
        return {"items": items, "columns": {"path": np.asarray(task["paths"], dtype=str)}}
    import pyarrow as pa
    import pyarrow.compute as pc

    from imgtrain.data.tables import images_from_column

    table = _row_group_slice(task)
    image_column = task["columns"][0]
    column = table.column(image_column)
    columns = {}
    for name in ("id", "label"):
        if name in table.column_names and name != image_column:
            col = table.column(name)
            if pa.types.is_integer(col.type) and col.null_count == 0:
                columns[name] = col.to_numpy().astype(np.int64)
    if pa.types.is_struct(column.type):  # Hugging Face's {bytes, path} images
        column = pc.struct_field(column, "bytes")
    if pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type):
        items = [v if v is not None else ImageRejected("empty (null) image") for v in column.to_pylist()]
    else:
        items = list(images_from_column(column, table.schema.field(image_column)))
    if "id" not in columns:
        columns["id"] = np.arange(task["first"], task["first"] + len(items), dtype=np.int64)
    return {"items": items, "columns": columns}


def _row_group_slice(task: dict):
    """Rows ``start`` to ``start + count`` of one row group, only the task's columns (checked when
    listed), read ``count`` at a time: a slice of a big row group never holds the whole group."""
    import pyarrow as pa

    from imgtrain.data.tables import open_parquet

    file = open_parquet(Path(task["file"]))  # its row counts checked again: it may have changed since
    start, end, position, pieces = task["start"], task["start"] + task["count"], 0, []
    for batch in file.iter_batches(batch_size=task["count"], row_groups=[task["group"]], columns=task["columns"]):
        if position + batch.num_rows > start:
            pieces.append(batch.slice(max(start - position, 0), end - max(start, position)))
        position += batch.num_rows
        if position >= end:
            break
    if not pieces:
        raise ImgtrainError(f"{task['file']} has fewer rows than when it was listed")
    return pa.Table.from_batches(pieces)


def _convert(item, shape, preset: str) -> tuple[np.ndarray, bool]:
    if isinstance(item, ImageRejected):
        raise item
    if isinstance(item, np.ndarray):
        return conform_array(item, shape, preset), item.shape != tuple(shape)
    with open_image(item if isinstance(item, (bytes, bytearray)) else read_image_file(item)) as im:
        return conform_image(im, shape, preset)


def _read_dataset_task(task: dict, shape, preset: str) -> dict:
    """A row group of a prepared data set, through the streamed reader's evaluation transform. A
    multi-label data set's label sets are carried as ``true_labels``: the class names joined by its
    separator, as ``predict`` writes the predicted ones (``multilabel_answers.py``)."""
    from imgtrain.data import format as fmt
    from imgtrain.data import stream

    manifest = fmt.load_manifest(task["data"])
    multi = fmt.is_multi_label(manifest)
    reader = stream.Reader(task["data"], manifest["storage"], preset, tuple(shape), train=False, augment=False,
                           multi_label_classes=manifest["num_classes"] if multi else 0)
    rows = stream.read_task(task["task"], reader)
    n = len(rows["id"])
    converted = manifest["storage"] == "encoded" or list(manifest["image_shape"]) != list(shape)
    if multi:
        from imgtrain.inference.multilabel_answers import joined

        labels = {"true_labels": joined(rows["label"], manifest["classes"], fmt.label_separator(manifest)).astype(str)}
    else:
        labels = {"label": rows["label"]}
    return {ROW_KEY: np.arange(task["first"], task["first"] + n, dtype=np.int64), "id": rows["id"],
            **labels, "image": rows["image"], ERROR_KEY: np.full(n, "", dtype=str),
            CONVERTED_KEY: np.full(n, converted and manifest["storage"] == "tensor")}


def conform_array(pixels: np.ndarray, shape, preset: str = "digits") -> np.ndarray:
    """uint8 [H', W', C'] -> the model's [H, W, C], with the same rule as image files."""
    from PIL import Image

    if pixels.shape == tuple(shape):
        return pixels
    pil = Image.fromarray(pixels[..., 0] if pixels.shape[-1] == 1 else pixels)
    return conform_image(pil, shape, preset)[0]


def conform(images: np.ndarray, image_shape, preset: str = "digits") -> tuple[np.ndarray, int]:
    """uint8 [N, H', W', C'] -> [N, H, W, C]; how many were converted."""
    if images.shape[1:] == tuple(image_shape):
        return images, 0
    return np.stack([conform_array(x, image_shape, preset) for x in images]), len(images)


# ---------------------------------------------------------------- writing the predictions


def check_output(out, overwrite: bool = False) -> Path:
    """The --out path, refused unless it is .parquet or .csv and new (or ``overwrite``)."""
    out = Path(out).expanduser()
    if out.suffix.lower() not in (".parquet", ".csv"):
        raise ImgtrainError(f"--out {out}: use a .parquet or .csv file name")
    if out.exists() and not overwrite:
        raise ImgtrainError(f"{out} already exists; pass --overwrite or another --out")
    return out


def csv_safe(frame):
    """``frame`` with every text cell that a spreadsheet would run as a formula prefixed with a
    single quote (``ops.spreadsheet``). For CSV only: Parquet (and JSON) keep the exact value."""
    text = frame.select_dtypes(include=["object", "string"]).columns
    return frame.assign(**{c: frame[c].map(spreadsheet.safe_cell) for c in text})


class TableWriter:
    """Predictions appended batch by batch (Parquet or CSV by extension) to a temporary file
    that replaces ``out`` only when ``commit`` is called: written whole, or not at all."""

    def __init__(self, out: Path):
        self.out, self.rows = out, 0
        self.tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        self.writer = None

    def write(self, frame) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            if self.out.suffix.lower() == ".csv":
                # text quoted too (OWASP's advice as well): a CR inside a cell would start a new row
                csv_safe(frame).to_csv(self.tmp, index=False, mode="a", header=self.rows == 0,
                                       quoting=csv.QUOTE_NONNUMERIC)
            else:
                table = pa.Table.from_pandas(frame, preserve_index=False)
                if self.writer is None:
                    self.out.parent.mkdir(parents=True, exist_ok=True)
                    self.writer = pq.ParquetWriter(self.tmp, table.schema)
                self.writer.write_table(table.cast(self.writer.schema))
        except OSError as e:
            self.abort()
            raise ImgtrainError(f"cannot write {self.out}: {e.strerror or e}") from None
        self.rows += len(frame)

    def commit(self) -> Path:
        if self.writer is not None:
            self.writer.close()
        os.replace(self.tmp, self.out)
        return self.out

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.tmp.unlink(missing_ok=True)
