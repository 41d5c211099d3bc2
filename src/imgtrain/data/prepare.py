"""``imgtrain data prepare``: any source -> a prepared data set directory, streamed.

Memory stays bounded by a few chunks of images whatever the number of files: the source is
first listed (ids, labels and where each image is: a path, a Parquet row group), the splits are
drawn from the labels, and then chunks of images are checked (PNG/JPEG only, a pixel cap, fully
decoded once), measured (size, colour, statistics for normalisation) and, with ``--size``,
resized, in a pool of processes, while the results are written split by split, row group by row
group, in source order. Photos keep their encoded bytes (re-encoded once when resized); MNIST
and tensor columns keep raw uint8 tensors. Unreadable files are skipped and listed, or stop
the command before anything is written with ``on_error="fail"``.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from imgtrain.data import images, listing, sources
from imgtrain.data.format import NORMALIZE_MEAN, NORMALIZE_STD, default_preset
from imgtrain.data.sources import RawDataset
from imgtrain.data.writer import DatasetWriter, write_dataset
from imgtrain.errors import ImgtrainError

SOURCES = ("mnist-sample", "mnist", "folder", "parquet", "list")
ON_ERROR = ("skip", "fail")
SPLIT_CODES = {"train": 0, "val": 1, "test": 2}
MAX_LISTED_BAD = 1000  # skipped files named in the manifest (and counted beyond)


def prepare(source: str, out_dir, *, source_path=None, download: bool = False, image_column: str = "image",
            label_column: str = "label", path_column: str = "path", channels: int | None = None,
            size: tuple[int, int] | None = None, test_fraction: float = 0.2, val_fraction: float = 0.0,
            seed: int = 0, overwrite: bool = False, on_error: str = "skip", workers: int = 0,
            progress: Callable[[int, int], None] | None = None) -> dict:
    """Prepare ``source`` into ``out_dir``; returns the manifest. ``progress(done, total)`` is
    called as images are processed; options that do not apply to the source are errors."""
    _check_options(source, source_path, download, image_column, label_column, path_column, channels, size,
                   test_fraction, val_fraction, on_error)
    if source_path is not None:
        _check_not_nested(source, source_path, out_dir)
    where = f"{source}:{Path(source_path).absolute()}" if source_path is not None else source
    options = {"seed": seed, "test_fraction": test_fraction, "val_fraction": val_fraction, "channels": channels,
               "size": list(size) if size else None}
    name = Path(out_dir).absolute().name
    if source in ("mnist-sample", "mnist"):
        raw = sources.load_mnist_sample(seed=seed) if source == "mnist-sample" else \
            sources.load_mnist_idx(source_path, download=download, seed=seed)
        return write_dataset(carve_val(raw, val_fraction, seed), out_dir, name=name, source=where,
                             overwrite=overwrite, options=options)
    if source == "parquet" and not listing.holds_encoded_images(source_path, image_column):
        return _prepare_tensor_table(source_path, out_dir, image_column, label_column, test_fraction, val_fraction,
                                     seed, overwrite, name, where, options)
    listed = (listing.list_image_folder(source_path, seed) if source == "folder"
              else listing.list_file_table(source_path, path_column, label_column, seed) if source == "list"
              else listing.list_parquet_images(source_path, image_column, label_column))
    fields = dict(name=name, source=where, options=options)
    return _prepare_encoded(listed, out_dir, fields, channels, size, test_fraction, val_fraction, seed, overwrite,
                            on_error, workers, progress)


def _check_options(source, source_path, download, image_column, label_column, path_column, channels, size,
                   test_fraction, val_fraction, on_error) -> None:
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
    if source in ("mnist-sample", "mnist") and (channels is not None or size is not None):
        issues.append(f"--channels/--size do not apply to {source} (28x28 grayscale)")
    if source not in ("parquet", "list") and (image_column, label_column) != ("image", "label"):
        issues.append("--image-column/--label-column only apply to the parquet and list sources")
    if source != "list" and path_column != "path":
        issues.append("--path-column only applies to the list source")
    if source in ("mnist-sample", "mnist") and test_fraction != 0.2:
        issues.append(f"{source} has a fixed train/test split; drop --test-fraction")
    if not (0 <= val_fraction < 1) or not (0 < test_fraction < 1) or val_fraction + test_fraction >= 1:
        issues.append(f"--test-fraction {test_fraction} and --val-fraction {val_fraction} must be in (0, 1) "
                      "and [0, 1) with room left for training")
    if on_error not in ON_ERROR:
        issues.append(f"--on-error must be skip or fail, got {on_error!r}")
    try:
        sources.check_channels_size(channels, size)
    except ImgtrainError as e:
        issues.append(str(e))
    if issues:
        raise ImgtrainError("; ".join(issues))


def _check_not_nested(source: str, source_path, out_dir) -> None:
    """A source inside the output would be deleted by replacing the output; an output inside an
    image folder would be read as one more class folder the next time it is prepared."""
    src, out = Path(source_path).resolve(), Path(out_dir).resolve()
    if src == out or out in src.parents or (source == "folder" and src in out.parents):
        raise ImgtrainError(
            f"--source {source_path} and the output folder {out_dir} overlap; write the data set "
            "to a folder outside the source (and keep the source outside it)"
        )


# ---------------------------------------------------------------- which split each row goes to


def assign_splits(labels: np.ndarray, fixed_test: np.ndarray | None, test_fraction: float, val_fraction: float,
                  seed: int) -> np.ndarray:
    """int8 [N]: 0 train, 1 val, 2 test. Stratified and seeded; a source's own test split
    (``fixed_test``) is kept, and the validation split is drawn from the training rows."""
    split = np.zeros(len(labels), np.int8)
    if fixed_test is not None:
        split[fixed_test] = SPLIT_CODES["test"]
    else:
        _, test = sources.stratified_split(labels, test_fraction, seed)
        split[test] = SPLIT_CODES["test"]
    if val_fraction:
        train = np.flatnonzero(split == 0)
        # of the training rows, the share that makes val_fraction of them all
        share = val_fraction / (1 - test_fraction) if fixed_test is None else val_fraction
        _, val = sources.stratified_split(labels[train], min(share, 0.5), seed + 1)
        split[train[val]] = SPLIT_CODES["val"]
    return split


def carve_val(raw: RawDataset, val_fraction: float, seed: int) -> RawDataset:
    """A validation split drawn (stratified) from an in-memory data set's training split."""
    if not val_fraction:
        return raw
    train, val = sources.stratified_split(raw.train.labels, val_fraction / (1 - 0.2), seed + 1)
    take = lambda idx: sources.Split(sources.take_images(raw.train.images, idx), raw.train.labels[idx],  # noqa: E731
                                     raw.train.ids[idx])
    return RawDataset(raw.classes, take(np.sort(train)), raw.test, take(np.sort(val)))


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

    def add(self, row: images.Checked) -> None:
        self.heights.append(row.height)
        self.widths.append(row.width)
        self.all_gray &= row.gray
        self.sums += row.stats
        self.count += 1


