"""The dataset directory: what `imgtrain data prepare` writes (``writer.py``) and everything
else reads. A contract: every reader checks it.

    DIR/manifest.json                  name, classes, storage, image shape, preset, counts,
                                       normalisation, each file's row groups, sha256 of each file
    DIR/train/part-00000.parquet ...   columns: id int64, image, label int64 (multi-label: labels
                                       list<int64>, each image's class indices, sorted, maybe none)
    DIR/val/...                        optional: selects the best checkpoint when present
    DIR/test/...

``storage`` says what ``image`` holds: ``tensor`` (small images such as MNIST digits: Ray Data's
fixed-shape uint8 tensor column [H, W, C], stored as ``large_list<uint8>`` plus field metadata,
which plain pyarrow reads without Ray) or ``encoded`` (photos: the PNG/JPEG bytes as they were,
decoded and augmented by the streamed reader). ``image_shape`` is then the stored shape, or the
training resolution. Files are written in row groups of up to 1,024 rows, listed in the manifest:
the unit the streamed reader shuffles and reads. Data sets of format 1 (tensor storage, no row
groups listed) are read as before. A multi-label data set (``--multi-label``) is format 3: its
manifest says ``"multi_label": true``, ``class_counts`` counts the images carrying each label
and ``label_set_sizes`` the images with 0, 1, 2, ... labels; every reader hands its labels out
as a uint8 multi-hot array [n, num_classes] (``multi_hot``). Single-label data sets stay format 2.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from imgtrain.data import tables
from imgtrain.data.limits import MAX_CLASSES, MAX_IMAGE_PIXELS, MAX_IMAGE_SIDE
from imgtrain.errors import ImgtrainError, one_line
from imgtrain.ops.files import sha256_file

FORMAT_VERSION = 2
MULTI_LABEL_FORMAT_VERSION = 3  # what a multi-label data set is written as (format 2 readers refuse it)
READABLE_VERSIONS = (1, 2, 3)
MANIFEST = "manifest.json"
DEDUPE_FILE = "dedupe.csv"  # beside the manifest when prepared with --dedupe: what was dropped
SOURCES_FILE = "sources.parquet"  # beside it when the source names its images: id -> where from (row_names.py)
SPLITS = ("train", "test")  # every data set has these
ALL_SPLITS = ("train", "val", "test")
COLUMNS = ("id", "image", "label")
MULTI_LABEL_COLUMNS = ("id", "image", "labels")
STORAGES = ("tensor", "encoded")
PRESETS = ("digits", "photos")
# MNIST's normalisation: pixels / 255 -> [0, 1] -> (x - 0.5) / 0.5 -> [-1, 1]; the Ray tutorial's
# inference code uses Normalize((0.5,), (0.5,)), so a model trained here matches it.
NORMALIZE_MEAN = 0.5
NORMALIZE_STD = 0.5
_REQUIRED_KEYS = ("format_version", "name", "source", "classes", "num_classes", "image_shape",
                  "channels", "splits", "class_counts", "normalize", "sha256", "created")
PathLike = Union[str, Path]

# Bounds on the sizes a manifest declares. A data set is untrusted input and every reader sizes
# allocations and loops by these numbers: a training resolution of 50,000 px made `train` try to
# allocate 224 GiB, a listed row group of 10^9 rows 7.5 GiB, while `doctor` said ok. The image
# shape's bounds are limits.MAX_IMAGE_SIDE and limits.MAX_IMAGE_PIXELS.
# Rows per Parquet row group, at most: the unit the streamed reader shuffles, and the bound on a
# listed row group (the writer writes fewer for large encoded images).
ROW_GROUP_ROWS = 1024
# manifest.json itself is parsed whole: row groups and hashes of a data set of millions of
# images take a few MB.
MAX_MANIFEST_BYTES = 64 << 20


# ----------------------------------------------------------------------------------------------
# Reading and checking


def load_manifest(data_dir: PathLike) -> dict:
    """The parsed manifest.json of a dataset directory, after a structural sanity check that also
    holds every size it declares to its bound (``manifest_problems``)."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        what = f"{data_dir} is a file, not a prepared data set" if data_dir.exists() else \
            f"data set directory {data_dir} does not exist"
        raise ImgtrainError(f"{what}; {_prepare_hint(data_dir)}")
    path = data_dir / MANIFEST
    if not path.is_file():
        raise ImgtrainError(f"{data_dir} is not a prepared data set (no {MANIFEST}); {_prepare_hint(data_dir)}")
    size = path.stat().st_size
    if size > MAX_MANIFEST_BYTES:  # refused before it is read, let alone parsed
        raise ImgtrainError(f"{path} is {size:,} bytes, over the {MAX_MANIFEST_BYTES:,} a manifest can be; "
                            "prepare the data set again")
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
            f"{path} has format_version {short_repr(manifest['format_version'])}, this imgtrain reads "
            f"{', '.join(map(str, READABLE_VERSIONS))}; prepare the data set again or upgrade imgtrain"
        )
    manifest.setdefault("storage", "tensor")  # format 1
    problems = manifest_problems(manifest)
    if problems:
        raise ImgtrainError(f"{path}: {'; '.join(problems)}; prepare the data set again")
    manifest.setdefault("preset", default_preset(manifest["image_shape"]))
    return manifest


