"""How training and validation batches reach the loop, for both backends.

Two paths, the same global order and rank shares (``data/order.py``, ``data/stream.py``):

* **in memory**: small data sets with tensor storage (the MNIST sample: 4 MB) are read whole
  once per worker and batches are gathered from memory (or from the device with
  ``--data-on-device``); augmentation runs on whole batches in the training step. Measured
  faster for such data than any pipeline (no decode, no tasks).
* **streamed**: everything else, photos above all. Each rank receives its share of every
  global batch from Ray tasks (``--ingest ray-data``, ``stream.ray_parts``) or a torch DataLoader
  (``--ingest torch``; without Ray: the same tasks in this process) that reads row groups,
  decodes and augments on CPUs and prefetches; memory is bounded whatever the data set's size.
"""

from __future__ import annotations

import os
from typing import Callable, Iterable

import numpy as np
import torch

from imgtrain.config import TrainConfig, per_worker_batch_sizes, steps_per_epoch
from imgtrain.data import device_photos
from imgtrain.data import format as fmt
from imgtrain.data import photo_augment
from imgtrain.data import stream

BATCH_DTYPES = {"id": torch.int64, "image": torch.uint8, "label": torch.int64}


def batch_dtypes(manifest: dict) -> dict:
    """The batches' dtypes: a multi-label set's ``label`` is uint8 multi-hot [B, classes]."""
    return dict(BATCH_DTYPES, label=torch.uint8) if fmt.is_multi_label(manifest) else BATCH_DTYPES


def steps(cfg: TrainConfig, manifest: dict) -> int:
    return max(1, steps_per_epoch(manifest["splits"]["train"]["num_samples"], cfg.batch_size, cfg.limit_train_batches))