def _prepare_encoded(listed: listing.Listing, out_dir, fields, channels, size, test_fraction, val_fraction, seed, overwrite,
                     on_error, workers, progress) -> dict:
    split = assign_splits(listed.labels, listed.fixed_test, test_fraction, val_fraction, seed)
    names = [s for s, code in SPLIT_CODES.items() if (split == code).any()]
    measured = _Measured()
    total, done = len(listed.labels), 0
    with DatasetWriter(out_dir, listed.classes, "encoded", names, overwrite) as out:
        for chunk, results in _run_chunks(listed.chunks, size, workers):
            positions = np.arange(chunk.first, chunk.first + len(results))
            good = np.array([r.data is not None for r in results], bool)
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
                else:
                    measured.add(r)
            done += len(results)
            if progress:
                progress(done, total)
        if measured.bad and (on_error == "fail" or not measured.count):
            raise _bad_files_error(measured, on_error)
        fields = {**fields, **_shape_and_statistics(measured, channels, size)}
        fields["skipped"] = {"count": measured.bad_count, "files": [list(b) for b in measured.bad]}
        return out.finish(fields)


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
    shown = ", ".join(f"{name} ({why})" for name, why in m.bad[:3])
    more = f" and {m.bad_count - 3} more" if m.bad_count > 3 else ""
    hint = "remove or fix them, or pass --on-error skip" if on_error == "fail" else "check the source"
    what = "cannot be read as PNG/JPEG images" if m.count else "cannot be read; none of the images can"
    return ImgtrainError(f"{m.bad_count} file(s) {what}: {shown}{more}; {hint}")


def _run_chunks(chunks: list, size, workers: int):
    """(chunk, results) in order; a pool of processes for large sources, with only a few chunks
    in flight (memory stays bounded), this process for small ones."""
    if len(chunks) <= 2 or workers == 1:
        for chunk in chunks:
            yield chunk, images.check_chunk(chunk, size)
        return
    count = workers or os.cpu_count() or 1
    # spawn, not fork: the caller may have threads (Ray, a notebook) that a fork would copy mid-step
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(count, mp_context=context) as pool:
        pending: deque = deque()
        queue = iter(chunks)
        for chunk in queue:
            pending.append((chunk, pool.submit(images.check_chunk, chunk, size)))
            if len(pending) >= 2 * count:
                break
        while pending:
            chunk, future = pending.popleft()
            yield chunk, future.result()
            nxt = next(queue, None)
            if nxt is not None:
                pending.append((nxt, pool.submit(images.check_chunk, nxt, size)))


# ---------------------------------------------------------------- tensor columns (Parquet)


def _prepare_tensor_table(path, out_dir, image_column, label_column, test_fraction, val_fraction, seed,
                          overwrite, name, where, options) -> dict:
    """A Parquet table of pixel arrays (nested lists or a tensor column): streamed row group by
    row group into tensor storage; every image must have one shape."""
    table = listing.list_parquet_table(path, image_column, label_column)
    split = assign_splits(table.labels, table.fixed_test, test_fraction, val_fraction, seed)
    names = [s for s, code in SPLIT_CODES.items() if (split == code).any()]
    shape = None
    with DatasetWriter(out_dir, table.classes, "tensor", names, overwrite) as out:
        for rows, pixels in listing.iter_parquet_pixels(table, image_column):  # rows: positions [n]
            if shape is None:
                shape = pixels.shape[1:]
            elif pixels.shape[1:] != shape:
                raise ImgtrainError(f"column {image_column!r} mixes image shapes {list(shape)} and "
                                    f"{list(pixels.shape[1:])}; give every image the same shape")
            for split_name in names:
                keep = rows[split[rows] == SPLIT_CODES[split_name]]
                out.add(split_name, table.ids[keep], table.labels[keep], pixels[keep - rows[0]])
        h, w, c = shape
        return out.finish({"name": name, "source": where, "image_shape": [h, w, c], "channels": c,
                           "preset": default_preset([h, w, c]),
                           "normalize": {"mean": [NORMALIZE_MEAN] * c, "std": [NORMALIZE_STD] * c},
                           "options": options})
