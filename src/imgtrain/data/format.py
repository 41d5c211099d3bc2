"""The dataset directory: what `imgtrain data prepare` writes and everything else reads.

Layout (a contract: every reader checks it, docs/ARCHITECTURE.md)::

    DIR/manifest.json                  name, classes, image shape, counts, normalisation, sha256
    DIR/train/part-00000.parquet ...   columns: id int64, image uint8 tensor [H, W, C], label int64
    DIR/test/part-00000.parquet ...

``image`` is Ray Data's fixed-shape tensor extension column, so ``ray.data.read_parquet`` yields
numpy uint8 [B, H, W, C] batches directly. In the file it is stored as ``large_list<uint8>`` plus
field metadata (extension name + shape), which :func:`read_split` decodes with plain pyarrow,
without importing Ray. Rows inside each split are already in a seeded random order.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Union

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from imgtrain.data import sources
from imgtrain.data.sources import RawDataset, Split
from imgtrain.errors import ImgtrainError, one_line
from imgtrain.ops.files import sha256_file

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "test")
COLUMNS = ("id", "image", "label")
SOURCES = ("mnist-sample", "mnist", "folder", "parquet")
DEFAULT_ROWS_PER_FILE = 10_000
# Fixed normalisation: pixels / 255 -> [0, 1] -> (x - 0.5) / 0.5 -> [-1, 1]; the Ray tutorial's
# inference code uses Normalize((0.5,), (0.5,)), so a model trained here matches it.
NORMALIZE_MEAN = 0.5
NORMALIZE_STD = 0.5
_REQUIRED_KEYS = ("format_version", "name", "source", "classes", "num_classes", "image_shape",
                  "channels", "splits", "class_counts", "normalize", "sha256", "created")
PathLike = Union[str, Path]


# ----------------------------------------------------------------------------------------------
# Writing


def _validate(raw: RawDataset) -> None:
    """Collect every problem with ``raw`` and raise them together, before anything is written."""
    issues, shapes = [], set()
    k = len(raw.classes)
    if k < 2:
        issues.append(f"{k} class(es); need at least 2")
    for name, split in (("train", raw.train), ("test", raw.test)):
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
        issues.append(f"train and test image shapes differ: {sorted(map(list, shapes))}")
    all_ids = np.concatenate([raw.train.ids, raw.test.ids])
    if len(np.unique(all_ids)) != len(all_ids):
        issues.append("ids are not unique across train and test")
    if issues:
        raise ImgtrainError("cannot write data set: " + "; ".join(issues))


def _write_split(split: Split, folder: Path, rows_per_file: int) -> list[Path]:
    """Write ``split`` as part-00000.parquet, ... of at most ``rows_per_file`` rows each."""
    # Ray's own tensor extension, so ray.data.read_parquet gives numpy [B, H, W, C] batches.
    from ray.data.extensions.tensor_extension import ArrowTensorArray

    folder.mkdir(parents=True)
    paths = []
    for part, start in enumerate(range(0, len(split), rows_per_file)):
        rows = slice(start, start + rows_per_file)
        table = pa.table({
            "id": pa.array(split.ids[rows], pa.int64()),
            "image": ArrowTensorArray.from_numpy(np.ascontiguousarray(split.images[rows])),
            "label": pa.array(split.labels[rows], pa.int64()),
        })
        path = folder / f"part-{part:05d}.parquet"
        pq.write_table(table, path, compression="zstd")
        paths.append(path)
    return paths


def _prepare_target(out_dir: Path, overwrite: bool) -> None:
    """Refuse to clobber anything that is not ours: only an earlier data set may be replaced,
    and only when its folder holds nothing but the files its manifest lists."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ImgtrainError(f"{out_dir} exists and is not a directory; choose another output path")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        if not overwrite:
            raise ImgtrainError(
                f"{out_dir} already exists and is not empty; pass --overwrite to replace it"
            )
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
        ours = {data_dir / rel for s in SPLITS for rel in manifest["splits"][s]["files"]}
    except ImgtrainError:  # a damaged manifest lists nothing we can trust
        ours = set()
    ours.add(data_dir / MANIFEST)
    return sorted(p for p in data_dir.rglob("*") if (p.is_file() or p.is_symlink()) and p not in ours)


