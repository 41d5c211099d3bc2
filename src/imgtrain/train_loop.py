"""The per-worker training loop: the only code that runs on Ray Train workers.

The same ``run_loop`` also runs in one plain PyTorch process (``--backend local``); what differs
between the two is gathered in ``Hooks``: how batches arrive, how tensors are summed across
ranks, where checkpoints go and where progress records are sent.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Iterable, Iterator

import torch
import torch.nn as nn

from imgtrain import checkpoint as ckpt
from imgtrain.config import TrainConfig, per_worker_batch_sizes, steps_per_epoch as epoch_steps
from imgtrain.model import build_from_args, model_args, random_affine, to_model_input

Batch = dict  # {"id": int64 [B], "image": uint8 [B, H, W, C], "label": int64 [B]} on the device


@dataclass
class Hooks:
    """Everything the loop needs from its surroundings (Ray worker or single process)."""

    rank: int
    world_size: int
    device: torch.device
    prepare_model: Callable[[nn.Module], nn.Module]
    train_batches: Callable[[int, int], Iterable[Batch]]  # (epoch, local batch size) -> batches
    val_batches: Callable[[], Iterable[Batch]]  # the whole test split; evaluate() keeps rows by id
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor]
    restored_checkpoint: Callable[[], ContextManager[str | None]]  # directory of the checkpoint to resume
    report: Callable[[dict, str | None, str], None]  # (metrics, checkpoint dir or None, dir name)
    send: Callable[[dict], None]  # progress / history record to the driver (rank 0 only)
    # Names of damaged checkpoints left in the run directory: new ones must not reuse them, or
    # Ray Train's retention, deleting the damaged one by path, would delete its replacement.
    damaged: list[str] = field(default_factory=list)


def checkpoint_dir_name(epoch: int, taken=()) -> str:
    name, k = f"checkpoint_epoch_{epoch:04d}", 1
    candidate = name
    while candidate in taken:
        k += 1
        candidate = f"{name}-{k}"
    return candidate


def run_loop(cfg: TrainConfig, manifest: dict, hooks: Hooks) -> None:
    rank, world = hooks.rank, hooks.world_size
    torch.manual_seed(cfg.seed)  # same initial weights on every rank (DDP also broadcasts them)
    args = model_args(manifest)
    memory_format = torch.channels_last if cfg.channels_last else torch.contiguous_format
    model = hooks.prepare_model(build_from_args(args).to(memory_format=memory_format))
    mean, std = manifest["normalize"]["mean"], manifest["normalize"]["std"]

    local_batch = per_worker_batch_sizes(cfg.batch_size, world)[rank]
    # Every rank takes the same number of steps per epoch (a rank that stops early would
    # deadlock the others in the gradient all-reduce), as many as the smallest shard feeds.
    n_train = manifest["splits"]["train"]["num_samples"]
    steps_per_epoch = max(1, epoch_steps(n_train, cfg.batch_size, world, cfg.limit_train_batches))
    total_steps = cfg.epochs * steps_per_epoch

    optimizer = _optimizer(model, cfg)
    criterion = nn.CrossEntropyLoss(reduction="sum", label_smoothing=cfg.label_smoothing)
    augment_rng = torch.Generator().manual_seed(cfg.seed * 10_007 + rank)

    ema = _ema(ckpt.unwrap(model), cfg.ema_decay)
    start_epoch, step, schedule_state = 0, 0, None
    with hooks.restored_checkpoint() as restore_dir:
        if restore_dir:  # verified by the hook: a damaged checkpoint is never handed over
            state = ckpt.load_train_state(restore_dir)
            saved = ckpt.load_model_state(restore_dir, hooks.device)
            if ema is not None and ckpt.TRAIN_WEIGHTS_KEY in state:
                ema.module.load_state_dict(saved)
                ema.n_averaged.fill_(state[ckpt.EMA_STEPS_KEY])
                saved = state[ckpt.TRAIN_WEIGHTS_KEY]
            ckpt.unwrap(model).load_state_dict(saved)
            optimizer.load_state_dict(state[ckpt.OPTIMIZER_KEY])
            schedule_state = state[ckpt.SCHEDULER_KEY]
            start_epoch, step = state[ckpt.EPOCH_KEY] + 1, state[ckpt.STEP_KEY]
            torch.set_rng_state(state[ckpt.RNG_KEY]["torch"])
            augment_rng.set_state(state[ckpt.RNG_KEY]["augment"][rank % len(state[ckpt.RNG_KEY]["augment"])])
    scheduler = _one_cycle(optimizer, cfg, (cfg.epochs - start_epoch) * steps_per_epoch, schedule_state)

    if rank == 0:
        hooks.send({
            "kind": "start", "start_epoch": start_epoch, "step": step, "epochs": cfg.epochs,
            "steps_per_epoch": steps_per_epoch, "total_steps": total_steps, "world_size": world,
            "local_batch_sizes": per_worker_batch_sizes(cfg.batch_size, world), "time": time.time(),
        })

    for epoch in range(start_epoch, cfg.epochs):
        epoch_start = time.perf_counter()
        model.train()
        sums = torch.zeros(3, dtype=torch.float64)  # [loss sum, correct, samples]
        window = _Window()
        batches = iter(hooks.train_batches(epoch, local_batch))
        for i in range(steps_per_epoch):
            t0 = time.perf_counter()
            batch = next(batches, None)
            if batch is None:
                raise RuntimeError(
                    f"rank {rank} ran out of training data after {i} of {steps_per_epoch} steps in epoch {epoch}"
                )
            data_wait = time.perf_counter() - t0
            x = to_model_input(batch["image"], mean, std)  # [B, C, H, W] float32 in [-1, 1]
            if cfg.augment:
                x = random_affine(x, augment_rng, cfg.max_rotate_deg, cfg.max_shift, cfg.max_scale)
            y = batch["label"]
            logits = model(x.contiguous(memory_format=memory_format))
            # DDP averages gradients over ranks; scaling the summed loss by world/global_batch
            # makes that average the exact mean over the global batch even when ranks hold
            # unequal shares (global batch not divisible by the number of workers).
            loss = criterion(logits, y) * (world / cfg.batch_size)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if ema is not None:
                ema.update_parameters(ckpt.unwrap(model))
            step += 1
            with torch.no_grad():
                batch_loss = loss.detach().double().item() * cfg.batch_size / world
                correct = (logits.argmax(1) == y).sum().item()
            sums += torch.tensor([batch_loss, correct, len(y)], dtype=torch.float64)
            window.add(len(y), batch_loss / len(y), data_wait, time.perf_counter() - t0)
            if rank == 0 and (step % cfg.log_every_steps == 0 or i == steps_per_epoch - 1):
                hooks.send(window.record(epoch, step, scheduler.get_last_lr()[0], world))
        _drain(batches)

        train_time = time.perf_counter() - epoch_start
        train_loss, train_acc, seen = _global_means(hooks, sums)
        evaluated = ema.module if ema is not None else ckpt.unwrap(model)
        _buffers_from_rank0(evaluated, hooks)
        val_loss, val_acc, val_n = evaluate(evaluated, hooks, manifest, criterion.label_smoothing, memory_format)
        metrics = {
            "epoch": epoch, "step": step, "train_loss": train_loss, "train_accuracy": train_acc,
            "val_loss": val_loss, "val_accuracy": val_acc, "val_samples": val_n,
            "train_samples": seen, "lr": scheduler.get_last_lr()[0], "world_size": world,
            "epoch_time_s": time.perf_counter() - epoch_start,
        }
        metrics["images_per_s"] = seen / train_time  # training only, validation excluded
        metrics["time"] = time.time()
        name = checkpoint_dir_name(epoch, hooks.damaged)
        with tempfile.TemporaryDirectory(prefix="imgtrain-ckpt-") as tmp:
            save_dir = None
            if rank == 0:  # rank 0 writes; every rank reports (report is a barrier)
                rng = {"torch": torch.get_rng_state(), "augment": _gather_rng(augment_rng, hooks)}
                train_state = {
                    ckpt.OPTIMIZER_KEY: optimizer.state_dict(), ckpt.SCHEDULER_KEY: scheduler.state_dict(),
                    ckpt.EPOCH_KEY: epoch, ckpt.STEP_KEY: step, ckpt.RNG_KEY: rng,
                }
                if ema is not None:
                    train_state[ckpt.TRAIN_WEIGHTS_KEY] = _cpu(ckpt.unwrap(model).state_dict())
                    train_state[ckpt.EMA_STEPS_KEY] = int(ema.n_averaged.item())
                meta = {
                    "model_args": args, "config": cfg.to_dict(), "metrics": metrics,
                    "data": manifest, "epoch": epoch, "step": step,
                    "total_steps": total_steps, "created": time.time(),
                }
                save_dir = str(ckpt.save(tmp, _cpu(evaluated.state_dict()), train_state, meta))
            else:
                _gather_rng(augment_rng, hooks)
            hooks.report(metrics, save_dir, name)
        if rank == 0:  # only once the checkpoint is stored: history never runs ahead of it
            hooks.send(dict(metrics, kind="epoch", checkpoint=name))


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


def _gather_rng(gen: torch.Generator, hooks: Hooks) -> list[torch.Tensor]:
    """Every rank's augmentation RNG state, gathered on all ranks (a collective: all call it)."""
    state = gen.get_state()  # uint8 [5056]
    buf = torch.zeros(hooks.world_size, state.numel(), dtype=torch.float64)
    buf[hooks.rank] = state.double()
    buf = hooks.all_reduce_sum(buf)
    return [row.to(torch.uint8) for row in buf]


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
        sched = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=cfg.lr, total_steps=saved["total_steps"], pct_start=cfg.warmup_fraction
        )
        sched.load_state_dict(saved)
        # Constructing the scheduler reset each group's LR to the cycle's start; restore it.
        for group, lr in zip(optimizer.param_groups, sched.get_last_lr()):
            group["lr"] = lr
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
    """Running figures between two progress records (rank 0)."""

    def __init__(self):
        self.samples, self.loss_sum, self.wait, self.busy, self.n = 0, 0.0, 0.0, 0.0, 0

    def add(self, samples: int, mean_loss: float, wait: float, total: float) -> None:
        self.samples += samples
        self.loss_sum += mean_loss
        self.wait += wait
        self.busy += total
        self.n += 1

    def record(self, epoch: int, step: int, lr: float, world: int) -> dict:
        rec = {
            "kind": "step", "epoch": epoch, "step": step, "loss": self.loss_sum / max(self.n, 1),
            "lr": lr, "images_per_s": self.samples * world / max(self.busy, 1e-9),
            "data_wait_fraction": self.wait / max(self.busy, 1e-9), "time": time.time(),
        }
        self.__init__()
        return rec