def preprocess_cpus(cfg: TrainConfig, world: int) -> int:
    """CPUs each rank's pipeline decodes with: the setting, else the logical CPUs the training
    workers leave free, shared among the ranks (at least one each)."""
    if cfg.preprocess_cpus:
        return cfg.preprocess_cpus
    try:
        import ray

        total = ray.cluster_resources().get("CPU", 0.0)
    except Exception:  # no Ray: this machine's cores
        total = os.cpu_count() or 1
    return max(1, int((total - world * cfg.cpus_per_worker) // max(world, 1)))


def decode_path(cfg: TrainConfig, manifest: dict, device, world: int) -> str:
    """Where this rank decodes its photos (--decode, ``device_photos.choose``): "gpu" only for
    encoded photos on a GPU worker. ``auto`` weighs the cluster's CPUs against its GPUs (one per
    worker); CPU-only workers decode on CPUs whatever was asked (``--decode gpu`` with ``--cpu``
    is refused before training starts, ``config.validate``)."""
    if torch.device(device).type == "cpu" or manifest["storage"] != "encoded" or stream.preset(cfg, manifest) != "photos":
        return "cpu"
    if cfg.decode != "auto":
        return cfg.decode
    try:
        import ray

        resources = ray.cluster_resources()
        cpus, gpus = resources.get("CPU", 0.0), int(resources.get("GPU", 0))
    except Exception:  # no Ray: this machine
        cpus, gpus = float(os.cpu_count() or 1), torch.cuda.device_count()
    if cfg.preprocess_cpus:  # set outright: that many decode for each GPU
        cpus, gpus = gpus * (cfg.preprocess_cpus + cfg.cpus_per_worker), max(gpus, 1)
    return device_photos.choose("auto", gpus, cpus, cfg.augment_policy, cfg.cpus_per_worker)


# ---------------------------------------------------------------- training batches, streamed


def streamed_train_batches(cfg: TrainConfig, manifest: dict, rank: int, world: int, device,
                           how: str) -> Callable[[int, int], Iterable[dict]]:
    """``train_batches(epoch, first_step)``: this rank's rows of each global batch from
    ``first_step`` on, decoded and augmented upstream (``how``: ray-data, torch or local)."""
    split_blocks = stream.blocks(cfg.data, manifest, "train")
    share = per_worker_batch_sizes(cfg.batch_size, world)[rank]
    total = steps(cfg, manifest)
    decode = decode_path(cfg, manifest, device, world)

    def train_batches(epoch: int, first_step: int):
        reader = stream.Reader.for_data(
            cfg.data, manifest, preset=stream.preset(cfg, manifest), seed=cfg.seed, epoch=epoch,
            global_batch=cfg.batch_size, positions_end=total * cfg.batch_size,
            first_position=first_step * cfg.batch_size, world=world, rank=rank, train=True, augment=cfg.augment,
            max_rotate_deg=cfg.max_rotate_deg, max_shift=cfg.max_shift, max_scale=cfg.max_scale,
            crop_min_area=cfg.crop_min_area, photo_augment=photo_augment.from_config(cfg, manifest),
            class_weights=balanced_weights(cfg, manifest), decode=decode)
        windows = stream.epoch_windows(split_blocks, cfg.seed, epoch, stream.window_blocks(manifest))
        windows = stream.windows_from(windows, reader.first_position)
        yield from _batches(stream.train_tasks(windows, reader), reader, share, device, how,
                            preprocess_cpus(cfg, world), windows)

    return train_batches


def balanced_weights(cfg: TrainConfig, manifest: dict) -> tuple[float, ...]:
    """The streamed reader's class weights: with --sampling balanced, 1 / each class's training
    rows (0 for a class without any); otherwise none (a shuffled epoch)."""
    if cfg.sampling != "balanced":
        return ()
    return tuple(1.0 / n if n else 0.0 for n in manifest["class_counts"]["train"])


def streamed_val_batches(cfg: TrainConfig, manifest: dict, rank: int, world: int, device,
                         how: str) -> Callable[[], Iterable[dict]]:
    """``val_batches()``: this rank's rows of the validation split (every world-th row group)."""
    split = fmt.eval_split(manifest)
    tasks = stream.eval_tasks(stream.blocks(cfg.data, manifest, split), world, rank)
    return _eval_batches(cfg, manifest, tasks, world, device, how)


def streamed_calibration_batches(cfg: TrainConfig, manifest: dict, rank: int, world: int, device,
                                 how: str) -> Callable[[], Iterable[dict]]:
    """``calibration_batches()``: this rank's share of the first ``cfg.bn_calibration`` rows of
    the training split, preprocessed as for evaluation. Files are written in a seeded random
    order, so the first rows are a sample of every class."""
    tasks = stream.eval_tasks(stream.blocks(cfg.data, manifest, "train"), world, rank, cfg.bn_calibration)
    return _eval_batches(cfg, manifest, tasks, world, device, how)


def _eval_batches(cfg: TrainConfig, manifest: dict, tasks: list, world: int, device, how: str):
    reader = stream.Reader.for_data(cfg.data, manifest, preset=stream.preset(cfg, manifest),
                                    train=False, augment=False, decode=decode_path(cfg, manifest, device, world))

    def batches():
        yield from _batches(tasks, reader, cfg.eval_batch_size, device, how, preprocess_cpus(cfg, world))

    return batches


def _batches(tasks: list, reader: stream.Reader, size: int, device, how: str, cpus: int, windows=None):
    """Torch batches of ``size`` rows on ``device`` from the tasks' outputs; training outputs
    (``windows`` given) are first put back in sequence order."""
    run = {"ray-data": stream.ray_parts, "torch": _loader, "local": stream.local_parts}[how]
    parts = run(tasks, reader, cpus)
    if windows is not None:
        parts = stream.in_sequence(parts, windows, reader)
    for batch in stream.cut(parts, size):
        if reader.on_device:  # JPEG bytes and random numbers: the pixels are made on the device
            source = {k: batch.pop(k) for k in ("source", "draw", "seed") if k in batch}
            batch["image"] = device_photos.batch_images(source, reader, device)
        yield _to_torch(batch, device)


def _to_torch(batch: dict, device) -> dict:
    pin = torch.device(device).type == "cuda"
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):  # made on the device already
            out[key] = value
            continue
        t = torch.from_numpy(np.ascontiguousarray(value))
        out[key] = t if key == "id" else (t.pin_memory() if pin else t).to(device, non_blocking=True)
    return out


class _Tasks(torch.utils.data.IterableDataset):
    """A torch DataLoader's view of the tasks: worker k of n reads tasks k, k+n, ..., one item
    per task; the DataLoader takes one item from each worker in turn, so the tasks come back in
    their order."""

    def __init__(self, tasks: list, reader: stream.Reader):
        self.tasks, self.reader = tasks, reader

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        k, n = (info.id, info.num_workers) if info else (0, 1)
        for task in self.tasks[k::n]:
            yield stream.read_task(task, self.reader)


def _loader(tasks: list, reader: stream.Reader, workers: int):
    if not tasks:
        return
    workers = min(workers, len(tasks))
    loader = torch.utils.data.DataLoader(_Tasks(tasks, reader), batch_size=None, num_workers=workers,
                                         collate_fn=_unchanged, prefetch_factor=2 if workers else None)
    yield from loader


def _unchanged(part: dict) -> dict:
    return part  # numpy stays numpy: the parts are put in order and cut before becoming tensors


# ---------------------------------------------------------------- validation batches, in memory


def in_memory_val_batches(cfg: TrainConfig, manifest: dict, rank: int, world: int, device,
                          split: str | None = None, rows: int = 0) -> Callable[[], Iterable[dict]]:
    """``val_batches()`` over the validation split (or ``split``'s first ``rows`` rows) read once
    into memory; this rank keeps the rows with ``id % world == rank``: each row once, whatever
    order they arrive in."""
    ids, images, labels = map(torch.from_numpy, fmt.read_split(cfg.data, split or fmt.eval_split(manifest)))
    if rows:  # written in a seeded random order: the first rows are a sample of every class
        ids, images, labels = ids[:rows], images[:rows], labels[:rows]
    mine = ids % world == rank
    ids, images, labels = ids[mine], images[mine], labels[mine]

    def val_batches():
        for start in range(0, len(ids), cfg.eval_batch_size):
            sl = slice(start, start + cfg.eval_batch_size)
            yield {"id": ids[sl], "image": images[sl].to(device), "label": labels[sl].to(device)}

    return val_batches
