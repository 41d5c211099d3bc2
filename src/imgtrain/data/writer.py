"""Writing a prepared data set directory, a few rows at a time: memory stays bounded by one row
group per split, whatever the number of images.

Everything goes into a hidden temporary sibling of the output folder, renamed into place only
when the manifest is complete, so a crash or an error never leaves half a data set behind;
an earlier data set is replaced only if its folder holds nothing but its own files.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from imgtrain.data.format import (FORMAT_VERSION, MANIFEST, MULTI_LABEL_FORMAT_VERSION, ROW_GROUP_ROWS,
                                  SOURCES_FILE, load_manifest, manifest_problems, side_files)
from imgtrain.data.label_sets import LabelSets
from imgtrain.data.row_names import NamesWriter
from imgtrain.errors import ImgtrainError, one_line
from imgtrain.ops.files import sha256_file, swap_in_folder

ROW_GROUP_BYTES = 8 << 20  # fewer rows than ROW_GROUP_ROWS in a row group, for large encoded images
FILE_BYTES = 256 << 20  # a new part-NNNNN.parquet past this (shards of a few hundred MB)


class SplitWriter:
    """One split's part-NNNNN.parquet files: id int64, image (uint8 tensor or encoded bytes),
    label int64 (``labels`` list<int64> when given ``LabelSets``), in row groups of at most
    ROW_GROUP_ROWS rows."""

    def __init__(self, folder: Path, storage: str, num_classes: int, rows_per_file: int = 0):
        self.folder, self.storage, self.rows_per_file = folder, storage, rows_per_file
        self.files: list[Path] = []
        self.row_groups: list[list[int]] = []
        self.counts = np.zeros(num_classes, np.int64)
        self.rows = 0
        self.set_sizes = np.zeros(1, np.int64)  # multi-label: images with 0, 1, 2, ... labels
        self.pending: list[tuple[np.ndarray, np.ndarray, object]] = []
        self.pending_rows = self.pending_bytes = self.file_bytes = self.file_rows = 0
        self.writer: pq.ParquetWriter | None = None
        self.shape: tuple[int, ...] | None = None

    def add(self, ids: np.ndarray, labels: np.ndarray, images) -> None:
        """Rows in the order given: images uint8 [n, H, W, C] (tensor) or a list of bytes (encoded)."""
        if not len(ids):
            return
        if isinstance(labels, LabelSets):
            self.counts += labels.counts(len(self.counts))
            sizes = np.bincount(labels.sizes(), minlength=len(self.set_sizes))
            self.set_sizes = np.pad(self.set_sizes, (0, len(sizes) - len(self.set_sizes))) + sizes
        else:
            self.counts += np.bincount(labels, minlength=len(self.counts))
            labels = np.asarray(labels, np.int64)
        self.rows += len(ids)
        size = images.nbytes if isinstance(images, np.ndarray) else sum(len(b) for b in images)
        self.pending.append((np.asarray(ids, np.int64), labels, images))
        self.pending_rows += len(ids)
        self.pending_bytes += size
        while self.pending_rows >= ROW_GROUP_ROWS or self.pending_bytes >= ROW_GROUP_BYTES:
            self._flush()

    def close(self) -> None:
        while self.pending_rows:
            self._flush()
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    @property
    def num_rows(self) -> int:
        return self.rows

    def _flush(self) -> None:
        """Write one row group, into a new file when the current one is full."""
        new_file = self.writer is None or self.file_bytes >= FILE_BYTES
        limit = ROW_GROUP_ROWS
        if self.rows_per_file:
            new_file = new_file or self.file_rows >= self.rows_per_file
            limit = min(limit, self.rows_per_file - (0 if new_file else self.file_rows))
        ids, labels, images = self._take(limit)
        if self.storage == "tensor":
            from ray.data.extensions.tensor_extension import (
                ArrowTensorArray,  # Ray's tensor column
            )

            column = ArrowTensorArray.from_numpy(np.ascontiguousarray(images))
        else:
            column = pa.array(images, pa.binary())
        multi = isinstance(labels, LabelSets)
        label = ("labels", labels.to_arrow()) if multi else ("label", pa.array(labels, pa.int64()))
        table = pa.table({"id": pa.array(ids, pa.int64()), "image": column, label[0]: label[1]})
        if new_file:
            self._next_file(table.schema)
        self.writer.write_table(table, row_group_size=len(ids))
        self.row_groups[-1].append(len(ids))
        self.file_rows += len(ids)
        self.file_bytes += table.nbytes

    def _take(self, limit: int):
        """The next row group's rows, in order: up to ``limit`` rows and ROW_GROUP_BYTES (one row
        at least, however large)."""
        ids, labels, images, taken, size = [], [], [], 0, 0
        while self.pending and taken < limit:
            i, y, x = self.pending[0]
            row_bytes = np.full(len(i), x[0].nbytes) if isinstance(x, np.ndarray) else np.array([len(b) for b in x])
            fits = int(np.searchsorted(np.cumsum(row_bytes), ROW_GROUP_BYTES - size, side="right"))
            n = min(len(i), limit - taken, max(fits, 0 if taken else 1))
            if n == 0:
                break
            ids.append(i[:n]), labels.append(y[:n]), images.append(x[:n])
            taken, size = taken + n, size + int(row_bytes[:n].sum())
            if n == len(i):
                self.pending.pop(0)
            else:
                self.pending[0] = (i[n:], y[n:], x[n:])
        self.pending_rows -= taken
        self.pending_bytes -= size
        joined = np.concatenate(images) if isinstance(images[0], np.ndarray) else [b for part in images for b in part]
        joined_labels = LabelSets.concat(labels) if isinstance(labels[0], LabelSets) else np.concatenate(labels)
        return np.concatenate(ids), joined_labels, joined

    def _next_file(self, schema: pa.Schema) -> None:
        if self.writer is not None:
            self.writer.close()
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"part-{len(self.files):05d}.parquet"
        self.writer = pq.ParquetWriter(path, schema, compression="zstd" if self.storage == "tensor" else "none")
        self.files.append(path)
        self.row_groups.append([])
        self.file_bytes = self.file_rows = 0


class DatasetWriter:
    """A whole data set directory: ``with DatasetWriter(...) as out: out.add(split, ...);
    manifest = out.finish(fields)``. Nothing appears at ``out_dir`` unless ``finish`` succeeds."""

    def __init__(self, out_dir, classes: list[str], storage: str, splits=("train", "test"),
                 overwrite: bool = False, rows_per_file: int = 0, multi_label: bool = False):
        self.out_dir = Path(out_dir).absolute()
        prepare_target(self.out_dir, overwrite)
        self.classes, self.storage, self.multi_label = list(classes), storage, multi_label
        self.tmp = self.out_dir.parent / f".{self.out_dir.name}.partial-{uuid.uuid4().hex[:8]}"
        try:
            self.tmp.mkdir(parents=True)
        except OSError as e:
            raise ImgtrainError(f"cannot write data set to {self.out_dir}: {one_line(e, 120)}") from None
        self.splits = {s: SplitWriter(self.tmp / s, storage, len(classes), rows_per_file) for s in splits}
        self.names: NamesWriter | None = None  # sources.parquet, when add_names is called

    def __enter__(self) -> "DatasetWriter":
        return self

    def __exit__(self, *exc) -> None:
        for writer in [s.writer for s in self.splits.values()] + [self.names and self.names.writer]:
            if writer is not None:
                writer.close()
        shutil.rmtree(self.tmp, ignore_errors=True)  # nothing left after a successful finish()

    def add(self, split: str, ids, labels, images) -> None:
        try:
            self.splits[split].add(ids, labels, images)
        except OSError as e:  # a full disk, ...
            raise ImgtrainError(f"cannot write data set to {self.out_dir}: {one_line(e, 120)}") from None

    def add_names(self, ids, names: list[str]) -> None:
        """Where the images ``ids`` came from (paths relative to the source, ...): ``sources.parquet``."""
        try:
            if self.names is None:
                self.names = NamesWriter(self.tmp / SOURCES_FILE)
            self.names.add(ids, names)
        except OSError as e:
            raise ImgtrainError(f"cannot write data set to {self.out_dir}: {one_line(e, 120)}") from None

    def finish(self, fields: dict, beside: dict[str, str] | None = None) -> dict:
        """Close the files, write the manifest (``fields``: name, source, image_shape, channels,
        preset, normalize, options, ...) and ``beside`` ({name: text}, beside it: names of
        ``format.side_files``) and move the data set into place; returns the manifest."""
        try:
            for split in self.splits.values():
                split.close()
            empty = [name for name, split in self.splits.items() if split.num_rows == 0]
            if empty:
                raise ImgtrainError(f"the {' and '.join(empty)} split(s) would be empty; add images or change the fractions")
            files = {name: [p.relative_to(self.tmp).as_posix() for p in split.files] for name, split in self.splits.items()}
            if self.names is not None:
                fields = {**fields, "source_names": {"file": SOURCES_FILE, "rows": self.names.close()}}
            manifest = {
                "format_version": MULTI_LABEL_FORMAT_VERSION if self.multi_label else FORMAT_VERSION, **fields,
                **({"multi_label": True} if self.multi_label else {}),
                "classes": self.classes, "num_classes": len(self.classes),
                "storage": self.storage,
                "splits": {name: {"num_samples": split.num_rows, "files": files[name], "row_groups": split.row_groups}
                           for name, split in self.splits.items()},
                "class_counts": {name: split.counts.tolist() for name, split in self.splits.items()},
                **({"label_set_sizes": {name: split.set_sizes.tolist() for name, split in self.splits.items()}}
                   if self.multi_label else {}),
                "sha256": {rel: sha256_file(self.tmp / rel) for rels in files.values() for rel in rels},
                "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            }
            problems = manifest_problems(manifest)  # what every reader would refuse: said now, nothing written
            if problems:
                raise ImgtrainError(f"the data set would not be readable: {'; '.join(problems)}; for large images "
                                    "pass --size to train at a smaller resolution")
            for name, text in (beside or {}).items():
                (self.tmp / name).write_text(text)
            (self.tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
            swap_in_folder(self.tmp, self.out_dir)
        except OSError as e:  # permissions, full disk, ...
            raise ImgtrainError(f"cannot write data set to {self.out_dir}: {one_line(e, 120)}") from None
        return manifest


def prepare_target(out_dir: Path, overwrite: bool) -> None:
    """Refuse to clobber anything that is not ours: only an earlier data set may be replaced,
    and only when its folder holds nothing but the files its manifest lists."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ImgtrainError(f"{out_dir} exists and is not a directory; choose another output path")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        if not overwrite:
            raise ImgtrainError(f"{out_dir} already exists and is not empty; pass --overwrite to replace it")
        if not (out_dir / MANIFEST).is_file():
            raise ImgtrainError(
                f"{out_dir} is not empty and is not a prepared data set (no {MANIFEST}); refusing "
                "to replace it even with --overwrite; choose another directory"
            )
        others = _files_not_listed(out_dir)
        if others:
            shown = ", ".join(str(p.relative_to(out_dir)) for p in others[:3])
            more = f" and {len(others) - 3} more" if len(others) > 3 else ""
            raise ImgtrainError(
                f"{out_dir} holds {len(others)} file(s) imgtrain did not write ({shown}{more}); "
                "--overwrite replaces only a data set's own files: move them out or choose another directory"
            )