# ---------------------------------------------------------------- Ray Train workers


def train_loop_per_worker(config: dict) -> None:
    """Ray Train entry point. ``config`` is a plain dict: {"cfg", "manifest", "monitor"}."""
    import ray.train
    import ray.train.torch

    cfg = TrainConfig(**config["cfg"])
    manifest = config["manifest"]
    monitor = config.get("monitor")
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    threads = cfg.threads_per_worker or max(1, (os.cpu_count() or 1) // ctx.get_local_world_size())
    torch.set_num_threads(threads)
    device = ray.train.torch.get_device()

    def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
        if world == 1:
            return t
        import torch.distributed as dist

        moved = t.to(device)
        dist.all_reduce(moved)
        return moved.cpu()

    resume = config.get("resume") or {}

    @contextlib.contextmanager
    def restored_checkpoint():
        # Ray's latest checkpoint: on a retry the one this run last reported, on a re-run the
        # run's latest. If its files fail their sha256, the driver's newest good one instead
        # (None: no good one was left, and the driver said it starts from scratch).
        found = ray.train.get_checkpoint()
        if found is None:
            yield resume.get("fallback")
            return
        with found.as_directory() as d:
            try:
                ckpt.verify(d)
            except ckpt.CheckpointError:
                d = resume.get("fallback")
            yield d

    def report(metrics: dict, save_dir: str | None, name: str) -> None:
        checkpoint = ray.train.Checkpoint.from_directory(save_dir) if save_dir else None
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=name)

    def send(record: dict) -> None:
        if monitor is not None:
            monitor.push.remote(record)  # fire and forget: never a barrier

    if cfg.ingest == "torch":
        train_batches, val_batches = _torch_ingest(cfg, rank, world, device)
    else:
        train_batches, val_batches = _ray_data_ingest(cfg, rank, world, device)

    hooks = Hooks(
        rank=rank, world_size=world, device=device,
        prepare_model=ray.train.torch.prepare_model,
        train_batches=train_batches, val_batches=val_batches, all_reduce_sum=all_reduce_sum,
        restored_checkpoint=restored_checkpoint, report=report, send=send,
        damaged=resume.get("damaged") or [],
    )
    run_loop(cfg, manifest, hooks)


