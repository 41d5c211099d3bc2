"""The dataset directory: what `imgtrain data prepare` writes (``writer.py``) and everything
else reads. A contract: every reader checks it.

    DIR/manifest.json                  name, classes, storage, image shape, preset, counts,
                                       normalisation, each file's row groups, sha256 of each file
    DIR/train/part-00000.parquet ...   columns: id int64, image, label int64
    DIR/val/...                        optional: selects the best checkpoint when present
    DIR/test/...

``storage`` says what ``image`` holds: ``tensor`` (small images such as MNIST digits: Ray Data's
fixed-shape uint8 tensor column [H, W, C], stored as ``large_list<uint8>`` plus field metadata,
which plain pyarrow reads without Ray) or ``encoded`` (photos: the PNG/JPEG bytes as they were,
decoded and augmented by the streamed reader). ``image_shape`` is then the stored shape, or the
training resolution. Files are written in row groups of up to 1,024 rows, listed in the manifest:
the unit the streamed reader shuffles and reads. Data sets of format 1 (tensor storage, no row
groups listed) are read as before.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import Union

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from imgtrain.data import tables
from imgtrain.errors import ImgtrainError, one_line
from imgtrain.ops.files import sha256_file

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
SPLITS = ("train", "test")  # every data set has these
ALL_SPLITS = ("train", "val", "test")
COLUMNS = ("id", "image", "label")
STORAGES = ("tensor", "encoded")
PRESETS = ("digits", "photos")
# MNIST's normalisation: pixels / 255 -> [0, 1] -> (x - 0.5) / 0.5 -> [-1, 1]; the Ray tutorial's
# inference code uses Normalize((0.5,), (0.5,)), so a model trained here matches it.
NORMALIZE_MEAN = 0.5
NORMALIZE_STD = 0.5
_REQUIRED_KEYS = ("format_version", "name", "source", "classes", "num_classes", "image_shape",
                  "channels", "splits", "class_counts", "normalize", "sha256", "created")
PathLike = Union[str, Path]


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
    if manifest["format_version"] not in READABLE_VERSIONS:
        raise ImgtrainError(
            f"{path} has format_version {manifest['format_version']!r}, this imgtrain reads "
            f"{', '.join(map(str, READABLE_VERSIONS))}; prepare the data set again or upgrade imgtrain"
        )
    manifest.setdefault("storage", "tensor")  # format 1
    manifest.setdefault("preset", default_preset(manifest.get("image_shape")))
    try:
        ok = (len(manifest["classes"]) == manifest["num_classes"]
              and len(manifest["image_shape"]) == 3
              and manifest["image_shape"][2] == manifest["channels"]
              and manifest["storage"] in STORAGES and manifest["preset"] in PRESETS
              and all(s in manifest["splits"] for s in SPLITS)
              and set(manifest["splits"]) <= set(ALL_SPLITS)
              and all(isinstance(v["files"], list) and isinstance(v["num_samples"], int)
                      for v in manifest["splits"].values()))
    except (TypeError, KeyError):
        ok = False
    if not ok:
        raise ImgtrainError(
            f"{path} is inconsistent (classes, image_shape or splits); prepare the data set again"
        )
    return manifest


def default_preset(image_shape) -> str:
    """Augmentation and evaluation transforms a data set gets unless told otherwise: the
    digits' affine for small grayscale images, the photo recipe for the rest."""
    h, w, c = image_shape if image_shape and len(image_shape) == 3 else (0, 0, 3)
    return "digits" if c == 1 and max(h, w) <= 64 else "photos"


def eval_split(manifest: dict) -> str:
    """The split training validates on (and picks the best checkpoint by): val when the data
    set has one, else test."""
    return "val" if "val" in manifest["splits"] else "test"


def split_files(data_dir: Path, manifest: dict, split: str) -> list[Path]:
    if split not in manifest["splits"]:
        raise ImgtrainError(f"unknown split {split!r}; this data set has: {', '.join(manifest['splits'])}")
    files = []
    for rel in manifest["splits"][split]["files"]:
        parts = PurePosixPath(rel)
        if parts.is_absolute() or ".." in parts.parts:  # a manifest must stay inside its dir
            raise ImgtrainError(
                f"{data_dir / MANIFEST} lists {rel!r}, outside the data set; prepare it again"
            )
        files.append(data_dir / rel)
    return files


_EXTENSION_NAME = tables.EXTENSION_NAME_KEY


