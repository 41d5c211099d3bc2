"""``imgtrain data prepare``: any source -> a prepared data set directory, streamed.

Memory stays bounded by a few chunks of images whatever the number of files: the source is
first listed (ids, labels and where each image is: a path, a Parquet row group), the splits are
drawn from the labels, and then chunks of images are checked (PNG/JPEG only, a pixel cap, fully
decoded once), measured (size, colour, statistics for normalisation) and, with ``--size``,
resized, in a pool of processes, while the results are written split by split, row group by row
group, in source order. Photos keep their encoded bytes (re-encoded once when resized); MNIST
and tensor columns keep raw uint8 tensors. Unreadable files are skipped and listed, or stop
the command before anything is written with ``on_error="fail"``. With ``--dedupe``, a first
pass fingerprints every image and chooses the duplicates to leave out (``dedupe.py``).
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from imgtrain.data import dedupe, images, pool
from imgtrain.data.format import DEDUPE_FILE, DEFAULT_LABEL_SEP, NORMALIZE_MEAN, NORMALIZE_STD, default_preset
from imgtrain.data.label_sets import LabelSets, occurrences
from imgtrain.data.listing import MAX_LISTED_BAD, Listing, PixelListing
from imgtrain.data.named_splits import SPLIT_CODES
from imgtrain.data.options import PrepareOptions
from imgtrain.data.raw import RawDataset, Split, take_images
from imgtrain.data.sources import registry  # importing the package registers every source
from imgtrain.data.splits import DEFAULT_VAL_FRACTION, random_split, stratified_split, too_few_for_val
from imgtrain.data.writer import DatasetWriter, write_dataset
from imgtrain.errors import ImgtrainError, ImgtrainWarning
from imgtrain.ops.remote import is_remote


def prepare(source: str, out_dir, source_path=None, options: PrepareOptions | None = None,
            progress: Callable[[int, int], None] | None = None) -> dict:
    """Prepare ``source`` (a name in ``registry.SOURCES``), read from ``source_path``, into
    ``out_dir``; returns the manifest. ``progress(done, total)`` is called as images are
    processed; options that do not apply to the source are errors."""
    opts = options or PrepareOptions()
    spec = registry.get(source)
    issues = registry.problems(spec, source_path, opts) + opts.problems()
    if issues:
        raise ImgtrainError("; ".join(issues))
    remote_source = source_path is not None and is_remote(source_path)
    if source_path is not None and not remote_source:
        _check_not_nested(spec, source_path, out_dir)
    where = (source if source_path is None else f"{source}:{source_path}" if remote_source
             else f"{source}:{Path(source_path).absolute()}")
    fields = {"name": Path(out_dir).absolute().name, "source": where,
              "options": {"seed": opts.seed, "test_fraction": opts.test_fraction, "val_fraction": opts.val_fraction,
                          "channels": opts.channels, "size": list(opts.size) if opts.size else None,
                          # what joins an image's class names in predict's labels column (format.label_separator)
                          **({"label_sep": opts.label_sep or DEFAULT_LABEL_SEP} if opts.multi_label else {})}}
    listed = spec.lister(source_path, opts)
    if opts.dedupe != "off" and not isinstance(listed, Listing):
        raise ImgtrainError(f"--dedupe works on sources of PNG/JPEG images, and {source} gives pixel arrays; prepare "
                            "without it and find the duplicates with `imgtrain data inspect OUT_DIR`")
    if isinstance(listed, RawDataset):
        raw, origin = carve_val(listed, opts.val_fraction, opts.seed)
        return write_dataset(raw, out_dir, overwrite=opts.overwrite, **_with_val(fields, origin))
    if isinstance(listed, PixelListing):
        return _prepare_pixels(listed, out_dir, fields, opts)
    return _prepare_encoded(listed, out_dir, fields, opts, progress)


def _with_val(fields: dict, origin: dict) -> dict:
    """The manifest's fields with where its validation split comes from (``val_split``) and the
    share carved (``val_fraction`` in its "options" record: the one used, the default's included)."""
    carved = origin.get("fraction", 0.0) if origin["from"] == "train" else 0.0
    return {**fields, "options": {**fields["options"], "val_fraction": carved}, "val_split": origin}


def _check_not_nested(spec: registry.SourceSpec, source_path, out_dir) -> None:
    """A source inside the output would be deleted by replacing the output; an output inside a
    source read whole (an image folder) would be read as one more class folder the next time."""
    src, out = Path(source_path).resolve(), Path(out_dir).resolve()
    if src == out or out in src.parents or (spec.walks_source and src in out.parents):
        raise ImgtrainError(
            f"--source {source_path} and the output folder {out_dir} overlap; write the data set "
            "to a folder outside the source (and keep the source outside it)"
        )


# ---------------------------------------------------------------- which split each row goes to


def assign_splits(labels: np.ndarray, fixed_test: np.ndarray | None, test_fraction: float,
                  val_fraction: float | None, seed: int, fixed_val: np.ndarray | None = None,
                  classes=()) -> tuple[np.ndarray, dict]:
    """(int8 [N]: 0 train, 1 val, 2 test; where the validation split comes from, for the
    manifest). Stratified and seeded; a source's own test and validation splits (``fixed_test``,
    ``fixed_val``) are kept, a missing test split is drawn from the rows outside them, and a
    validation split from the training rows (``val_fraction`` None: the default, ``val_plan``).
    Multi-label rows (``LabelSets``) have no one class to stratify by: theirs are seeded random."""
    split = np.zeros(len(labels), np.int8)
    if fixed_val is not None:
        if val_fraction:
            raise ImgtrainError("the source has its own validation split; drop --val-fraction")
        split[fixed_val] = SPLIT_CODES["val"]
    if fixed_test is not None:
        split[fixed_test] = SPLIT_CODES["test"]
    else:
        pool = np.flatnonzero(split == 0)  # every row when the source has no validation split
        _, test = _draw(labels[pool], test_fraction, seed)
        split[pool[test]] = SPLIT_CODES["test"]
    if fixed_val is not None:
        return split, {"from": "source"}
    train = np.flatnonzero(split == 0)
    val_fraction, origin = val_plan(val_fraction, labels[train], classes)
    if val_fraction:
        # of the training rows, the share that makes val_fraction of them all
        share = val_fraction / (1 - test_fraction) if fixed_test is None else val_fraction
        _, val = _draw(labels[train], min(share, 0.5), seed + 1)
        split[train[val]] = SPLIT_CODES["val"]
    return split, origin


def _draw(labels, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(kept rows, drawn rows): stratified by class, or at random for multi-label rows."""
    if isinstance(labels, LabelSets):
        return random_split(len(labels), fraction, seed)
    return stratified_split(labels, fraction, seed)


def val_plan(val_fraction: float | None, train_labels: np.ndarray, classes) -> tuple[float, dict]:
    """The share to carve from the training rows for a source without a validation split, and
    the manifest's record of it: ``--val-fraction`` as given (0: none), else ``DEFAULT_VAL_FRACTION``
    unless a class has too few training images (``too_few_for_val``)."""
    if val_fraction is None:
        why = too_few_for_val(occurrences(train_labels), classes)
        if why:
            return 0.0, {"from": None, "why": why}
        return DEFAULT_VAL_FRACTION, {"from": "train", "fraction": DEFAULT_VAL_FRACTION, "default": True}
    if not val_fraction:
        return 0.0, {"from": None, "why": "--val-fraction 0"}
    return val_fraction, {"from": "train", "fraction": val_fraction, "default": False}


def carve_val(raw: RawDataset, val_fraction: float | None, seed: int) -> tuple[RawDataset, dict]:
    """A validation split drawn (stratified) from an in-memory data set's training split, and
    the manifest's record of where it comes from (``val_plan``)."""
    if raw.val is not None:
        return raw, {"from": "source"}
    val_fraction, origin = val_plan(val_fraction, raw.train.labels, raw.classes)
    if not val_fraction:
        return raw, origin
    train, val = stratified_split(raw.train.labels, val_fraction / (1 - 0.2), seed + 1)

    def take(idx):
        return Split(take_images(raw.train.images, idx), raw.train.labels[idx], raw.train.ids[idx])

    return RawDataset(raw.classes, take(np.sort(train)), raw.test, take(np.sort(val))), origin


# ---------------------------------------------------------------- encoded images (photos)


@dataclass
class _Measured:
    """What the processed images say about the data set (for the manifest)."""

    heights: list = field(default_factory=list)
    widths: list = field(default_factory=list)
    all_gray: bool = True
    sums: np.ndarray = field(default_factory=lambda: np.zeros((2, 4)))  # [mean, mean of squares] x (R, G, B, L)
    count: int = 0
    bad: list = field(default_factory=list)  # (name, reason)
    bad_count: int = 0
    upscaled: int = 0  # images --size enlarged, and by how much (the least and the most)
    upscale_range: tuple = (float("inf"), 1.0)

    def add(self, row: images.Checked) -> None:
        self.heights.append(row.height)
        self.widths.append(row.width)
        self.all_gray &= row.gray
        self.sums += row.stats
        self.count += 1
        if row.upscaled > 1.0:
            self.upscaled += 1
            self.upscale_range = (min(self.upscale_range[0], row.upscaled), max(self.upscale_range[1], row.upscaled))

    def warn_upscaled(self, size) -> None:
        """One line when --size enlarged images: they gain pixels, not detail, and cost more to train."""
        if not self.upscaled:
            return
        least, most = (f"{x:.1f}x" for x in self.upscale_range)
        warnings.warn(f"--size {size[0]}x{size[1]} upscaled {self.upscaled:,} of {self.count:,} images (by "
                      f"{most if least == most else f'{least} to {most}'}): an upscaled image holds no more "
                      "detail and costs more to train on; a --size no larger than the images keeps them as they are",
                      ImgtrainWarning, stacklevel=2)


def _prepare_encoded(listed: Listing, out_dir, fields: dict, opts: PrepareOptions, progress) -> dict:
    # what the source dropped while listing is listed first, and with --on-error fail stops it now
    measured = _Measured(bad=list(listed.skipped.files), bad_count=listed.skipped.count)
    if measured.bad and (opts.on_error == "fail" or not len(listed.labels)):
        hint = "fix them or pass --on-error skip" if opts.on_error == "fail" else "none is left to prepare"
        raise ImgtrainError(f"{measured.bad_count} sample(s) of the source cannot be used: "
                            f"{_shown(measured)}; {hint}")
    split, origin = assign_splits(listed.labels, listed.fixed_test, opts.test_fraction, opts.val_fraction,
                                  opts.seed, listed.fixed_val, listed.classes)
    fields = _with_val(fields, origin)
    names = [s for s, code in SPLIT_CODES.items() if (split == code).any()]
    total, done, passes = len(listed.labels), 0, 1 + (opts.dedupe != "off")
    dropped = None
    if opts.dedupe != "off":  # a first pass: fingerprints only, a few chunks at a time
        dropped = dedupe.plan(listed, split, opts, progress and (lambda d, t: progress(d, passes * t)))
        done = total
    multi = isinstance(listed.labels, LabelSets)
    with DatasetWriter(out_dir, listed.classes, "encoded", names, opts.overwrite, multi_label=multi) as out:
        for chunk, results in _run_chunks(listed.chunks, opts.size, opts.workers):
            positions = np.arange(chunk.first, chunk.first + len(results))
            kept = ~dropped.drop[positions] if dropped is not None else np.ones(len(results), bool)
            good = np.array([r.data is not None for r in results], bool) & kept
            stored = np.flatnonzero(good)  # where each came from, for data inspect: bounded, chunk by chunk
            out.add_names(listed.ids[positions[stored]], [chunk.names[k] for k in stored])
            for name in names:
                keep = np.flatnonzero(good & (split[positions] == SPLIT_CODES[name]))
                if len(keep):
                    rows = positions[keep]
                    out.add(name, listed.ids[rows], listed.labels[rows], [results[k].data for k in keep])
            for k, r in enumerate(results):
                if r.data is None:
                    measured.bad_count += 1
                    if len(measured.bad) < MAX_LISTED_BAD:
                        measured.bad.append((chunk.names[k], r.reason))
                elif kept[k]:
                    measured.add(r)
            done += len(results)
            if progress:
                progress(done, passes * total)
        if measured.bad and (opts.on_error == "fail" or not measured.count):
            raise _bad_files_error(measured, opts.on_error)
        measured.warn_upscaled(opts.size)
        fields = {**fields, **_shape_and_statistics(measured, opts.channels, opts.size)}
        fields["skipped"] = {"count": measured.bad_count, "files": [list(b) for b in measured.bad]}
        if dropped is None:
            return out.finish(fields)
        return out.finish({**fields, "dedupe": dropped.summary}, {DEDUPE_FILE: dropped.listing_csv})


def _shape_and_statistics(m: _Measured, channels: int | None, size) -> dict:
    """Training resolution (``--size``, else the images' own size when they share one, else the
    median height and width), channels (1 when every image is grayscale) and normalisation."""
    c = channels or (1 if m.all_gray else 3)
    if size:
        h, w = size
    else:
        h, w = int(np.median(m.heights)), int(np.median(m.widths))
    mean_sq = m.sums / max(m.count, 1)  # per channel: E[x], E[x^2] with x in [0, 1]
    picked = [3] if c == 1 else [0, 1, 2]
    mean = mean_sq[0, picked]
    std = np.sqrt(np.maximum(mean_sq[1, picked] - mean ** 2, 1e-6))
    return {"image_shape": [h, w, c], "channels": c, "preset": default_preset([h, w, c]),
            "normalize": {"mean": [round(float(v), 4) for v in mean], "std": [round(float(v), 4) for v in std]}}


def _bad_files_error(m: _Measured, on_error: str) -> ImgtrainError:
    hint = "remove or fix them, or pass --on-error skip" if on_error == "fail" else "check the source"
    what = "cannot be read as PNG/JPEG images" if m.count else "cannot be read; none of the images can"
    return ImgtrainError(f"{m.bad_count} file(s) {what}: {_shown(m)}; {hint}")


def _shown(m: _Measured) -> str:
    """The first three skipped files and why, and how many more."""
    shown = ", ".join(f"{name} ({why})" for name, why in m.bad[:3])
    return shown + (f" and {m.bad_count - 3} more" if m.bad_count > 3 else "")


def _run_chunks(chunks: list, size, workers: int):
    """(chunk, results) in order, checked in the pool (``pool.ordered_map``)."""
    return pool.ordered_map(functools.partial(images.check_chunk, size=size), chunks, workers)


# ---------------------------------------------------------------- tensor columns (Parquet)


def _prepare_pixels(listed: PixelListing, out_dir, fields: dict, opts: PrepareOptions) -> dict:
    """Pixel arrays (a Parquet table's nested lists or tensor column), streamed batch by batch
    into tensor storage; every image must have one shape."""
    split, origin = assign_splits(listed.labels, listed.fixed_test, opts.test_fraction, opts.val_fraction,
                                  opts.seed, listed.fixed_val, listed.classes)
    fields = _with_val(fields, origin)
    names = [s for s, code in SPLIT_CODES.items() if (split == code).any()]
    shape = None
    multi = isinstance(listed.labels, LabelSets)
    with DatasetWriter(out_dir, listed.classes, "tensor", names, opts.overwrite, multi_label=multi) as out:
        for rows, pixels in listed.batches():  # rows: positions [n]
            if shape is None:
                shape = pixels.shape[1:]
            elif pixels.shape[1:] != shape:
                raise ImgtrainError(f"{listed.images_name} mixes image shapes {list(shape)} and "
                                    f"{list(pixels.shape[1:])}; give every image the same shape")
            for split_name in names:
                keep = rows[split[rows] == SPLIT_CODES[split_name]]
                out.add(split_name, listed.ids[keep], listed.labels[keep], pixels[keep - rows[0]])
        h, w, c = shape
        return out.finish({"name": fields["name"], "source": fields["source"], "image_shape": [h, w, c],
                           "channels": c, "preset": default_preset([h, w, c]),
                           "normalize": {"mean": [NORMALIZE_MEAN] * c, "std": [NORMALIZE_STD] * c},
                           "options": fields["options"], "val_split": fields["val_split"]})
