"""The worker side of the Ray backend: ``train_loop_per_worker`` wires ``run_loop`` to Ray Train.

Each worker also runs a heartbeat thread that tells the driver, once a second, which step
and phase it is in, so that a stuck rank can be named (``watchdog.Watchdog``), and carries
its step records (``health.Outbox``: no actor call in the step); it dumps its Python stacks
when asked (``stacks.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import shutil
import tempfile
from pathlib import Path

import torch

from imgtrain.cluster import threads_for
from imgtrain.config import TrainConfig
from imgtrain.data import stream
from imgtrain.data.order import ordered_batches, sort_by_id
from imgtrain.data.staging import local_data
from imgtrain.ops import remote
from imgtrain.storage import checkpoint as ckpt
from imgtrain.storage import location
from imgtrain.training import faults, health, ingest
from imgtrain.training.backend import Backend, single_process_collectives
from imgtrain.training.health import Progress
from imgtrain.training.loop import phase_record, run_loop


def train_loop_per_worker(config: dict) -> None:
    """Ray Train entry point. ``config`` is a plain dict: {"cfg", "manifest", "monitor",
    "resume", "run_dir", "fault"}."""
    import ray.train
    import ray.train.torch

    # Ray Data's usage statistics: the first Ray Data pass starts a thread that queries the
    # cluster's Prometheus every 10 s for as long as the worker lives, its Python taking the GIL
    # from the training steps (issue 51). Off in this process, unless the user chose otherwise.
    os.environ.setdefault("RAY_DATA_USAGE_DISABLED", "1")
    cfg = TrainConfig(**config["cfg"])
    manifest = config["manifest"]
    monitor = config.get("monitor")
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(threads_for(ctx.get_local_world_size(), cfg.threads_per_worker, cfg.use_gpu))
    device = ray.train.torch.get_device()
    progress = Progress()
    outbox = health.Outbox(monitor)
    stop_heartbeat = health.start_heartbeat(outbox, rank, world, progress)

    resume = config.get("resume") or {}
    restored_checkpoint = functools.partial(_restored_checkpoint, resume.get("fallback"))
    staging = location.checkpoint_staging(location.location(cfg.storage, cfg.name), rank)
    shutil.rmtree(staging, ignore_errors=True)  # what an earlier attempt left: over now
    report = functools.partial(_report_async, staging=staging) if remote.is_remote(cfg.storage) else _report

    send = outbox.send  # fire and forget: never a barrier
    if rank == 0:
        send(phase_record("loading data"))
    train_batches, val_batches, calibration = _batches(cfg, manifest, rank, world, device)
    backend = Backend(
        rank=rank, world_size=world, device=device,
        prepare_model=_model_preparation(cfg, device), train_batches=train_batches, val_batches=val_batches,
        augment_in_step=stream.in_memory(cfg, manifest), calibration_batches=calibration,
        **(_collectives(world, device) if world > 1 else single_process_collectives()),
        restored_checkpoint=restored_checkpoint, report=report, send=send,
        damaged=resume.get("damaged") or [], progress=progress,
        run_dir=Path(config["run_dir"]) if config.get("run_dir") else None, staging=staging,
        fault=faults.parse(config.get("fault")), teacher_logits=config.get("teacher_logits"),
    )
    try:
        run_loop(cfg, manifest, backend)
    finally:
        stop_heartbeat()


@contextlib.contextmanager
def _restored_checkpoint(fallback: str | None):
    """Ray's latest checkpoint: on a retry the one this run last reported, on a re-run the run's
    latest. If its files fail their sha256, the driver's newest good one, ``fallback``, instead
    (None: no good one was left, and the driver said it starts from scratch)."""
    import ray.train

    found = ray.train.get_checkpoint()
    if found is not None:
        with found.as_directory() as d:
            try:
                ckpt.verify(d)
                good = True
            except ckpt.CheckpointError:
                good = False
            if good:
                yield d
                return
    if fallback and "://" in fallback:  # a checkpoint in the object store: fetched into a temporary folder
        fs, path = remote.split(fallback)
        with ray.train.Checkpoint(path, filesystem=fs).as_directory() as d:
            yield d
    else:
        yield fallback


def _report(metrics: dict, save_dir: str | None, name: str) -> None:
    import ray.train

    checkpoint = ray.train.Checkpoint.from_directory(save_dir) if save_dir else None
    ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=name)


def _report_async(metrics: dict, save_dir: str | None, name: str, staging: Path) -> None:
    """To an object store in the background (training goes on). Ray deletes the folder after the
    upload, so the checkpoint's files move to one of their own: save_dir is removed when save() returns."""
    import ray.train

    if not save_dir:
        return _report(metrics, None, name)
    staging.mkdir(parents=True, exist_ok=True, mode=0o700)
    staged = tempfile.mkdtemp(prefix=f"{name}-", dir=staging)
    for entry in os.listdir(save_dir):
        os.rename(os.path.join(save_dir, entry), os.path.join(staged, entry))
    ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(staged),
                     checkpoint_dir_name=name, checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC)


