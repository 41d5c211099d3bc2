"""What ``imgtrain predict`` reads and writes.

Inputs, recognised in this order:
  * a prepared data set directory (has manifest.json): one split, with ids and labels;
  * a Parquet file, or a directory of them: an image column (pixels, Ray tensors or PNG/JPEG
    bytes), plus ``id`` and ``label`` columns when present;
  * a directory of PNG/JPEG files (searched recursively), a glob (``photos/*.png``), or one file.

Every image is converted to what the model takes: PIL ``convert("L")`` or ``convert("RGB")``
for the channel count, then a bilinear resize to the model's height and width. Image files
that cannot be decoded are reported by path and skipped (``on_error="skip"``) or make the
whole command fail before any prediction (``on_error="fail"``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from imgtrain.data.images import (
    IMAGE_SUFFIXES,
    ImageRejected,
    conform_image,
    open_image,
)
from imgtrain.errors import ImgtrainError, one_line

ON_ERROR = ("skip", "fail")


@dataclass
class Inputs:
    columns: dict  # id or path (and label when known): numpy arrays [N]
    images: np.ndarray  # uint8 [N, H, W, C] in the model's shape
    converted: int = 0  # how many were converted to the model's size or channels
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (path, reason)


def read_inputs(spec: str, image_shape: tuple[int, int, int], on_error: str = "skip",
                split: str = "test", image_column: str = "image") -> Inputs:
    if on_error not in ON_ERROR:
        raise ImgtrainError(f"--on-error must be skip or fail, got {on_error!r}")
    path = Path(spec).expanduser()
    if (path / "manifest.json").is_file():
        inputs = _from_dataset(path, split, image_shape)
    elif path.suffix == ".parquet" or (path.is_dir() and any(path.rglob("*.parquet"))):
        inputs = _from_parquet(path, image_column, image_shape)
    else:
        inputs = _from_image_files(spec, image_shape, on_error)
    if len(inputs.images) == 0:
        raise ImgtrainError(f"no images to predict in {spec}")
    return inputs


def _from_dataset(path: Path, split: str, image_shape) -> Inputs:
    from imgtrain.data.format import load_manifest, read_split

    manifest = load_manifest(path)
    if split not in manifest["splits"]:
        raise ImgtrainError(f"data set {path} has no split {split!r}; it has {', '.join(manifest['splits'])}")
    ids, images, labels = read_split(path, split)
    conformed, converted = conform(images, image_shape)
    return Inputs({"id": ids, "label": labels}, conformed, converted)


def _from_parquet(path: Path, image_column: str, image_shape) -> Inputs:
    import pyarrow as pa

    from imgtrain.data.sources import (
        images_from_column,
        parquet_files,
        read_parquet_columns,
    )

    files = parquet_files(path)
    if not files:
        raise ImgtrainError(f"no Parquet file at {path}")
    try:
        table = read_parquet_columns(files, [image_column], ["id", "label"], "choose with --image-column")
    except (pa.ArrowException, OSError) as e:
        raise ImgtrainError(f"cannot read Parquet data at {path}: {one_line(e, 200)}") from None
    images = images_from_column(table.column(image_column), table.schema.field(image_column))
    columns = {"id": np.arange(table.num_rows, dtype=np.int64)}
    for name in ("id", "label"):
        if name in table.column_names and name != image_column:
            col = table.column(name)
            if pa.types.is_integer(col.type) and col.null_count == 0:
                columns[name] = col.to_numpy().astype(np.int64)
    conformed, converted = conform(images, image_shape)
    return Inputs(columns, conformed, converted)


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
    if path.is_file():
        return [path]
    raise ImgtrainError(
        f"input {spec} does not exist; pass a prepared data set, a Parquet file, an image folder, a glob or an image"
    )


def _visible(base: Path, found) -> list[Path]:
    """Files among ``found`` (paths under ``base``), hidden ones (.DS_Store, .git) left out."""
    return sorted(p for p in found if p.is_file() and not any(part.startswith(".") for part in p.relative_to(base).parts))


def _from_image_files(spec: str, image_shape, on_error: str) -> Inputs:
    h, w, c = image_shape
    paths = _image_paths(spec)
    images = np.empty((len(paths), h, w, c), dtype=np.uint8)
    kept, skipped, converted = [], [], 0
    for p in paths:
        reason = None
        if p.suffix.lower() not in IMAGE_SUFFIXES:
            reason = "not a .png/.jpg/.jpeg file"
        else:
            try:
                with open_image(p) as im:
                    images[len(kept)], changed = conform_image(im, image_shape)
                converted += changed
                kept.append(str(p))
            except ImageRejected as e:  # another format, too many pixels
                reason = f"cannot be used ({e})"
            except Exception as e:  # unreadable, truncated, not really an image
                reason = f"cannot be decoded ({type(e).__name__})"
        if reason:
            skipped.append((str(p), reason))
    if skipped and on_error == "fail":
        shown = "; ".join(f"{name}: {why}" for name, why in skipped[:3])
        more = f" and {len(skipped) - 3} more" if len(skipped) > 3 else ""
        raise ImgtrainError(f"{len(skipped)} input file(s) cannot be used: {shown}{more}; "
                            "remove them or pass --on-error skip")
    if not kept and skipped:
        raise ImgtrainError(f"none of the {len(skipped)} file(s) in {spec} is a readable PNG/JPEG image "
                            f"(first: {skipped[0][0]}: {skipped[0][1]})")
    return Inputs({"path": np.asarray(kept, dtype=object)}, images[: len(kept)], converted, skipped)


def conform(images: np.ndarray, image_shape) -> tuple[np.ndarray, int]:
    """uint8 [N, H', W', C'] -> [N, H, W, C] with the same rule as image files."""
    if images.shape[1:] == tuple(image_shape):
        return images, 0
    from PIL import Image

    out = np.empty((len(images), *image_shape), dtype=np.uint8)
    for i, img in enumerate(images):
        pil = Image.fromarray(img[..., 0] if img.shape[-1] == 1 else img)
        out[i] = conform_image(pil, image_shape)[0]
    return out, len(images)


def check_output(out, overwrite: bool = False) -> Path:
    """The --out path, refused unless it is .parquet or .csv and new (or ``overwrite``)."""
    out = Path(out).expanduser()
    if out.suffix.lower() not in (".parquet", ".csv"):
        raise ImgtrainError(f"--out {out}: use a .parquet or .csv file name")
    if out.exists() and not overwrite:
        raise ImgtrainError(f"{out} already exists; pass --overwrite or another --out")
    return out


def write_table(frame, out: Path) -> Path:
    """Predictions -> Parquet or CSV (by extension, see ``check_output``), written whole or not at all."""
    import os

    kind = out.suffix.lower()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")  # two commands writing one --out never share it
    try:
        if kind == ".csv":
            frame.to_csv(tmp, index=False)
        else:
            frame.to_parquet(tmp, index=False)
        os.replace(tmp, out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ImgtrainError(f"cannot write {out}: {e.strerror or e}") from None
    return out
