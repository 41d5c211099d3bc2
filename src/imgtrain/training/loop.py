"""The per-worker training loop: the only code that runs on Ray Train workers.

The same ``run_loop`` also runs in one plain PyTorch process (``--backend local``); what differs
between the two is gathered in ``Hooks``: how batches arrive, how tensors are summed across
ranks, where checkpoints go and where progress records are sent.

Resuming is exact. A checkpoint (every epoch, and every ``checkpoint_every_steps`` steps)
holds the model, optimizer, scheduler, moving average, step counters and the epoch's partial
sums; the data order and the augmentation are functions of (seed, epoch, step) alone
(``order.py``). A run restarted from step S therefore trains on exactly the rows and
transformations the uninterrupted run would have used after S, at any world size.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ContextManager, Iterable, Iterator

import torch
import torch.nn as nn

from imgtrain import checkpoint as ckpt
from imgtrain.config import TrainConfig, per_worker_batch_sizes
from imgtrain.config import steps_per_epoch as epoch_steps
from imgtrain.data.order import augment_draw
from imgtrain.errors import ImgtrainError
from imgtrain.model import build_from_args, model_args, random_affine, to_model_input
from imgtrain.training import faults
from imgtrain.training.health import Progress

Batch = dict  # {"id": int64 [B], "image": uint8 [B, H, W, C], "label": int64 [B]} on the device

@dataclass
class Hooks:
    """Everything the loop needs from its surroundings (Ray worker or single process)."""

    rank: int
    world_size: int
    device: torch.device
    prepare_model: Callable[[nn.Module], nn.Module]
    # (epoch, first step) -> this rank's batches for the steps of the epoch from that one on
    train_batches: Callable[[int, int], Iterable[Batch]]
    val_batches: Callable[[], Iterable[Batch]]  # the whole test split; evaluate() keeps rows by id
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor]
    restored_checkpoint: Callable[[], ContextManager[str | None]]  # directory of the checkpoint to resume
    report: Callable[[dict, str | None, str], None]  # (metrics, checkpoint dir or None, dir name)
    send: Callable[[dict], None]  # progress / history record to the driver (rank 0 only)
    # Names of damaged checkpoints left in the run directory: new ones must not reuse them, or
    # Ray Train's retention, deleting the damaged one by path, would delete its replacement.
    damaged: list[str] = field(default_factory=list)
    progress: Progress = field(default_factory=Progress)
    run_dir: Path | None = None  # for the sample ledger and injected faults
    fault: faults.Fault | None = None


def in_memory_batches(data_dir: str, split: str, batch_size: int, device) -> Callable[[], Iterable[Batch]]:
    """``val_batches`` over a split read once into memory (validation keeps rows by id)."""
    from imgtrain.data.format import read_split

    ids, images, labels = map(torch.from_numpy, read_split(data_dir, split))

    def batches():
        for start in range(0, len(ids), batch_size):
            sl = slice(start, start + batch_size)
            yield {"id": ids[sl], "image": images[sl].to(device), "label": labels[sl].to(device)}

    return batches


@dataclass
class _State:
    """Where training stands: restored from a checkpoint or fresh."""

    epoch: int = 0  # the epoch to train next (or the one a step checkpoint stopped inside)
    epoch_step: int = 0  # steps of that epoch already taken
    step: int = 0  # optimizer steps taken over the whole run
    sums: torch.Tensor | None = None  # the epoch's global [loss sum, correct, samples] so far
    elapsed_s: float = 0.0  # training time already spent in that epoch
    schedule: dict | None = None
    history: list[dict] = field(default_factory=list)  # the epoch records before this point
    restored_from: str | None = None  # the checkpoint's name


def run_loop(cfg: TrainConfig, manifest: dict, hooks: Hooks) -> None:
    rank, world = hooks.rank, hooks.world_size
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    torch.manual_seed(cfg.seed)  # same initial weights on every rank (DDP also broadcasts them)
    args = model_args(manifest)
    memory_format = torch.channels_last if cfg.channels_last else torch.contiguous_format
    model = hooks.prepare_model(build_from_args(args).to(memory_format=memory_format))
    forward = torch.compile(model) if cfg.compile else model  # same parameters, compiled graph
    if cfg.precision == "bf16" and hooks.device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ImgtrainError(f"--precision bf16: {torch.cuda.get_device_name(hooks.device)} has no bfloat16; use fp32")
    autocast = torch.autocast(hooks.device.type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16")
    mean, std = manifest["normalize"]["mean"], manifest["normalize"]["std"]

    n_train = manifest["splits"]["train"]["num_samples"]
    steps_per_epoch = max(1, epoch_steps(n_train, cfg.batch_size, cfg.limit_train_batches))
    total_steps = cfg.epochs * steps_per_epoch

    optimizer = _optimizer(model, cfg)
    criterion = nn.CrossEntropyLoss(reduction="sum", label_smoothing=cfg.label_smoothing)
    ema = _ema(ckpt.unwrap(model), cfg.ema_decay)
    with hooks.restored_checkpoint() as restore_dir:
        # verified by the hook: a damaged checkpoint is never handed over
        state = _restore(restore_dir, model, optimizer, ema, hooks.device) if restore_dir else _State()
    scheduler = _one_cycle(optimizer, cfg, total_steps - state.step, state.schedule)
    step = state.step
    ledger = _Ledger(hooks, step) if cfg.ledger and hooks.run_dir else None

    history = list(state.history)  # every epoch record up to here: each checkpoint carries them
    if rank == 0:
        # The driver reconciles metrics.jsonl with ``history``: an epoch whose record was lost
        # (the driver killed between the checkpoint and the record) is recovered from it.
        hooks.send({
            "kind": "start", "start_epoch": state.epoch, "epoch_step": state.epoch_step, "step": step,
            "epochs": cfg.epochs, "steps_per_epoch": steps_per_epoch, "total_steps": total_steps,
            "world_size": world, "local_batch_sizes": per_worker_batch_sizes(cfg.batch_size, world),
            "history": history, "restored_from": state.restored_from, "time": time.time(),
        })

    def save(epoch: int, metrics: dict, evaluated: nn.Module, epoch_progress: dict | None, name: str) -> None:
        """Rank 0 writes the checkpoint; every rank reports it (report is a barrier)."""
        in_epoch = epoch_progress is not None
        with tempfile.TemporaryDirectory(prefix="imgtrain-ckpt-") as tmp:
            save_dir = None
            if rank == 0:
                hooks.progress.enter("save")
                train_state = {
                    ckpt.OPTIMIZER_KEY: optimizer.state_dict(), ckpt.SCHEDULER_KEY: scheduler.state_dict(),
                    ckpt.EPOCH_KEY: epoch - 1 if in_epoch else epoch, ckpt.STEP_KEY: step,
                    ckpt.RNG_KEY: {"torch": torch.get_rng_state()},
                }
                if in_epoch:
                    train_state[ckpt.EPOCH_PROGRESS_KEY] = epoch_progress
                if ema is not None:
                    train_state[ckpt.TRAIN_WEIGHTS_KEY] = _cpu(ckpt.unwrap(model).state_dict())
                    train_state[ckpt.EMA_STEPS_KEY] = int(ema.n_averaged.item())
                meta = {
                    "model_args": args, "config": cfg.to_dict(), "metrics": metrics,
                    "data": manifest, "epoch": train_state[ckpt.EPOCH_KEY], "step": step,
                    "total_steps": total_steps, "created": time.time(), ckpt.HISTORY_KEY: history,
                }
                if in_epoch:
                    meta["in_epoch"] = {"epoch": epoch, "steps": epoch_progress["steps"]}
                save_dir = str(ckpt.save(tmp, _cpu(evaluated.state_dict()), train_state, meta))
            hooks.progress.enter("report")
            hooks.report(metrics, save_dir, name)
        faults.maybe_fire(hooks.fault, rank, step, hooks.run_dir, "saved")  # stored, not yet announced

    for epoch in range(state.epoch, cfg.epochs):
        resumed_here = epoch == state.epoch and state.epoch_step > 0
        first_step = min(state.epoch_step, steps_per_epoch) if resumed_here else 0
        # [loss sum, correct, samples], kept on the device: reading them every step would make
        # the host wait for the GPU at every step
        sums = torch.zeros(3, dtype=torch.float64, device=hooks.device)
        if resumed_here and rank == 0:
            sums += state.sums.to(hooks.device)  # what the ranks summed before the checkpoint, counted once
        elapsed_before = state.elapsed_s if resumed_here else 0.0
        epoch_start = time.perf_counter()
        model.train()
        window, timing = _Window(), _EpochTiming()
        batches = iter(hooks.train_batches(epoch, first_step))
        for i in range(first_step, steps_per_epoch):
            t0 = time.perf_counter()
            hooks.progress.enter("data", step)
            batch = next(batches, None)
            if batch is None:
                raise RuntimeError(
                    f"rank {rank} ran out of training data after {i} of {steps_per_epoch} steps in epoch {epoch}"
                )
            data_wait = time.perf_counter() - t0
            hooks.progress.enter("compute")
            faults.maybe_fire(hooks.fault, rank, step, hooks.run_dir, "step")
            if ledger is not None:
                ledger.write(epoch, i, step, batch["id"])
            x = to_model_input(batch["image"], mean, std)  # [B, C, H, W] float32 in [-1, 1]
            if cfg.augment:
                draw = augment_draw(cfg.seed, step, cfg.batch_size, world, rank)
                x = random_affine(x, draw, cfg.max_rotate_deg, cfg.max_shift, cfg.max_scale)
            y = batch["label"]
            hooks.progress.enter("forward")
            with autocast:
                logits = forward(x.contiguous(memory_format=memory_format))
                # DDP averages gradients over ranks; scaling the summed loss by world/global_batch
                # makes that average the exact mean over the global batch even when ranks hold
                # unequal shares (global batch not divisible by the number of workers).
                loss = criterion(logits, y) * (world / cfg.batch_size)
            optimizer.zero_grad(set_to_none=True)
            hooks.progress.enter("backward")
            loss.backward()
            hooks.progress.enter("optimizer")
            optimizer.step()
            scheduler.step()
            if ema is not None:
                ema.update_parameters(ckpt.unwrap(model))
            step += 1
            with torch.no_grad():
                batch_loss = loss.detach().double() * cfg.batch_size / world  # this rank's summed loss
                sums[0] += batch_loss
                correct = (logits.argmax(1) == y).sum()
                sums[1] += correct
                sums[2] += len(y)
            step_time = time.perf_counter() - t0
            window.add(len(y), batch_loss / len(y), correct, data_wait, step_time)
            timing.add(data_wait, step_time)
            if step % cfg.log_every_steps == 0 or i == steps_per_epoch - 1:
                # Every rank reports its own step and data-wait times, rank 0 also the training
                # figures; fire and forget, so no rank ever waits for the driver.
                if rank == 0:
                    hooks.send(window.step_record(epoch, step, scheduler.get_last_lr()[0], world))
                hooks.send(window.rank_record(rank, epoch, step))
                window.reset()
            every = cfg.checkpoint_every_steps
            if every and step % every == 0 and i + 1 < steps_per_epoch:
                hooks.progress.enter("sync")
                total = hooks.all_reduce_sum(sums)
                # counted once from here on
                sums = total.to(hooks.device) if rank == 0 else torch.zeros_like(sums)
                elapsed = elapsed_before + time.perf_counter() - epoch_start
                progress = {"steps": i + 1, "sums": total.cpu(), "elapsed_s": elapsed}
                # Not evaluated: -1 ranks it below every evaluated checkpoint in Ray's retention
                # (a finite number: Ray's saved state turns -inf into null and then fails on it).
                metrics = {"epoch": epoch, "step": step, "val_accuracy": -1.0, "time": time.time()}
                name = ckpt.dir_name(epoch, hooks.damaged, step)
                save(epoch, metrics, ema.module if ema is not None else ckpt.unwrap(model), progress, name)
                if rank == 0:
                    hooks.send({"kind": "checkpoint", "epoch": epoch, "step": step, "checkpoint": name,
                                "time": time.time()})
        _drain(batches)

        train_time = elapsed_before + time.perf_counter() - epoch_start
        hooks.progress.enter("sync", step)
        train_loss, train_acc, seen = _global_means(hooks, sums)
        rank_timing = timing.gather(hooks)
        evaluated = ema.module if ema is not None else ckpt.unwrap(model)
        _buffers_from_rank0(evaluated, hooks)
        hooks.progress.enter("eval")
        faults.maybe_fire(hooks.fault, rank, step, hooks.run_dir, "validating")
        val_loss, val_acc, val_n = evaluate(evaluated, hooks, manifest, criterion.label_smoothing, memory_format)
        metrics = {
            "epoch": epoch, "step": step, "train_loss": train_loss, "train_accuracy": train_acc,
            "val_loss": val_loss, "val_accuracy": val_acc, "val_samples": val_n,
            "train_samples": seen, "lr": scheduler.get_last_lr()[0], "world_size": world,
            "epoch_time_s": elapsed_before + time.perf_counter() - epoch_start,  # training + validation
        }
        metrics["images_per_s"] = seen / max(train_time, 1e-9)  # training only, validation excluded
        metrics.update(rank_timing)
        metrics["time"] = time.time()
        name = ckpt.dir_name(epoch, hooks.damaged)
        history.append(dict(metrics, kind="epoch", checkpoint=name))
        save(epoch, metrics, evaluated, None, name)
        if rank == 0:  # only once the checkpoint is stored: history never runs ahead of it
            hooks.send(history[-1])
    hooks.progress.enter("done", step)


def _restore(directory: str, model: nn.Module, optimizer, ema, device) -> _State:
    state = ckpt.load_train_state(directory)
    meta = ckpt.read_meta(directory)
    saved = ckpt.load_model_state(directory, device)
    if ema is not None and ckpt.TRAIN_WEIGHTS_KEY in state:
        ema.module.load_state_dict(saved)
        ema.n_averaged.fill_(state[ckpt.EMA_STEPS_KEY])
        saved = state[ckpt.TRAIN_WEIGHTS_KEY]
    ckpt.unwrap(model).load_state_dict(saved)
    optimizer.load_state_dict(state[ckpt.OPTIMIZER_KEY])
    torch.set_rng_state(state[ckpt.RNG_KEY]["torch"])
    in_epoch = state.get(ckpt.EPOCH_PROGRESS_KEY)
    return _State(
        epoch=state[ckpt.EPOCH_KEY] + 1, step=state[ckpt.STEP_KEY], schedule=state[ckpt.SCHEDULER_KEY],
        epoch_step=in_epoch["steps"] if in_epoch else 0,
        sums=in_epoch["sums"].double() if in_epoch else None,
        elapsed_s=in_epoch["elapsed_s"] if in_epoch else 0.0,
        history=ckpt.history(meta), restored_from=Path(directory).name,
    )


class _Ledger:
    """Appends the ids of the rows this rank trains on, one line per step (``--ledger``).

    Every line names its worker group (``group``: an id rank 0 draws and shares, and
    ``group_step``: the global step the group started from). When a group dies, the steps it
    trained after its last checkpoint are trained again by the next group, whose lines for
    those steps supersede the dead group's: their updates never reached a checkpoint.
    """

    def __init__(self, hooks: Hooks, start_step: int):
        mine = float(int.from_bytes(os.urandom(6), "little")) if hooks.rank == 0 else 0.0
        group = int(hooks.all_reduce_sum(torch.tensor([mine], dtype=torch.float64)).item())
        directory = Path(hooks.run_dir) / "ledger"
        directory.mkdir(parents=True, exist_ok=True)
        self.file = open(directory / f"rank-{hooks.rank}.jsonl", "a")
        self.fixed = {"rank": hooks.rank, "world_size": hooks.world_size, "group": group,
                      "group_step": start_step, "group_started": time.time()}

    def write(self, epoch: int, epoch_step: int, step: int, ids: torch.Tensor) -> None:
        line = dict(self.fixed, epoch=epoch, epoch_step=epoch_step, step=step, ids=ids.tolist())
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()


def evaluate(
    model: nn.Module, hooks: Hooks, manifest: dict, label_smoothing: float = 0.0,
    memory_format: torch.memory_format = torch.contiguous_format,
):
    """Loss and accuracy on the test split, each row counted once across all ranks.

    Every rank reads the whole split and keeps rows with ``id % world == rank``: exact
    coverage whatever order the rows arrive in. The plain (unwrapped) model is used, so
    no rank waits on a DDP collective for a forward pass another rank does not make.
    """
    rank, world = hooks.rank, hooks.world_size
    mean, std = manifest["normalize"]["mean"], manifest["normalize"]["std"]
    criterion = nn.CrossEntropyLoss(reduction="sum", label_smoothing=label_smoothing)
    sums = torch.zeros(3, dtype=torch.float64)
    was_training = model.training
    model.eval()
    with torch.inference_mode():
        for batch in hooks.val_batches():
            mine = batch["id"] % world == rank
            if not mine.any():
                continue
            x = to_model_input(batch["image"][mine], mean, std)
            y = batch["label"][mine]
            logits = model(x.contiguous(memory_format=memory_format))
            sums += torch.tensor(
                [criterion(logits, y).item(), (logits.argmax(1) == y).sum().item(), len(y)],
                dtype=torch.float64,
            )
    model.train(was_training)
    loss, acc, n = _global_means(hooks, sums)
    return loss, acc, n


def _global_means(hooks: Hooks, sums: torch.Tensor) -> tuple[float, float, int]:
    total = hooks.all_reduce_sum(sums.clone())
    n = int(total[2].item())
    return total[0].item() / max(n, 1), total[1].item() / max(n, 1), n


def _buffers_from_rank0(model: nn.Module, hooks: Hooks) -> None:
    """Give every rank rank 0's BatchNorm statistics (a collective: all ranks call it).

    Parameters are identical on all ranks, but each rank's last forward pass updated its
    running statistics with its own batch. Validation and the saved model.pt must use the
    same statistics, or a later evaluation of the checkpoint would not reproduce the
    recorded accuracy.
    """
    if hooks.world_size == 1:
        return
    buffers = [b for b in model.buffers() if b.is_floating_point()]
    flat = torch.cat([b.detach().flatten().double().cpu() for b in buffers])
    if hooks.rank != 0:
        flat.zero_()
    flat = hooks.all_reduce_sum(flat)  # adding zeros: exactly rank 0's values
    offset = 0
    with torch.no_grad():
        for b in buffers:
            b.copy_(flat[offset : offset + b.numel()].view_as(b))
            offset += b.numel()


def _optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9, nesterov=True,
                               weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)


def _ema(model: nn.Module, decay: float):
    """Moving average of weights and BatchNorm statistics, or None when decay is 0.

    The decay warms up as (1 + n) / (10 + n) until it reaches ``decay``, so that a short run
    is not dominated by the random initial weights.
    """
    if not decay:
        return None
    from torch.optim.swa_utils import AveragedModel

    @torch.no_grad()
    def update(averaged: list, current: list, num_averaged) -> None:
        if not torch.is_floating_point(averaged[0]):  # BatchNorm's step counters: just copy
            torch._foreach_copy_(averaged, current)
            return
        n = float(num_averaged)
        d = min(decay, (1.0 + n) / (10.0 + n))
        torch._foreach_lerp_(averaged, current, 1.0 - d)

    return AveragedModel(model, multi_avg_fn=update, use_buffers=True)


def _one_cycle(optimizer, cfg: TrainConfig, remaining: int, saved: dict | None):
    """One-cycle LR over the run. A resumed run continues its saved cycle when that cycle has
    exactly the steps left that the run has; otherwise (more epochs than the run started with,
    another step limit) a fresh cycle covers the steps that remain."""
    remaining = max(1, remaining)
    if saved is not None and saved["total_steps"] - saved["last_epoch"] == remaining:
        # Constructing the scheduler resets every group's LR and momentum (betas) to the
        # cycle's start; the optimizer's restored values are the ones the next step must use.
        restored = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        sched = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=cfg.lr, total_steps=saved["total_steps"], pct_start=cfg.warmup_fraction
        )
        sched.load_state_dict(saved)
        for group, values in zip(optimizer.param_groups, restored):
            group.update(values)
        return sched
    return torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=cfg.lr, total_steps=remaining, pct_start=cfg.warmup_fraction
    )


def _cpu(state: dict) -> dict:
    """A state_dict on the CPU, so that a checkpoint written on a GPU loads anywhere."""
    return {k: v.detach().cpu() for k, v in state.items()}


def _drain(batches: Iterator) -> None:
    # Close the epoch's iterator so its prefetching stops before validation starts.
    close = getattr(batches, "close", None)
    if close:
        close()


class _Window:
    """This rank's running figures between two progress records."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        # loss and correct stay tensors on the device until a record is sent: reading them at
        # every step would make the host wait for the GPU at every step
        self.samples, self.loss_sum, self.correct, self.wait, self.busy, self.n = 0, 0.0, 0, 0.0, 0.0, 0

    def add(self, samples: int, mean_loss, correct, wait: float, total: float) -> None:
        self.samples += samples
        self.loss_sum += mean_loss
        self.correct += correct
        self.wait += wait
        self.busy += total
        self.n += 1

    def step_record(self, epoch: int, step: int, lr: float, world: int) -> dict:
        """Rank 0's view of the last steps: loss, accuracy, throughput of the whole group."""
        return {
            "kind": "step", "epoch": epoch, "step": step, "loss": float(self.loss_sum) / max(self.n, 1),
            "accuracy": float(self.correct) / max(self.samples, 1), "lr": lr,
            "images_per_s": self.samples * world / max(self.busy, 1e-9),
            "data_wait_fraction": self.wait / max(self.busy, 1e-9), "time": time.time(),
        }

    def rank_record(self, rank: int, epoch: int, step: int) -> dict:
        """Where this rank's time went over the last steps: is it starved by data?"""
        n = max(self.n, 1)
        return {
            "kind": "rank", "rank": rank, "epoch": epoch, "step": step, "steps": self.n,
            "step_time_s": self.busy / n, "data_wait_s": self.wait / n,
            "data_wait_fraction": self.wait / max(self.busy, 1e-9), "time": time.time(),
        }


class _EpochTiming:
    """This rank's step and data-wait seconds over an epoch, gathered from every rank at its end."""

    def __init__(self):
        self.wait, self.busy, self.n = 0.0, 0.0, 0

    def add(self, wait: float, total: float) -> None:
        self.wait, self.busy, self.n = self.wait + wait, self.busy + total, self.n + 1

    def gather(self, hooks: Hooks) -> dict:
        """Per-rank mean step and data-wait times (a collective: every rank calls it, at the
        epoch-end synchronisation that already exists, so no step waits for it)."""
        table = torch.zeros(hooks.world_size, 3, dtype=torch.float64)
        table[hooks.rank] = torch.tensor([self.busy, self.wait, self.n], dtype=torch.float64)
        table = hooks.all_reduce_sum(table)  # each rank filled its own row: a gather
        steps = table[:, 2].clamp(min=1)
        step_time, wait = (table[:, 0] / steps).tolist(), (table[:, 1] / steps).tolist()
        return {
            "rank_step_time_s": step_time, "rank_data_wait_s": wait,
            # the slowest-fed rank sets the pace: DDP waits for it at every step
            "data_wait_fraction": max(w / max(t, 1e-9) for w, t in zip(wait, step_time)),
        }