def _prepare_hint(path: Path) -> str:
    from imgtrain.data.prepare_hint import prepare_hint  # the sources, imported only to say this

    return prepare_hint(path)


def manifest_problems(manifest: dict) -> list[str]:
    """Every way the manifest's fields are malformed, inconsistent or out of their bounds, each
    naming the field, its value and the bound: reported together, checked before any reader
    sizes anything by them."""
    issues = []
    classes, k = manifest["classes"], manifest["num_classes"]
    if not _is_int(k) or not 1 <= k <= MAX_CLASSES:  # the classifier's output layer and every per-class table
        issues.append(f"num_classes {short_repr(k)} is not between 1 and {MAX_CLASSES:,} (limits.MAX_CLASSES)")
    elif not (isinstance(classes, list) and len(classes) == k and all(isinstance(c, str) for c in classes)):
        issues.append(f"classes is not a list of {k} names (num_classes)")
    shape, channels = manifest["image_shape"], manifest["channels"]
    if not _is_int(channels) or channels not in (1, 3):  # every model's first convolution takes 1 or 3
        issues.append(f"channels {short_repr(channels)} is not 1 or 3")
    if not (isinstance(shape, list) and len(shape) == 3 and all(_is_int(v) for v in shape)):
        issues.append(f"image_shape {short_repr(shape)} is not [height, width, channels]")
    else:
        h, w, c = shape
        if not (1 <= h <= MAX_IMAGE_SIDE and 1 <= w <= MAX_IMAGE_SIDE) or h * w > MAX_IMAGE_PIXELS:
            issues.append(f"image_shape {shape} is outside the bound of 1 to {MAX_IMAGE_SIDE} px a side and "
                          f"{MAX_IMAGE_PIXELS:,} pixels in all (the largest image imgtrain decodes)")
        if c != channels:
            issues.append(f"image_shape {shape} does not end in its channels, {short_repr(channels)}")
    if manifest["storage"] not in STORAGES:
        issues.append(f"storage {short_repr(manifest['storage'])} is not one of {', '.join(STORAGES)}")
    if manifest.get("preset", "digits") not in PRESETS:
        issues.append(f"preset {short_repr(manifest['preset'])} is not one of {', '.join(PRESETS)}")
    # every batch is normalised by them, per channel, after pixels are scaled to [0, 1]
    norm = manifest["normalize"]
    if not (isinstance(norm, dict) and _numbers(norm.get("mean"), channels, 0.0, 1.0)
            and _numbers(norm.get("std"), channels, 0.0, 1.0) and 0 not in norm["std"]):
        issues.append(f"normalize {short_repr(norm)} is not a mean in [0, 1] and a std in (0, 1] per channel")
    if not isinstance(manifest["sha256"], dict):
        issues.append("sha256 is not a table of files")
    splits = manifest["splits"]
    if not (isinstance(splits, dict) and all(s in splits for s in SPLITS) and set(splits) <= set(ALL_SPLITS)):
        return issues + [f"splits names {short_repr(list(splits) if isinstance(splits, dict) else splits)}, "
                         f"not {', '.join(SPLITS)} and optionally val"]
    counts = manifest["class_counts"]
    for name, split in splits.items():
        issues += [f"splits.{name}.{problem}" for problem in _split_problems(split)]
        if not (isinstance(counts, dict) and isinstance(counts.get(name), list) and _is_int(k)
                and len(counts[name]) == k and all(_is_int(v) and v >= 0 for v in counts[name])):
            issues.append(f"class_counts.{name} is not a count per class")
    return issues + _multi_label_problems(manifest)