def _batches(cfg: TrainConfig, manifest: dict, rank: int, world: int, device):
    """(training, validation, BatchNorm calibration or None) batches of this rank. They read the
    data set's folder on this node (one in an object store is copied here first); run_loop and
    the checkpoints keep the data set as the user named it."""
    data_cfg = dataclasses.replace(cfg, data=local_data(cfg.data))
    if stream.in_memory(cfg, manifest):
        ingest_fn = _torch_ingest if cfg.ingest == "torch" else _ray_data_ingest
        calibration = (ingest.in_memory_val_batches(data_cfg, manifest, rank, world, device, "train",
                                                    cfg.bn_calibration) if cfg.bn_calibration else None)
        return (ingest_fn(data_cfg, manifest, rank, world, device),
                ingest.in_memory_val_batches(data_cfg, manifest, rank, world, device), calibration)
    if cfg.ingest == "ray-data":
        stream.warm_decoders(ingest.preprocess_cpus(data_cfg, world))
    calibration = (ingest.streamed_calibration_batches(data_cfg, manifest, rank, world, device, cfg.ingest)
                   if cfg.bn_calibration else None)
    return (ingest.streamed_train_batches(data_cfg, manifest, rank, world, device, cfg.ingest),
            ingest.streamed_val_batches(data_cfg, manifest, rank, world, device, cfg.ingest), calibration)


def _model_preparation(cfg: TrainConfig, device):
    """DDP through Ray Train, or FSDP2 applied here: Ray's own FSDP option is FSDP1, which
    needs CUDA (``fsdp.py``)."""
    import ray.train.torch

    if cfg.strategy == "fsdp":
        from imgtrain.training import fsdp

        fsdp.return_freed_memory()
        return lambda model: fsdp.shard(model, device, cfg.precision)
    return ray.train.torch.prepare_model


def _collectives(world: int, device) -> dict:
    """torch.distributed's collectives for the loop (gloo on CPUs, NCCL on GPUs: tensors go
    through the device), CPU tensors in and out."""
    import torch.distributed as dist

    def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
        moved = t.to(device)
        dist.all_reduce(moved)
        return moved.cpu()

    def broadcast(t: torch.Tensor) -> torch.Tensor:
        moved = t.to(device)
        dist.broadcast(moved, src=0)
        return moved.cpu()

    def all_gather(t: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(t, device=device) for _ in range(world)]
        dist.all_gather(parts, t.to(device))
        return torch.stack(parts).cpu()

    return {"all_reduce_sum": all_reduce_sum, "broadcast": broadcast, "all_gather": all_gather}


def _ray_data_ingest(cfg: TrainConfig, manifest: dict, rank: int, world: int, device):
    """Every worker gets the whole (unsplit) train Dataset from Ray Data once, then takes its
    rows of each global batch in the run's global order (``order.py``): unlike
    ``streaming_split``, which rows a rank sees never depends on timing or world size."""
    import ray.train

    whole = ray.train.get_dataset_shard("train")  # not split: DataConfig(datasets_to_split=[])
    columns = {"id": [], "image": [], "label": []}
    for batch in whole.iter_torch_batches(batch_size=8192, dtypes=ingest.batch_dtypes(manifest)):
        for key in columns:
            columns[key].append(batch[key])
    rows = sort_by_id(*(torch.cat(columns[key]) for key in ("id", "image", "label")))
    return ordered_batches(rows, cfg.seed, cfg.batch_size, ingest.steps(cfg, manifest), world, rank, device,
                           on_device=cfg.data_on_device, balanced=cfg.sampling == "balanced")


def _torch_ingest(cfg: TrainConfig, manifest: dict, rank: int, world: int, device):
    """A DataLoader over the split read from its Parquet files, fed this rank's rows of each
    global batch (the same global order as the Ray Data ingest)."""
    import ray.train.torch
    from torch.utils.data import DataLoader, TensorDataset

    from imgtrain.data.format import read_split
    from imgtrain.data.order import epoch_order, rank_rows

    rows = sort_by_id(*map(torch.from_numpy, read_split(cfg.data, "train")))
    steps = ingest.steps(cfg, manifest)
    if cfg.data_on_device:  # no loader at all: batches are gathered in device memory
        return ordered_batches(rows, cfg.seed, cfg.batch_size, steps, world, rank, device, on_device=True,
                               balanced=cfg.sampling == "balanced")
    train = TensorDataset(*rows)

    def train_batches(epoch: int, first_step: int):
        perm = epoch_order(rows[2], cfg.seed, epoch, cfg.sampling == "balanced")
        plan = [rank_rows(perm, k, cfg.batch_size, world, rank).tolist() for k in range(first_step, steps)]
        loader = DataLoader(train, batch_sampler=plan)
        for ids, images, labels in ray.train.torch.prepare_data_loader(loader, add_dist_sampler=False):
            yield {"id": ids, "image": images, "label": labels}

    return train_batches


