"""A rank's side of checkpoints: ``save`` (rank 0 writes, every rank reports), ``restore`` (a
checkpoint back into the model, optimizer and moving average) and the step checkpoint inside an
epoch. The format is storage/checkpoint.py's; names and ranking are the policy's (checkpoint_policy.py).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn

from imgtrain.checkpoint_policy import POLICY
from imgtrain.data.format import eval_split
from imgtrain.models.zoo import model_args
from imgtrain.storage import checkpoint as ckpt
from imgtrain.storage.runs import versions
from imgtrain.training import faults, fsdp
from imgtrain.training.evaluation import evaluated_model
from imgtrain.training.run_state import Resumed, Run


def checkpoint_inside_epoch(run: Run, epoch: int, steps_done: int, sums: torch.Tensor, elapsed: float) -> torch.Tensor:
    """A step checkpoint: the epoch's sums so far over all ranks go into it; returns the sums
    to go on with (rank 0 holds the total from here on, so it is counted once)."""
    backend = run.backend
    backend.progress.enter("sync")
    total = backend.all_reduce_sum(sums)
    progress = {"steps": steps_done, "sums": total.cpu(), "elapsed_s": elapsed}
    # Not evaluated: the policy's stand-in for the ranking metric puts it below every evaluated
    # checkpoint, in Ray's retention (which ranks by the reported metrics) as in the local one
    metrics = {"epoch": epoch, "step": run.step, **POLICY.for_metric(run.cfg.select_metric).unevaluated_metrics(),
               "time": time.time()}
    name = POLICY.step_name(epoch, run.step, backend.damaged)
    save(run, epoch, metrics, progress, name)
    if backend.rank == 0:
        backend.send({"kind": "checkpoint", "epoch": epoch, "step": run.step, "checkpoint": name, "time": time.time()})
    return total.to(backend.device) if backend.rank == 0 else torch.zeros_like(sums)


def save(run: Run, epoch: int, metrics: dict, epoch_progress: dict | None, name: str,
         evaluated: nn.Module | None = None, average: dict | None = None,
         trained_evaluated: nn.Module | None = None, thresholds: torch.Tensor | None = None) -> None:
    """Rank 0 writes the checkpoint ``name``; every rank reports it (report is a barrier).
    ``epoch_progress``: how far into ``epoch`` a step checkpoint was taken; ``evaluated``: the
    model validation just used, when it did. ``average``: the average checkpoint's record
    (``averaging.py``), whose model.pt is not the evaluated model training goes on with:
    ``trained_evaluated`` is (its weights are kept in train_state.pt; FSDP's are in sharded/).
    ``thresholds``: a multi-label model's, chosen by validation (``multilabel.validate``).

    With FSDP every rank also writes its shards of the training state into ``sharded/`` of its
    own directory; Ray Train copies every rank's directory into the same checkpoint, and rank
    0's meta.json records the sha256 of all of their files."""
    backend, in_epoch = run.backend, epoch_progress is not None
    if backend.staging is not None:
        backend.staging.mkdir(parents=True, exist_ok=True, mode=0o700)
    with tempfile.TemporaryDirectory(prefix="imgtrain-ckpt-", dir=backend.staging) as tmp:
        save_dir, shard_hashes = None, {}
        if run.sharded:
            backend.progress.enter("sync")  # gathering and DCP's plan are collectives: a phase the watchdog lets wait
            evaluated = evaluated_model(run) if evaluated is None else evaluated
            shard_hashes = fsdp.save_sharded(Path(tmp) / ckpt.SHARDED_DIR, run.model, run.optimizer,
                                             run.ema.module if run.ema is not None else None)
            save_dir = tmp
        if backend.rank == 0:
            backend.progress.enter("save")
            train_state = {
                ckpt.SCHEDULER_KEY: run.scheduler.state_dict(),
                ckpt.EPOCH_KEY: epoch - 1 if in_epoch else epoch, ckpt.STEP_KEY: run.step,
                ckpt.RNG_KEY: {"torch": torch.get_rng_state()},
            }
            if not run.sharded:  # with FSDP these are in sharded/
                train_state[ckpt.OPTIMIZER_KEY] = run.optimizer.state_dict()
                if run.ema is not None:
                    train_state[ckpt.TRAIN_WEIGHTS_KEY] = _cpu(ckpt.unwrap(run.model).state_dict())
            if in_epoch:
                train_state[ckpt.EPOCH_PROGRESS_KEY] = epoch_progress
            if run.ema is not None:
                train_state[ckpt.EMA_STEPS_KEY] = run.ema.steps
            if run.window is not None and run.window.state():
                train_state[ckpt.AVERAGE_WINDOW_KEY] = run.window.state()
            if trained_evaluated is not None:
                train_state[ckpt.EVALUATED_WEIGHTS_KEY] = _cpu(trained_evaluated.state_dict())
            if run.scaler is not None:
                train_state[ckpt.GRAD_SCALER_KEY] = run.scaler.state_dict()
            meta = {
                "model_args": model_args(run.manifest, run.cfg.model, run.cfg.stem), "config": run.cfg.to_dict(),
                "metrics": metrics, "data": run.manifest, "epoch": train_state[ckpt.EPOCH_KEY], "step": run.step,
                "total_steps": run.total_steps, "created": time.time(), ckpt.HISTORY_KEY: run.history,
                **versions(),
            }
            if in_epoch:
                meta["in_epoch"] = {"epoch": epoch, "steps": epoch_progress["steps"]}
            if average is not None:
                meta[ckpt.AVERAGE_KEY] = average
            model_state = _cpu((run.evaluated if evaluated is None else evaluated).state_dict())
            kept = None if thresholds is None else {
                "thresholds": thresholds.float().cpu(), "chosen_on": "val" if eval_split(run.manifest) == "val" else None}
            save_dir = str(ckpt.save(tmp, model_state, train_state, meta, shard_hashes, kept))
        backend.progress.enter("report")
        backend.report(metrics, save_dir, name)
    faults.maybe_fire(backend.fault, backend.rank, run.step, backend.run_dir, "saved")  # stored, not yet announced


def restore(directory: str, model: nn.Module, optimizer, ema, device) -> Resumed:
    state = ckpt.load_train_state(directory)
    meta = ckpt.read_meta(directory)
    if fsdp.is_sharded(model):  # weights, optimizer and average from the shards, at any world size
        fsdp.load_sharded(Path(directory) / ckpt.SHARDED_DIR, model, optimizer,
                          ema.module if ema is not None else None)
        if ema is not None:
            ema.steps = int(state[ckpt.EMA_STEPS_KEY])
    else:
        # the average checkpoint's model.pt is the average: the evaluated weights are kept aside
        saved = state[ckpt.EVALUATED_WEIGHTS_KEY] if ckpt.EVALUATED_WEIGHTS_KEY in state \
            else ckpt.load_model_state(directory, device)
        if ema is not None and ckpt.TRAIN_WEIGHTS_KEY in state:
            ema.module.load_state_dict(saved)
            ema.steps = int(state[ckpt.EMA_STEPS_KEY])
            saved = state[ckpt.TRAIN_WEIGHTS_KEY]
        ckpt.unwrap(model).load_state_dict(saved)
        optimizer.load_state_dict(state[ckpt.OPTIMIZER_KEY])
    torch.set_rng_state(state[ckpt.RNG_KEY]["torch"])
    in_epoch = state.get(ckpt.EPOCH_PROGRESS_KEY)
    return Resumed(
        epoch=state[ckpt.EPOCH_KEY] + 1, step=state[ckpt.STEP_KEY], schedule=state[ckpt.SCHEDULER_KEY],
        epoch_step=in_epoch["steps"] if in_epoch else 0,
        sums=in_epoch["sums"].double() if in_epoch else None,
        elapsed_s=in_epoch["elapsed_s"] if in_epoch else 0.0,
        history=ckpt.history(meta), restored_from=Path(directory).name, grad_scaler=state.get(ckpt.GRAD_SCALER_KEY),
        window=state.get(ckpt.AVERAGE_WINDOW_KEY), averaged=ckpt.AVERAGE_KEY in meta,
    )


def _cpu(state: dict) -> dict:
    """A state_dict on the CPU, so that a checkpoint written on a GPU loads anywhere."""
    return {k: v.detach().cpu() for k, v in state.items()}