def _multi_label_problems(manifest: dict) -> list[str]:
    """``multi_label`` is true (format 3, with ``label_set_sizes`` per split) or absent."""
    flag = manifest.get("multi_label", False)
    if flag is False:
        return ["format_version 3 is a multi-label data set's, and multi_label is not true"] \
            if manifest.get("format_version") == MULTI_LABEL_FORMAT_VERSION else []
    if flag is not True:
        return [f"multi_label {short_repr(flag)} is not true or false"]
    sizes = manifest.get("label_set_sizes")
    issues = []
    for name, split in manifest["splits"].items():
        found = sizes.get(name) if isinstance(sizes, dict) else None
        if not (isinstance(found, list) and 1 <= len(found) <= MAX_CLASSES + 1
                and all(_is_int(v) and v >= 0 for v in found)):
            issues.append(f"label_set_sizes.{name} is not a count of images per number of labels")
        elif isinstance(split, dict) and _is_int(split.get("num_samples")) and sum(found) != split["num_samples"]:
            issues.append(f"label_set_sizes.{name} adds up to {sum(found):,} images, num_samples says "
                          f"{split['num_samples']:,}")
    return issues


def is_multi_label(manifest: dict) -> bool:
    """Whether a data set's images carry several labels each (``data prepare --multi-label``)."""
    return manifest.get("multi_label") is True


DEFAULT_LABEL_SEP = " "  # what joins a multi-label image's class names where the data set names none
MAX_LABEL_SEP_CHARS = 16


def label_separator(manifest: dict) -> str:
    """What joins a multi-label image's class names in a text column (``predict``'s ``labels``): the
    ``--label-sep`` the data set was prepared with (its ``options`` record), a space by default.
    The manifest (or a checkpoint's copy of it) is untrusted: a value that is not a short line of
    text (no line break, no control character but a tab) gives the default."""
    options = manifest.get("options") if isinstance(manifest, dict) else None
    sep = options.get("label_sep") if isinstance(options, dict) else None
    if isinstance(sep, str) and 0 < len(sep) <= MAX_LABEL_SEP_CHARS and all(c.isprintable() or c == "\t" for c in sep):
        return sep
    return DEFAULT_LABEL_SEP


def multi_hot(label_lists, num_classes: int) -> np.ndarray:
    """Each image's class indices (an Arrow list column, or lists) -> uint8 [n, num_classes], 1
    where the image carries the class. An index outside the classes is an error (shards are
    untrusted input)."""
    if isinstance(label_lists, pa.ChunkedArray):
        label_lists = label_lists.combine_chunks() if label_lists.num_chunks != 1 else label_lists.chunk(0)
    if isinstance(label_lists, pa.Array):
        n = len(label_lists)
        rows = pc.list_parent_indices(label_lists).to_numpy()
        values = pc.list_flatten(label_lists).to_numpy(zero_copy_only=False)
    else:
        label_lists = [np.asarray(x, np.int64).ravel() for x in label_lists]
        n = len(label_lists)
        rows = np.repeat(np.arange(n), [len(x) for x in label_lists])
        values = np.concatenate(label_lists) if label_lists else np.zeros(0, np.int64)
    out = np.zeros((n, num_classes), np.uint8)
    if len(values):
        if values.min() < 0 or values.max() >= num_classes:
            bad = values[(values < 0) | (values >= num_classes)][0]
            raise ImgtrainError(f"a label list holds class {bad}, outside [0, {num_classes}); "
                                "prepare the data set again")
        out[rows, values] = 1
    return out


def columns(manifest_or_flag) -> tuple[str, ...]:
    """The split files' columns: ``label``, or ``labels`` for a multi-label data set."""
    multi = manifest_or_flag if isinstance(manifest_or_flag, bool) else is_multi_label(manifest_or_flag)
    return MULTI_LABEL_COLUMNS if multi else COLUMNS