def _files_not_listed(data_dir: Path) -> list[Path]:
    """Files (and links) in a data set folder that its manifest does not list."""
    try:
        manifest = load_manifest(data_dir)
        ours = {data_dir / rel for s in manifest["splits"].values() for rel in s["files"]}
        ours |= {data_dir / name for name in side_files(manifest)}
    except ImgtrainError:  # a damaged manifest lists nothing we can trust
        ours = set()
    ours.add(data_dir / MANIFEST)
    return sorted(p for p in data_dir.rglob("*") if (p.is_file() or p.is_symlink()) and p not in ours)


def write_dataset(raw, out_dir, name: str, source: str, overwrite: bool = False, rows_per_file: int = 0,
                  options: dict | None = None, val_split: dict | None = None) -> dict:
    """Write an in-memory ``RawDataset`` (MNIST, tests: small tensor data sets) and return its
    manifest. ``options`` (e.g. the seed) is recorded in the manifest for reproducibility, and
    ``val_split``, where the validation split comes from (``prepare.val_plan``), when known."""
    from imgtrain.data.format import NORMALIZE_MEAN, NORMALIZE_STD, default_preset

    _validate(raw)
    if rows_per_file < 0:
        raise ImgtrainError(f"rows_per_file must be positive, got {rows_per_file}")
    h, w, c = raw.train.images.shape[1:]
    names = ("train", "val", "test") if raw.val is not None else ("train", "test")
    with DatasetWriter(out_dir, raw.classes, "tensor", names, overwrite, rows_per_file) as out:
        for split in names:
            part = getattr(raw, split)
            for start in range(0, len(part), ROW_GROUP_ROWS):  # never one giant Arrow column
                rows = slice(start, start + ROW_GROUP_ROWS)
                out.add(split, part.ids[rows], part.labels[rows], part.images[rows])
        return out.finish({
            "name": name, "source": source, "image_shape": [h, w, c], "channels": c,
            "preset": default_preset([h, w, c]),
            "normalize": {"mean": [NORMALIZE_MEAN] * c, "std": [NORMALIZE_STD] * c},
            "options": dict(options or {}), **({"val_split": val_split} if val_split else {}),
        })


