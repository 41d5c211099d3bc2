"""The local backend: the same training loop in this process, no Ray, the tutorial's
single-device baseline (``--backend local``). What it changes in the process (torch threads,
deterministic kernels, the global RNG) is put back afterwards: the library may run in a
notebook.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from pathlib import Path

import torch

from imgtrain.checkpoint_policy import POLICY, PREFIX
from imgtrain.cluster import threads_for
from imgtrain.config import TrainConfig
from imgtrain.data.staging import local_data
from imgtrain.errors import ImgtrainError
from imgtrain.ops import process
from imgtrain.ops.files import disk_full
from imgtrain.storage import checkpoint as ckpt
from imgtrain.storage import location
from imgtrain.training import faults, tracking


def fit(cfg: TrainConfig, manifest: dict, run_dir: Path, records, resume) -> None:
    """Train in this process; records go to ``records``."""
    from imgtrain.data import stream
    from imgtrain.training import ingest
    from imgtrain.training.backend import Backend, single_process_collectives
    from imgtrain.training.loop import phase_record, run_loop

    device = torch.device("cuda" if cfg.use_gpu else "cpu")
    records.display.note(f"run {cfg.name}: {run_dir}  (local backend, {device})")
    records.send(phase_record("loading data"))  # as a Ray worker's rank 0 does
    for stale in run_dir.glob(f".{PREFIX}*.tmp"):  # a copy cut short by a killed driver
        shutil.rmtree(stale, ignore_errors=True)
    staging = location.checkpoint_staging(location.location(cfg.storage, cfg.name), 0)  # cleared by the driver
    in_memory = stream.in_memory(cfg, manifest)
    data_cfg = dataclasses.replace(cfg, data=local_data(cfg.data))  # an object store's: copied here
    if in_memory:
        from imgtrain.data.format import read_split
        from imgtrain.data.order import ordered_batches, sort_by_id

        rows = sort_by_id(*map(torch.from_numpy, read_split(data_cfg.data, "train")))
        train_batches = ordered_batches(rows, cfg.seed, cfg.batch_size, ingest.steps(cfg, manifest), world_size=1,
                                        rank=0, device=device, on_device=cfg.data_on_device,
                                        balanced=cfg.sampling == "balanced")
        val_batches = ingest.in_memory_val_batches(data_cfg, manifest, 0, 1, device)
        calibration = ingest.in_memory_val_batches(data_cfg, manifest, 0, 1, device, "train", cfg.bn_calibration) \
            if cfg.bn_calibration else None
    else:  # streamed: the same tasks as on Ray, in a DataLoader's worker processes (or here)
        how = "torch" if cfg.ingest == "torch" else "local"
        train_batches = ingest.streamed_train_batches(data_cfg, manifest, 0, 1, device, how)
        val_batches = ingest.streamed_val_batches(data_cfg, manifest, 0, 1, device, how)
        calibration = ingest.streamed_calibration_batches(data_cfg, manifest, 0, 1, device, how) \
            if cfg.bn_calibration else None

    fault = faults.parse(os.environ.get(faults.ENV_VAR))
    teacher_logits = None
    if cfg.teacher and cfg.distill_mode == "cached":
        from imgtrain.training import teacher_cache

        records.send(phase_record("computing the teacher's logits"))
        teacher_logits = teacher_cache.ensure(cfg, manifest, records.display.note, on_ray=False).to_dict()

    @contextlib.contextmanager
    def restored_checkpoint():
        yield str(resume.checkpoint) if resume.checkpoint else None  # verified by train()

    def report(metrics: dict, save_dir: str | None, name: str) -> None:
        target = run_dir / name
        tmp = run_dir / f".{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            shutil.copytree(save_dir, tmp)
            faults.maybe_fire(fault, 0, metrics["step"], run_dir, "saving")  # half copied into the run
        except (OSError, shutil.Error) as e:
            shutil.rmtree(tmp, ignore_errors=True)  # never leave half a checkpoint behind
            if disk_full(e):
                raise ImgtrainError(f"cannot save checkpoint {name}: the disk holding {run_dir.parent} is "
                                    "full (No space left on device); free space or choose another --storage") from None
            raise
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)  # complete or invisible
        ckpt.retain(run_dir, POLICY.for_metric(cfg.select_metric).keeping(cfg.num_to_keep), ignore=resume.damaged)

    backend = Backend(
        rank=0, world_size=1, device=device, prepare_model=lambda m: m.to(device), damaged=resume.damaged,
        train_batches=train_batches, val_batches=val_batches, augment_in_step=in_memory,
        calibration_batches=calibration, teacher_logits=teacher_logits,
        **single_process_collectives(), restored_checkpoint=restored_checkpoint, report=report, send=records.send,
        run_dir=run_dir, fault=fault, staging=staging,
    )
    with process_settings_restored():
        torch.set_num_threads(threads_for(1, cfg.threads_per_worker, cfg.use_gpu))
        run_loop(TrainConfig(**tracking.public_config(cfg)), manifest, backend)  # meta.json stores it


@contextlib.contextmanager
def process_settings_restored():
    """Put back what training changes process-wide: torch's thread count, deterministic
    kernels, cuDNN autotuning, the global RNG (seeded for the model's initial weights) and the
    environment."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    benchmark, rng = torch.backends.cudnn.benchmark, torch.get_rng_state()
    try:
        with process.environment_restored():  # torch's inductor notes its cache folder there
            yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.backends.cudnn.benchmark = benchmark
        torch.set_rng_state(rng)