def _split_problems(split) -> list[str]:
    """A split's files and row counts: the streamed reader plans an epoch by them (a permutation
    of every listed row, a decoded buffer per row group) before it reads a file."""
    if not isinstance(split, dict):
        return [f"is not an object ({short_repr(split)})"]
    files, n, groups = split.get("files"), split.get("num_samples"), split.get("row_groups")
    issues = []
    if not (isinstance(files, list) and all(isinstance(f, str) for f in files)):
        return [f"files is not a list of paths ({short_repr(files)})"]
    if not _is_int(n) or n < 0:
        issues.append(f"num_samples {short_repr(n)} is not a count")
    if groups is None:  # format 1: read from the files' footers
        return issues
    # the writer never puts more than ROW_GROUP_ROWS rows in a row group, nor an empty one
    if not (isinstance(groups, list) and len(groups) == len(files)
            and all(isinstance(g, list) and all(_is_int(r) for r in g) for g in groups)):
        issues.append(f"row_groups is not a list of row counts per file ({short_repr(groups)})")
    elif any(not 1 <= r <= ROW_GROUP_ROWS for g in groups for r in g):
        bad = next(r for g in groups for r in g if not 1 <= r <= ROW_GROUP_ROWS)
        issues.append(f"row_groups lists a row group of {short_repr(bad)} rows, outside 1 to {ROW_GROUP_ROWS:,} "
                      "(the writer's largest)")
    elif _is_int(n) and sum(map(sum, groups)) != n:
        issues.append(f"row_groups add up to {sum(map(sum, groups)):,} rows, num_samples says {n:,}")
    return issues


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _numbers(values, count, lo: float, hi: float) -> bool:
    """``count`` numbers in [lo, hi] (NaN is in no range)."""
    return (isinstance(values, list) and len(values) == count
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) and lo <= v <= hi for v in values))


def short_repr(value, limit: int = 60) -> str:
    """A value from an untrusted file, short enough for a one-line error."""
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def default_preset(image_shape) -> str:
    """Augmentation and evaluation transforms a data set gets unless told otherwise: the
    digits' affine for small grayscale images, the photo recipe for the rest."""
    h, w, c = image_shape if image_shape and len(image_shape) == 3 else (0, 0, 3)
    return "digits" if c == 1 and max(h, w) <= 64 else "photos"


def eval_split(manifest: dict) -> str:
    """The split training validates on (and picks the best checkpoint by): val when the data
    set has one, else test."""
    return "val" if "val" in manifest["splits"] else "test"


def side_files(manifest: dict) -> list[str]:
    """The files a data set keeps beside its manifest and splits (its own, as much as they are:
    ``--overwrite`` replaces them and ``clean`` deletes them). Fixed names, never a path from the manifest."""
    return [DEDUPE_FILE] * bool(manifest.get("dedupe")) + [SOURCES_FILE] * bool(manifest.get("source_names"))


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


def check_split_schema(schema: pa.Schema, rel: str, storage: str = "tensor",
                       multi_label: bool = False) -> list[int] | None:
    """Refuse every schema but the data set's own: exactly ``id`` int64, ``image`` (a uint8
    tensor, or binary for encoded storage), ``label`` int64, nothing else, no other Arrow
    extension type. Returns the image shape a tensor column declares (None when encoded).

    A data set is untrusted input (its manifest's sha256 values are self-declared), so this is
    checked wherever split files are read, not only by ``verify_dataset``.
    """
    wanted = columns(multi_label)
    missing = [c for c in wanted if c not in schema.names]
    extra = [c for c in schema.names if c not in wanted] or (["a column twice"] if len(schema.names) > 3 else [])
    label, label_type = wanted[2], (pa.list_(pa.int64()) if multi_label else pa.int64())
    if missing:
        problem = f"lacks column(s) {', '.join(missing)}"
    elif extra:
        problem = f"has column(s) {', '.join(extra)} besides {', '.join(wanted)}"
    elif (schema.field("id").type != pa.int64() or not schema.field(label).type.equals(label_type)
          or any(_EXTENSION_NAME in (schema.field(c).metadata or {}) for c in ("id", label))):
        found = f"{schema.field('id').type} / {label} {schema.field(label).type}"
        problem = f"has id {found}, expected int64 / {label_type}"
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