def _check_not_nested(source: str, source_path: Path, out_dir: Path) -> None:
    """A source inside the output would be deleted by replacing the output; an output inside an
    image folder would be read as one more class folder the next time it is prepared."""
    src, out = Path(source_path).resolve(), Path(out_dir).resolve()
    if src == out or out in src.parents or (source == "folder" and src in out.parents):
        raise ImgtrainError(
            f"--source {source_path} and the output folder {out_dir} overlap; write the data set "
            "to a folder outside the source (and keep the source outside it)"
        )


def write_dataset(
    raw: RawDataset,
    out_dir: PathLike,
    name: str,
    source: str,
    overwrite: bool = False,
    rows_per_file: int = DEFAULT_ROWS_PER_FILE,
    options: dict | None = None,
) -> dict:
    """Write ``raw`` as a dataset directory at ``out_dir`` and return its manifest.

    Everything goes into a hidden temporary sibling first, which is renamed into place at the
    end, so a crash never leaves a half-written data set behind. ``options`` (e.g. the seed)
    is recorded in the manifest for reproducibility.
    """
    _validate(raw)
    if rows_per_file < 1:
        raise ImgtrainError(f"rows_per_file must be positive, got {rows_per_file}")
    out_dir = Path(out_dir).absolute()
    _prepare_target(out_dir, overwrite)
    tmp = out_dir.parent / f".{out_dir.name}.partial-{uuid.uuid4().hex[:8]}"
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        files = {s: _write_split(getattr(raw, s), tmp / s, rows_per_file) for s in SPLITS}
        k = len(raw.classes)
        h, w, c = raw.train.images.shape[1:]
        manifest = {
            "format_version": FORMAT_VERSION,
            "name": name,
            "source": source,
            "classes": list(raw.classes),
            "num_classes": k,
            "image_shape": [h, w, c],
            "channels": c,
            "splits": {
                s: {"num_samples": len(getattr(raw, s)),
                    "files": [p.relative_to(tmp).as_posix() for p in files[s]]}
                for s in SPLITS
            },
            "class_counts": {
                s: np.bincount(getattr(raw, s).labels, minlength=k).tolist() for s in SPLITS
            },
            "normalize": {"mean": [NORMALIZE_MEAN] * c, "std": [NORMALIZE_STD] * c},
            "sha256": {p.relative_to(tmp).as_posix(): sha256_file(p) for s in SPLITS for p in files[s]},
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "options": dict(options or {}),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if out_dir.exists():  # empty dir, or an earlier data set we were told to overwrite
            old = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(out_dir, old)
            os.rename(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out_dir)
    except OSError as e:  # permissions, full disk, ...
        raise ImgtrainError(f"cannot write data set to {out_dir}: {one_line(e, 120)}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op after a successful rename
    return manifest


# ----------------------------------------------------------------------------------------------
# Preparing from a named source


def prepare(
    source: str,
    out_dir: PathLike,
    *,
    source_path: PathLike | None = None,
    download: bool = False,
    image_column: str = "image",
    label_column: str = "label",
    channels: int | None = None,
    size: tuple[int, int] | None = None,
    test_fraction: float = 0.2,
    seed: int = 0,
    overwrite: bool = False,
) -> dict:
    """Load ``source`` and write it to ``out_dir``; returns the manifest.

    Options that do not apply to the chosen source are errors rather than silently ignored.
    """
    if source not in SOURCES:
        raise ImgtrainError(f"unknown data source {source!r}; choose one of: {', '.join(SOURCES)}")
    issues = []
    needs_path = source != "mnist-sample"
    if needs_path and source_path is None:
        issues.append(f"source {source!r} needs --source PATH")
    if not needs_path and source_path is not None:
        issues.append("mnist-sample is built in and takes no --source")
    if download and source != "mnist":
        issues.append("--download only applies to the mnist source")
    if source != "folder" and (channels is not None or size is not None):
        issues.append("--channels/--size only apply to the folder source")
    if source != "parquet" and (image_column, label_column) != ("image", "label"):
        issues.append("--image-column/--label-column only apply to the parquet source")
    if source in ("mnist-sample", "mnist") and test_fraction != 0.2:
        issues.append(f"{source} has a fixed train/test split; drop --test-fraction")
    if issues:
        raise ImgtrainError("; ".join(issues))
    if source_path is not None:
        _check_not_nested(source, source_path, out_dir)

    if source == "mnist-sample":
        raw = sources.load_mnist_sample(seed=seed)
    elif source == "mnist":
        raw = sources.load_mnist_idx(source_path, download=download, seed=seed)
    elif source == "folder":
        raw = sources.load_image_folder(source_path, channels=channels, size=size,
                                        test_fraction=test_fraction, seed=seed)
    else:
        raw = sources.load_parquet_table(source_path, image_column=image_column,
                                         label_column=label_column,
                                         test_fraction=test_fraction, seed=seed)
    where = f"{source}:{Path(source_path).absolute()}" if source_path is not None else source
    options = {"seed": seed, "test_fraction": test_fraction, "channels": channels,
               "size": list(size) if size else None}
    return write_dataset(raw, out_dir, name=Path(out_dir).absolute().name, source=where,
                         overwrite=overwrite, options=options)


# ----------------------------------------------------------------------------------------------
# Reading and checking


def load_manifest(data_dir: PathLike) -> dict:
    """The parsed manifest.json of a dataset directory, after a structural sanity check."""
    data_dir = Path(data_dir)
    hint = "create one with `imgtrain data prepare mnist-sample DIR`"
    if not data_dir.is_dir():
        raise ImgtrainError(f"data set directory {data_dir} does not exist; {hint}")
    path = data_dir / MANIFEST
    if not path.is_file():
        raise ImgtrainError(f"{data_dir} is not a prepared data set (no {MANIFEST}); {hint}")
    try:
        manifest = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ImgtrainError(f"{path} is not valid JSON ({e}); prepare the data set again")
    if not isinstance(manifest, dict):
        raise ImgtrainError(f"{path} is not a JSON object; prepare the data set again")
    missing = [k for k in _REQUIRED_KEYS if k not in manifest]
    if missing:
        raise ImgtrainError(f"{path} lacks {', '.join(missing)}; prepare the data set again")
    if manifest["format_version"] != FORMAT_VERSION:
        raise ImgtrainError(
            f"{path} has format_version {manifest['format_version']!r}, this imgtrain reads "
            f"{FORMAT_VERSION}; prepare the data set again or upgrade imgtrain"
        )
    try:
        ok = (len(manifest["classes"]) == manifest["num_classes"]
              and len(manifest["image_shape"]) == 3
              and manifest["image_shape"][2] == manifest["channels"]
              and all(isinstance(manifest["splits"][s]["files"], list)
                      and isinstance(manifest["splits"][s]["num_samples"], int) for s in SPLITS))
    except (TypeError, KeyError):
        ok = False
    if not ok:
        raise ImgtrainError(
            f"{path} is inconsistent (classes, image_shape or splits); prepare the data set again"
        )
    return manifest


def split_files(data_dir: Path, manifest: dict, split: str) -> list[Path]:
    if split not in SPLITS:
        raise ImgtrainError(f"unknown split {split!r}; choose one of: {', '.join(SPLITS)}")
    files = []
    for rel in manifest["splits"][split]["files"]:
        parts = PurePosixPath(rel)
        if parts.is_absolute() or ".." in parts.parts:  # a manifest must stay inside its dir
            raise ImgtrainError(
                f"{data_dir / MANIFEST} lists {rel!r}, outside the data set; prepare it again"
            )
        files.append(data_dir / rel)
    return files


_EXTENSION_NAME = sources.EXTENSION_NAME_KEY


def check_split_schema(schema: pa.Schema, rel: str) -> list[int]:
    """Refuse every schema but the data set's own: exactly ``id`` int64, ``image`` a uint8
    tensor, ``label`` int64, nothing else. Returns the image shape the column declares.

    A data set is untrusted input (its manifest's sha256 values are self-declared), so this is
    checked wherever split files are read, not only by ``verify_dataset``.
    """
    missing = [c for c in COLUMNS if c not in schema.names]
    extra = [c for c in schema.names if c not in COLUMNS] or (["a column twice"] if len(schema.names) > 3 else [])
    if missing:
        problem = f"lacks column(s) {', '.join(missing)}"
    elif extra:
        problem = f"has column(s) {', '.join(extra)} besides {', '.join(COLUMNS)}"
    elif any(schema.field(c).type != pa.int64() or _EXTENSION_NAME in (schema.field(c).metadata or {})
             for c in ("id", "label")):
        problem = f"has id {schema.field('id').type} / label {schema.field('label').type}, expected int64"
    else:
        shape = _tensor_field_shape(schema.field("image"))
        if shape is not None:
            return shape
        problem = f"has image column {schema.field('image').type}, expected a uint8 tensor"
    raise ImgtrainError(f"{rel} {problem}; it is not a file imgtrain wrote; prepare the data set again")


def _tensor_field_shape(field: pa.Field) -> list[int] | None:
    """The per-row shape of a uint8 tensor column, or None when the field is anything else.

    With Ray imported its tensor type is registered; without, pyarrow gives the storage type
    (a list of uint8) and the extension's name and shape only in the field metadata.
    """
    meta = field.metadata or {}
    if isinstance(field.type, pa.ExtensionType):
        if field.type.extension_name not in sources.TENSOR_EXTENSIONS:
            return None
        shape, storage = list(field.type.shape), field.type.storage_type
    elif meta.get(_EXTENSION_NAME, b"").decode(errors="replace") in sources.TENSOR_EXTENSIONS:
        try:
            shape = json.loads(meta.get(b"ARROW:extension:metadata", b""))
        except ValueError:
            return None
        shape = shape.get("shape") if isinstance(shape, dict) else shape  # Arrow's canonical type
        storage = field.type
    else:
        return None
    item = getattr(storage, "value_type", None)
    if item != pa.uint8() or not isinstance(shape, list) or not all(isinstance(d, int) for d in shape):
        return None
    return shape


def _check_file(path: Path, rel: str, manifest: dict) -> int:
    """Schema, image shape and label range of one Parquet file; returns its row count."""
    try:
        pf = pq.ParquetFile(path)
        schema = pf.schema_arrow
    except (pa.ArrowException, OSError) as e:
        raise ImgtrainError(f"{rel} is not a readable Parquet file ({one_line(e, 120)}); "
                            "prepare the data set again")
    shape = check_split_schema(schema, rel)
    if shape != list(manifest["image_shape"]):
        raise ImgtrainError(
            f"{rel} holds images of shape {shape}, the manifest says {manifest['image_shape']}; "
            "prepare the data set again"
        )
    try:
        labels = pf.read(columns=["label"]).column("label").to_numpy()
    except (pa.ArrowException, OSError) as e:
        raise ImgtrainError(f"{rel} is corrupt ({one_line(e, 120)}); prepare the data set again")
    bad = labels[(labels < 0) | (labels >= manifest["num_classes"])]
    if len(bad):
        raise ImgtrainError(
            f"{rel} has label {bad[0]} outside [0, {manifest['num_classes']}); "
            "prepare the data set again"
        )
    return pf.metadata.num_rows


def verify_dataset(data_dir: PathLike, check_hashes: bool = True) -> dict:
    """Check a dataset directory against its manifest; returns the manifest or raises.

    Reads only Parquet footers and label columns (plus the bytes, for the hashes), so it takes
    well under a second for the 5,000-image sample.
    """
    data_dir = Path(data_dir)
    manifest = load_manifest(data_dir)
    for split in SPLITS:
        files = split_files(data_dir, manifest, split)
        if not files or manifest["splits"][split]["num_samples"] <= 0:
            raise ImgtrainError(f"split {split!r} of {data_dir} is empty; prepare the data set again")
        rows = 0
        for rel, path in zip(manifest["splits"][split]["files"], files):
            if not path.is_file():
                raise ImgtrainError(f"{data_dir / rel} is missing; prepare the data set again")
            if check_hashes and sha256_file(path) != manifest["sha256"].get(rel):
                raise ImgtrainError(
                    f"{data_dir / rel} does not match its sha256 in the manifest (modified or "
                    "corrupt); prepare the data set again"
                )
            rows += _check_file(path, str(data_dir / rel), manifest)
        if rows != manifest["splits"][split]["num_samples"]:
            raise ImgtrainError(
                f"split {split!r} of {data_dir} has {rows} rows, the manifest says "
                f"{manifest['splits'][split]['num_samples']}; prepare the data set again"
            )
    return manifest


def read_split_file(path: Path) -> pa.Table:
    """One split file as an Arrow table, after its schema passed ``check_split_schema``
    (read from the footer first: no value of a refused column is ever converted)."""
    try:
        check_split_schema(pq.read_schema(path), str(path))
        return pq.read_table(path, columns=list(COLUMNS))
    except (pa.ArrowException, OSError) as e:
        raise ImgtrainError(f"cannot read {path} ({one_line(e, 120)}); "
                            "prepare the data set again with `imgtrain data prepare`") from None


def read_split(data_dir: PathLike, split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A whole split as numpy: (ids int64 [N], images uint8 [N, H, W, C], labels int64 [N]).

    Plain pyarrow, no Ray cluster and no Ray import needed; rows in file order, which is the
    seeded random order they were written in.
    """
    data_dir = Path(data_dir)
    manifest = load_manifest(data_dir)
    ids, images, labels = [], [], []
    for path in split_files(data_dir, manifest, split):
        table = read_split_file(path)
        ids.append(table.column("id").to_numpy())
        field = table.schema.field("image")
        images.append(sources.tensor_column_to_numpy(table.column("image"), field))
        labels.append(table.column("label").to_numpy())
    h, w, c = manifest["image_shape"]
    if not images:
        return np.zeros(0, np.int64), np.zeros((0, h, w, c), np.uint8), np.zeros(0, np.int64)
    x = np.concatenate(images) if len(images) > 1 else images[0]  # [N, H, W, C]
    if x.dtype != np.uint8 or x.shape[1:] != (h, w, c):
        raise ImgtrainError(
            f"{data_dir} split {split!r} holds {x.dtype} images of shape {list(x.shape[1:])}, "
            f"the manifest says uint8 {[h, w, c]}; prepare the data set again"
        )
    return (np.concatenate(ids).astype(np.int64), x, np.concatenate(labels).astype(np.int64))


def describe(manifest: dict) -> str:
    """One paragraph for humans: name, classes, image shape, per-split counts."""
    classes = manifest["classes"]
    shown = ", ".join(classes[:10]) + (f", ... ({len(classes) - 10} more)" if len(classes) > 10 else "")
    h, w, c = manifest["image_shape"]
    parts = []
    for s in SPLITS:
        counts = manifest["class_counts"][s]
        lo, hi = min(counts), max(counts)
        per = f"{lo:,} per class" if lo == hi else f"{lo:,}-{hi:,} per class"
        parts.append(f"{manifest['splits'][s]['num_samples']:,} {s} ({per})")
    return (
        f"Data set {manifest['name']!r} from {manifest['source']}: {manifest['num_classes']} "
        f"classes ({shown}); images {h}x{w} with {c} channel{'s' if c != 1 else ''} (uint8, "
        f"normalised with mean {manifest['normalize']['mean'][0]} / std "
        f"{manifest['normalize']['std'][0]}); {parts[0]} and {parts[1]} samples; "
        f"created {manifest['created']}."
    )