def _validate(raw) -> None:
    """Collect every problem with ``raw`` and raise them together, before anything is written."""
    issues, shapes = [], set()
    k = len(raw.classes)
    if k < 2:
        issues.append(f"{k} class(es); need at least 2")
    parts = [("train", raw.train), ("test", raw.test)] + ([("val", raw.val)] if raw.val is not None else [])
    for name, split in parts:
        x, y, ids = split.images, split.labels, split.ids
        if x.dtype != np.uint8 or x.ndim != 4:
            issues.append(f"{name} images are {x.dtype} {list(x.shape)}; need uint8 [N, H, W, C]")
        else:
            shapes.add(x.shape[1:])
        if len(y) == 0:
            issues.append(f"{name} split is empty")
        if not (len(x) == len(y) == len(ids)):
            issues.append(f"{name} has {len(x)} images, {len(y)} labels, {len(ids)} ids")
        if len(y) and (y.min() < 0 or y.max() >= k):
            issues.append(f"{name} labels span {y.min()}..{y.max()}, outside [0, {k})")
    if len(shapes) > 1:
        issues.append(f"the splits' image shapes differ: {sorted(map(list, shapes))}")
    all_ids = np.concatenate([split.ids for _, split in parts])
    if len(np.unique(all_ids)) != len(all_ids):
        issues.append("ids are not unique across the splits")
    if issues:
        raise ImgtrainError("cannot write data set: " + "; ".join(issues))