def _check_file(path: Path, rel: str, manifest: dict) -> list[int]:
    """Schema, image shape and label range of one Parquet file; returns the rows of each of its
    row groups (from its footer)."""
    try:
        pf = pq.ParquetFile(path)
        schema = pf.schema_arrow
    except (pa.ArrowException, OSError) as e:
        raise ImgtrainError(f"{rel} is not a readable Parquet file ({one_line(e, 120)}); "
                            "prepare the data set again")
    multi = is_multi_label(manifest)
    shape = check_split_schema(schema, rel, manifest["storage"], multi)
    if manifest["storage"] == "tensor" and shape != list(manifest["image_shape"]):
        raise ImgtrainError(
            f"{rel} holds images of shape {short_repr(shape)}, the manifest says {manifest['image_shape']}; "
            "prepare the data set again"
        )
    try:
        labels = pf.read(columns=[columns(multi)[2]]).column(0)
        labels = pc.list_flatten(labels).to_numpy() if multi else labels.to_numpy()
    except (pa.ArrowException, OSError) as e:
        raise ImgtrainError(f"{rel} is corrupt ({one_line(e, 120)}); prepare the data set again")
    bad = labels[(labels < 0) | (labels >= manifest["num_classes"])]
    if len(bad):
        raise ImgtrainError(
            f"{rel} has label {bad[0]} outside [0, {manifest['num_classes']}); "
            "prepare the data set again"
        )
    return [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)]


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
        listed = manifest["splits"][split].get("row_groups")
        rows = 0
        for i, (rel, path) in enumerate(zip(manifest["splits"][split]["files"], files)):
            if not path.is_file():
                raise ImgtrainError(f"{data_dir / rel} is missing; prepare the data set again")
            if check_hashes and sha256_file(path) != manifest["sha256"].get(rel):
                raise ImgtrainError(
                    f"{data_dir / rel} does not match its sha256 in the manifest (modified or "
                    "corrupt); prepare the data set again"
                )
            groups = _check_file(path, str(data_dir / rel), manifest)
            if listed is not None:
                _check_listed_groups(data_dir, split, rel, listed[i], groups)
            rows += sum(groups)
        if rows != manifest["splits"][split]["num_samples"]:
            raise ImgtrainError(
                f"split {split!r} of {data_dir} has {rows} rows, the manifest says "
                f"{manifest['splits'][split]['num_samples']}; prepare the data set again"
            )
    return manifest


def _check_listed_groups(data_dir: Path, split: str, rel: str, listed: list[int], found: list[int]) -> None:
    """The manifest's row counts of a file must be its footer's: readers plan by the former."""
    if listed != found:
        raise ImgtrainError(
            f"{data_dir / MANIFEST}: splits.{split}.row_groups lists {short_repr(listed)} rows for {rel}, "
            f"its Parquet footer says {short_repr(found)}; prepare the data set again"
        )


def read_split_file(path: Path, storage: str = "tensor", multi_label: bool = False) -> pa.Table:
    """One split file as an Arrow table, after its schema passed ``check_split_schema``
    (read from the footer first: no value of a refused column is ever converted)."""
    try:
        check_split_schema(pq.read_schema(path), str(path), storage, multi_label)
        return pq.read_table(path, columns=list(columns(multi_label)))
    except (pa.ArrowException, OSError) as e:
        raise ImgtrainError(f"cannot read {path} ({one_line(e, 120)}); "
                            "prepare the data set again with `imgtrain data prepare`") from None