BATCH_DTYPES = {"id": torch.int64, "image": torch.uint8, "label": torch.int64}
SHUFFLE_BUFFER_ROWS = 20_000


def _ray_data_ingest(cfg: TrainConfig, rank: int, world: int, device):
    import ray.train

    train_shard = ray.train.get_dataset_shard("train")

    def train_batches(epoch: int, local_batch: int):
        # The prepared files are already in a seeded random order; the local shuffle buffer
        # reorders this rank's rows differently every epoch, reproducibly.
        return train_shard.iter_torch_batches(
            batch_size=local_batch, dtypes=BATCH_DTYPES, device=device, drop_last=True,
            local_shuffle_buffer_size=SHUFFLE_BUFFER_ROWS,
            local_shuffle_seed=cfg.seed * 100_003 + epoch * 1_009 + rank,
        )

    return train_batches, _in_memory_val_batches(cfg, device)


def _in_memory_val_batches(cfg: TrainConfig, device):
    """The test split read once into memory on each worker (evaluation keeps rows by id)."""
    from imgtrain.data.parquet import read_split

    ids, images, labels = map(torch.from_numpy, read_split(cfg.data, "test"))

    def val_batches():
        for start in range(0, len(ids), cfg.eval_batch_size):
            sl = slice(start, start + cfg.eval_batch_size)
            yield {"id": ids[sl], "image": images[sl].to(device), "label": labels[sl].to(device)}

    return val_batches


def _torch_ingest(cfg: TrainConfig, rank: int, world: int, device):
    """DataLoader over the split held in memory, sharded by a seeded DistributedSampler."""
    import ray.train.torch
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from imgtrain.data.parquet import read_split

    train = TensorDataset(*map(torch.from_numpy, read_split(cfg.data, "train")))
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed)

    def train_batches(epoch: int, local_batch: int):
        sampler.set_epoch(epoch)  # a different, reproducible order every epoch
        loader = DataLoader(train, batch_size=local_batch, sampler=sampler, drop_last=True)
        for ids, images, labels in ray.train.torch.prepare_data_loader(loader, add_dist_sampler=False):
            yield {"id": ids, "image": images, "label": labels}

    return train_batches, _in_memory_val_batches(cfg, device)