def check_split_schema(schema: pa.Schema, rel: str, storage: str = "tensor") -> list[int] | None:
    """Refuse every schema but the data set's own: exactly ``id`` int64, ``image`` (a uint8
    tensor, or binary for encoded storage), ``label`` int64, nothing else, no other Arrow
    extension type. Returns the image shape a tensor column declares (None when encoded).

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
    elif storage == "encoded":
        field = schema.field("image")
        if (pa.types.is_binary(field.type) or pa.types.is_large_binary(field.type)) \
                and _EXTENSION_NAME not in (field.metadata or {}):
            return None
        problem = f"has image column {field.type}, expected encoded image bytes"
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
        if field.type.extension_name not in tables.TENSOR_EXTENSIONS:
            return None
        shape, storage = list(field.type.shape), field.type.storage_type
    elif meta.get(_EXTENSION_NAME, b"").decode(errors="replace") in tables.TENSOR_EXTENSIONS:
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
    shape = check_split_schema(schema, rel, manifest["storage"])
    if manifest["storage"] == "tensor" and shape != list(manifest["image_shape"]):
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
    for split in manifest["splits"]:
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


def read_split_file(path: Path, storage: str = "tensor") -> pa.Table:
    """One split file as an Arrow table, after its schema passed ``check_split_schema``
    (read from the footer first: no value of a refused column is ever converted)."""
    try:
        check_split_schema(pq.read_schema(path), str(path), storage)
        return pq.read_table(path, columns=list(COLUMNS))
    except (pa.ArrowException, OSError) as e:
        raise ImgtrainError(f"cannot read {path} ({one_line(e, 120)}); "
                            "prepare the data set again with `imgtrain data prepare`") from None


def row_groups(data_dir: Path, manifest: dict, split: str) -> list[tuple[Path, int, int]]:
    """Every (file, row group index, rows) of a split, in file order: the blocks the streamed
    reader works in. Format 1 data sets do not list them: read from the files' footers."""
    files = split_files(Path(data_dir), manifest, split)
    listed = manifest["splits"][split].get("row_groups")
    if listed is None:
        listed = [[pq.ParquetFile(f).metadata.row_group(g).num_rows for g in range(pq.ParquetFile(f).num_row_groups)]
                  for f in files]
    return [(f, g, rows) for f, groups in zip(files, listed) for g, rows in enumerate(groups)]


def read_row_group(path: Path, group: int, storage: str) -> pa.Table:
    """One row group of a split file, its schema checked first."""
    try:
        pf = pq.ParquetFile(path)
        check_split_schema(pf.schema_arrow, str(path), storage)
        return pf.read_row_group(group, columns=list(COLUMNS))
    except (pa.ArrowException, OSError) as e:
        raise ImgtrainError(f"cannot read {path} ({one_line(e, 120)}); prepare the data set again") from None


def read_split(data_dir: PathLike, split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A whole split of a data set with tensor storage, as numpy: (ids int64 [N], images uint8
    [N, H, W, C], labels int64 [N]), rows in file order. For small data sets: it holds them all.
    Plain pyarrow, no Ray cluster and no Ray import needed."""
    data_dir = Path(data_dir)
    manifest = load_manifest(data_dir)
    if manifest["storage"] != "tensor":
        raise ImgtrainError(f"{data_dir} keeps its images encoded: they are decoded as they stream, never "
                            "all at once (read it with imgtrain.data.stream)")
    ids, images, labels = [], [], []
    for path in split_files(data_dir, manifest, split):
        table = read_split_file(path)
        ids.append(table.column("id").to_numpy())
        field = table.schema.field("image")
        images.append(tables.tensor_column_to_numpy(table.column("image"), field))
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
    """One paragraph for humans: name, classes, images, per-split counts."""
    classes = manifest["classes"]
    shown = ", ".join(classes[:10]) + (f", ... ({len(classes) - 10} more)" if len(classes) > 10 else "")
    h, w, c = manifest["image_shape"]
    parts = []
    for s in ALL_SPLITS:
        if s in manifest["splits"]:
            counts = manifest["class_counts"][s]
            lo, hi = min(counts), max(counts)
            per = f"{lo:,} per class" if lo == hi else f"{lo:,}-{hi:,} per class"
            parts.append(f"{manifest['splits'][s]['num_samples']:,} {s} ({per})")
    kept = ("encoded PNG/JPEG, trained at" if manifest["storage"] == "encoded" else "uint8")
    mean = ", ".join(f"{v:.3f}" for v in manifest["normalize"]["mean"])
    std = ", ".join(f"{v:.3f}" for v in manifest["normalize"]["std"])
    skipped = manifest.get("skipped") or {}
    return (
        f"Data set {manifest['name']!r} from {manifest['source']}: {manifest['num_classes']} classes ({shown}); "
        f"images {kept} {h}x{w} with {c} channel{'s' if c != 1 else ''} (normalised with mean {mean} / std {std}, "
        f"{manifest['preset']} augmentation); {', '.join(parts)} samples"
        + (f"; {skipped['count']:,} unreadable file(s) skipped" if skipped.get("count") else "")
        + f"; created {manifest['created']}."
    )