def row_groups(data_dir: Path, manifest: dict, split: str) -> list[tuple[Path, int, int]]:
    """Every (file, row group index, rows) of a split, in file order: the blocks the streamed
    reader works in. Read from the files' footers (cheap), and where the manifest lists them
    (format 2) they must agree: not every reader verifies the data set first (predict, report)."""
    files = split_files(Path(data_dir), manifest, split)
    listed = manifest["splits"][split].get("row_groups")
    found = []
    for i, f in enumerate(files):
        try:
            meta = pq.read_metadata(f)
        except (pa.ArrowException, OSError) as e:
            raise ImgtrainError(f"cannot read {f} ({one_line(e, 120)}); prepare the data set again") from None
        found.append([meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
        if listed is not None:
            _check_listed_groups(Path(data_dir), split, manifest["splits"][split]["files"][i], listed[i], found[-1])
    return [(f, g, rows) for f, groups in zip(files, found) for g, rows in enumerate(groups)]


def read_row_group(path: Path, group: int, storage: str, multi_label: bool = False) -> pa.Table:
    """One row group of a split file, its schema checked first (a multi-label data set's has
    ``labels``, lists of class indices: ``multi_hot`` turns them into what readers hand out)."""
    try:
        pf = pq.ParquetFile(path)
        check_split_schema(pf.schema_arrow, str(path), storage, multi_label)
        return pf.read_row_group(group, columns=list(columns(multi_label)))
    except (pa.ArrowException, OSError) as e:
        raise ImgtrainError(f"cannot read {path} ({one_line(e, 120)}); prepare the data set again") from None


def read_labels(path: Path, group: int, multi_label_classes: int = 0) -> np.ndarray:
    """One row group's labels alone (what a balanced epoch is drawn from): int64 [n], or for a
    multi-label data set (``multi_label_classes``: its number of classes) uint8 multi-hot [n, K]."""
    try:
        if multi_label_classes:
            column = pq.ParquetFile(path).read_row_group(group, columns=["labels"]).column("labels")
            return multi_hot(column, multi_label_classes)
        return pq.ParquetFile(path).read_row_group(group, columns=["label"]).column("label").to_numpy()
    except (pa.ArrowException, OSError) as e:
        raise ImgtrainError(f"cannot read {path} ({one_line(e, 120)}); prepare the data set again") from None


def read_split(data_dir: PathLike, split: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A whole split of a data set with tensor storage, as numpy: (ids int64 [N], images uint8
    [N, H, W, C], labels int64 [N] or, multi-label, uint8 multi-hot [N, num_classes]), rows in
    file order. For small data sets: it holds them all. Plain pyarrow, no Ray cluster and no Ray
    import needed."""
    data_dir = Path(data_dir)
    manifest = load_manifest(data_dir)
    if manifest["storage"] != "tensor":
        raise ImgtrainError(f"{data_dir} keeps its images encoded: they are decoded as they stream, never "
                            "all at once (read it with imgtrain.data.stream)")
    ids, images, labels = [], [], []
    k = manifest["num_classes"] if is_multi_label(manifest) else 0
    for path in split_files(data_dir, manifest, split):
        table = read_split_file(path, multi_label=bool(k))
        ids.append(table.column("id").to_numpy())
        field = table.schema.field("image")
        images.append(tables.tensor_column_to_numpy(table.column("image"), field))
        labels.append(multi_hot(table.column("labels"), k) if k else table.column("label").to_numpy())
    h, w, c = manifest["image_shape"]
    if not images:
        return (np.zeros(0, np.int64), np.zeros((0, h, w, c), np.uint8),
                np.zeros((0, k), np.uint8) if k else np.zeros(0, np.int64))
    x = np.concatenate(images) if len(images) > 1 else images[0]  # [N, H, W, C]
    if x.dtype != np.uint8 or x.shape[1:] != (h, w, c):
        raise ImgtrainError(
            f"{data_dir} split {split!r} holds {x.dtype} images of shape {list(x.shape[1:])}, "
            f"the manifest says uint8 {[h, w, c]}; prepare the data set again"
        )
    return (np.concatenate(ids).astype(np.int64), x, np.concatenate(labels).astype(np.uint8 if k else np.int64))


def _val_origin(manifest: dict) -> dict:
    """Where the validation split comes from (``prepare.val_plan``'s record; {} in a data set made
    before it, or by hand): its text fields, cut short (a manifest is input like any file)."""
    origin = manifest.get("val_split")
    return {k: v[:200] for k, v in origin.items() if isinstance(v, str)} if isinstance(origin, dict) else {}


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
            carved = s == "val" and _val_origin(manifest).get("from") == "train"
            parts.append(f"{manifest['splits'][s]['num_samples']:,} {s} ({per}{', carved from train' * carved})")
    kept = ("encoded PNG/JPEG, trained at" if manifest["storage"] == "encoded" else "uint8")
    mean = ", ".join(f"{v:.3f}" for v in manifest["normalize"]["mean"])
    std = ", ".join(f"{v:.3f}" for v in manifest["normalize"]["std"])
    skipped = manifest.get("skipped") or {}
    multi = " (multi-label: counts are images carrying each label)" if is_multi_label(manifest) else ""
    return (
        f"Data set {manifest['name']!r} from {manifest['source']}: {manifest['num_classes']} classes{multi} ({shown}); "
        f"images {kept} {h}x{w} with {c} channel{'s' if c != 1 else ''} (normalised with mean {mean} / std {std}, "
        f"{manifest['preset']} augmentation); {', '.join(parts)} samples"
        + (f"; {skipped['count']:,} unreadable file(s) skipped" if skipped.get("count") else "")
        + ("" if "val" in manifest["splits"] else
           f"; no val split ({_val_origin(manifest).get('why') or 'prepared without one'}): training will pick its best "
           "checkpoint on the test split")
        + f"; created {manifest['created']}."
    )
