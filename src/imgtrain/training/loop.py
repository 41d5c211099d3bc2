"""The training loop, read top to bottom: ``run_loop`` = ``setup``, then per epoch
``train_epoch`` (``train_step`` for each batch) and ``end_epoch`` (validate, checkpoint, record).

It runs on every Ray Train worker and, unchanged, in one plain PyTorch process
(``--backend local``). What differs between the two is gathered in ``Backend``: how batches
arrive, the collectives between ranks, where checkpoints go and where records are sent.

Resuming is exact. A checkpoint (every epoch, and every ``checkpoint_every_steps`` steps)
holds the model, optimizer, scheduler, moving average, step counters and the epoch's partial
sums; the data order and the augmentation are functions of (seed, epoch, step) alone
(``data/order.py``). A run restarted from step S therefore trains on exactly the rows and
transformations the uninterrupted run would have used after S, at any world size.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ContextManager, Iterable

import torch
import torch.nn as nn

from imgtrain import checkpoint as ckpt
from imgtrain import finetune
from imgtrain.config import TrainConfig, per_worker_batch_sizes
from imgtrain.config import steps_per_epoch as epoch_steps
from imgtrain.data.format import eval_split
from imgtrain.data.order import epoch_augment_draws
from imgtrain.data.tensors import affine_matrices, apply_affine, to_model_input
from imgtrain.errors import ImgtrainError
from imgtrain.models.zoo import build_from_args, model_args
from imgtrain.runs import versions
from imgtrain.training import faults, fsdp
from imgtrain.training.accounting import EpochTiming, Ledger, StepWindow
from imgtrain.training.health import Progress
from imgtrain.training.recipe import (
    WeightAverage,
    freeze,
    one_cycle,
    optimizer_for,
    set_batchnorm_momentum,
    weight_average,
)

Batch = dict  # {"id": int64 [B], "image": uint8 [B, H, W, C], "label": int64 [B]} on the device


@dataclass
class Backend:
    """What the loop needs from where it runs (a Ray Train worker, or this process)."""

    rank: int
    world_size: int
    device: torch.device
    prepare_model: Callable[[nn.Module], nn.Module]  # DDP or FSDP on Ray; the device alone locally
    # (epoch, first step) -> this rank's batches for the steps of the epoch from that one on
    train_batches: Callable[[int, int], Iterable[Batch]]
    val_batches: Callable[[], Iterable[Batch]]  # this rank's rows of the validation split
    # Collectives every rank calls together (identities with one rank); CPU tensors in and out.
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor]
    broadcast: Callable[[torch.Tensor], torch.Tensor]  # rank 0's tensor, on every rank
    all_gather: Callable[[torch.Tensor], torch.Tensor]  # [*shape] -> [world, *shape], by rank
    restored_checkpoint: Callable[[], ContextManager[str | None]]  # directory of the checkpoint to resume
    report: Callable[[dict, str | None, str], None]  # (metrics, checkpoint dir or None, dir name)
    send: Callable[[dict], None]  # progress / history record to the driver (fire and forget)
    # Names of damaged checkpoints left in the run directory: new ones must not reuse them, or
    # Ray Train's retention, deleting the damaged one by path, would delete its replacement.
    damaged: list[str] = field(default_factory=list)
    progress: Progress = field(default_factory=Progress)
    run_dir: Path | None = None  # for the sample ledger and injected faults
    fault: faults.Fault | None = None
    augment_in_step: bool = True  # False: the batches arrive augmented (a streamed data set)
    # this rank's share of the training images that calibrate BatchNorm, preprocessed as for
    # evaluation (--bn-calibration); None: no calibration
    calibration_batches: Callable[[], Iterable[Batch]] | None = None


def single_process_collectives() -> dict:
    """The collectives of a world of one: nothing to exchange."""
    return {"all_reduce_sum": lambda t: t, "broadcast": lambda t: t, "all_gather": lambda t: t.unsqueeze(0)}


@dataclass
class Resumed:
    """Where training stands: restored from a checkpoint, or fresh."""

    epoch: int = 0  # the epoch to train next (or the one a step checkpoint stopped inside)
    epoch_step: int = 0  # steps of that epoch already taken
    step: int = 0  # optimizer steps taken over the whole run
    sums: torch.Tensor | None = None  # the epoch's global [loss sum, correct, samples] so far
    elapsed_s: float = 0.0  # training time already spent in that epoch
    schedule: dict | None = None
    history: list[dict] = field(default_factory=list)  # the epoch records before this point
    restored_from: str | None = None  # the checkpoint's name


@dataclass
class Run:
    """Everything one rank trains with, built by ``setup``; ``step`` counts optimizer steps."""

    cfg: TrainConfig
    manifest: dict
    backend: Backend
    model: nn.Module  # DDP-wrapped or FSDP-sharded on Ray
    forward: Callable  # the model, or its compiled graph
    optimizer: torch.optim.Optimizer
    scheduler: object
    ema: WeightAverage | None  # None without --ema-decay
    criterion: nn.Module
    autocast: object
    memory_format: torch.memory_format
    steps_per_epoch: int
    total_steps: int
    step: int
    history: list[dict]  # the epoch records so far: every checkpoint carries them
    ledger: Ledger | None

    @property
    def evaluated(self) -> nn.Module:
        """What validation sees and model.pt holds: the moving average, or the weights
        (sharded with FSDP: ``evaluated_model`` gathers them into a plain model)."""
        return self.ema.module if self.ema is not None else ckpt.unwrap(self.model)

    @property
    def sharded(self) -> bool:
        return self.cfg.strategy == "fsdp"


def phase_record(name: str) -> dict:
    """What a rank's start-up waits for now, for the driver's display (rank 0 sends them)."""
    return {"kind": "phase", "phase": name, "time": time.time()}


def run_loop(cfg: TrainConfig, manifest: dict, backend: Backend) -> None:
    if backend.rank == 0:
        backend.send(phase_record("building the model"))
    run, resumed = setup(cfg, manifest, backend)
    if backend.rank == 0:
        # The driver reconciles metrics.jsonl with ``history``: an epoch whose record was lost
        # (the driver killed between the checkpoint and the record) is recovered from it.
        backend.send({
            "kind": "start", "start_epoch": resumed.epoch, "epoch_step": resumed.epoch_step, "step": run.step,
            "epochs": cfg.epochs, "steps_per_epoch": run.steps_per_epoch, "total_steps": run.total_steps,
            "world_size": backend.world_size,
            "local_batch_sizes": per_worker_batch_sizes(cfg.batch_size, backend.world_size),
            "history": run.history, "restored_from": resumed.restored_from, "time": time.time(),
        })
        # until the first step record; torch.compile compiles at the first step: a compiled
        # run's longest start-up wait
        n = min(cfg.log_every_steps - run.step % cfg.log_every_steps, run.steps_per_epoch - resumed.epoch_step)
        backend.send(phase_record("compiling the model" if cfg.compile else f"first {n} step{'s' * (n > 1)}"))
    for epoch in range(resumed.epoch, cfg.epochs):
        partial = resumed if epoch == resumed.epoch and resumed.epoch_step > 0 else None
        sums, timing, train_s = train_epoch(run, epoch, partial)
        end_epoch(run, epoch, sums, timing, train_s)
    backend.progress.enter("done", run.step)


def setup(cfg: TrainConfig, manifest: dict, backend: Backend) -> tuple[Run, Resumed]:
    """The model, optimizer, schedule and moving average, restored from the checkpoint the
    backend hands over (verified by it: a damaged checkpoint is never handed over)."""
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    if cfg.precision == "bf16" and backend.device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ImgtrainError(f"--precision bf16: {torch.cuda.get_device_name(backend.device)} has no bfloat16; use fp32")
    # same initial weights on every rank (DDP also broadcasts them; FSDP takes each rank's
    # shard of its own copy, so this is what makes them one model)
    torch.manual_seed(cfg.seed)
    memory_format = torch.channels_last if cfg.channels_last else torch.contiguous_format
    with backend.restored_checkpoint() as restore_dir:
        net = build_from_args(model_args(manifest, cfg.model, cfg.stem))
        if not restore_dir and (weights := finetune.initial_weights(cfg)):  # the driver has checked the file
            finetune.initialise(net, weights, cfg.model)
        set_batchnorm_momentum(net, cfg.bn_momentum)
        model = backend.prepare_model(net.to(memory_format=memory_format))
        optimizer = optimizer_for(model, cfg)  # after sharding: it holds this rank's shards
        # FSDP: the average lives in a second model sharded the same way (its values come
        # from the first update, or the checkpoint)
        average_in = None
        if cfg.strategy == "fsdp" and cfg.ema_decay:
            average_in = backend.prepare_model(_plain_model(cfg, manifest).to(memory_format=memory_format))
        ema = weight_average(ckpt.unwrap(model), cfg.ema_decay, average_in)
        resumed = restore(restore_dir, model, optimizer, ema, backend.device) if restore_dir else Resumed()
    n_train = manifest["splits"]["train"]["num_samples"]
    steps_per_epoch = max(1, epoch_steps(n_train, cfg.batch_size, cfg.limit_train_batches))
    total_steps = cfg.epochs * steps_per_epoch
    run = Run(
        cfg, manifest, backend, model, forward=torch.compile(model) if cfg.compile else model,  # same parameters
        optimizer=optimizer, scheduler=one_cycle(optimizer, cfg, total_steps - resumed.step, resumed.schedule),
        ema=ema, criterion=nn.CrossEntropyLoss(reduction="sum", label_smoothing=cfg.label_smoothing),
        autocast=torch.autocast(backend.device.type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16"),
        memory_format=memory_format, steps_per_epoch=steps_per_epoch, total_steps=total_steps,
        step=resumed.step, history=list(resumed.history), ledger=None,
    )
    if cfg.ledger and backend.run_dir:
        run.ledger = Ledger(backend, run.step)
    return run, resumed


def train_epoch(run: Run, epoch: int, partial: Resumed | None) -> tuple[torch.Tensor, EpochTiming, float]:
    """Train the epoch's steps (from where a step checkpoint stopped, when ``partial``); returns
    this rank's [loss sum, correct, samples], its timing and the training seconds."""
    cfg, backend = run.cfg, run.backend
    first_step = min(partial.epoch_step, run.steps_per_epoch) if partial else 0
    # [loss sum, correct, samples], kept on the device: reading them every step would make
    # the host wait for the GPU at every step
    sums = torch.zeros(3, dtype=torch.float64, device=backend.device)
    if partial and backend.rank == 0:
        sums += partial.sums.to(backend.device)  # what the ranks summed before the checkpoint, counted once
    elapsed_before, started = (partial.elapsed_s if partial else 0.0), time.perf_counter()
    run.model.train()
    window, timing = StepWindow(), EpochTiming()
    batches = iter(backend.train_batches(epoch, first_step))
    affines = epoch_affines(run, run.step - first_step) if cfg.augment and backend.augment_in_step else None
    for i in range(first_step, run.steps_per_epoch):
        t0 = time.perf_counter()
        backend.progress.enter("data", run.step)
        batch = next(batches, None)
        if batch is None:
            raise RuntimeError(f"rank {backend.rank} ran out of training data after {i} of "
                               f"{run.steps_per_epoch} steps in epoch {epoch}")
        data_wait = time.perf_counter() - t0
        backend.progress.enter("compute")
        faults.maybe_fire(backend.fault, backend.rank, run.step, backend.run_dir, "step")
        if run.ledger is not None:
            run.ledger.write(epoch, i, run.step, batch["id"])
        loss, correct = train_step(run, batch, None if affines is None else affines[i])
        sums[0] += loss
        sums[1] += correct
        sums[2] += len(batch["label"])
        step_time = time.perf_counter() - t0
        window.add(len(batch["label"]), loss / len(batch["label"]), correct, data_wait, step_time)
        timing.add(data_wait, step_time)
        if run.step % cfg.log_every_steps == 0 or i == run.steps_per_epoch - 1:
            # Every rank reports its own step and data-wait times, rank 0 also the training
            # figures; fire and forget, so no rank ever waits for the driver.
            if backend.rank == 0:
                backend.send(window.step_record(epoch, run.step, run.scheduler.get_last_lr()[0], backend.world_size))
            backend.send(window.rank_record(backend.rank, epoch, run.step))
            window.reset()
        every = cfg.checkpoint_every_steps
        if every and run.step % every == 0 and i + 1 < run.steps_per_epoch:
            elapsed = elapsed_before + time.perf_counter() - started
            sums = checkpoint_inside_epoch(run, epoch, i + 1, sums, elapsed)
    close = getattr(batches, "close", None)
    if close:
        close()  # stop the epoch's prefetching before validation starts
    return sums, timing, elapsed_before + time.perf_counter() - started


def epoch_affines(run: Run, epoch_start_step: int) -> torch.Tensor:
    """The digits augmentation's matrices of every step of the epoch [steps, local batch, 2, 3],
    on the device: drawn, turned into matrices and copied there once, at the epoch's start.
    Per step, the CPU's sin/cos woke every intra-op thread (24 ms when they slept, issue 19) and
    the copy made the host wait for the GPU. Always the whole epoch, also when resuming inside
    it: every step's numbers come from the same computation, so a resumed run stays bit-exact."""
    cfg, backend = run.cfg, run.backend
    draws = epoch_augment_draws(cfg.seed, epoch_start_step, run.steps_per_epoch, cfg.batch_size,
                                backend.world_size, backend.rank)
    theta = affine_matrices(draws.flatten(0, 1), cfg.max_rotate_deg, cfg.max_shift, cfg.max_scale)
    return theta.view(run.steps_per_epoch, -1, 2, 3).to(backend.device)


def train_step(run: Run, batch: Batch, affine: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step on this rank's share of the global batch (``affine``: its augmentation's
    matrices); returns this rank's summed loss (float64) and number of correct predictions, both
    still on the device."""
    cfg, backend, world = run.cfg, run.backend, run.backend.world_size
    x = to_model_input(batch["image"], run.manifest["normalize"]["mean"], run.manifest["normalize"]["std"])
    if affine is not None:  # x: [B, C, H, W] float32, normalised
        x = apply_affine(x, affine)
    y = batch["label"]
    backend.progress.enter("forward")
    with run.autocast:
        logits = run.forward(x.contiguous(memory_format=run.memory_format))
        # DDP averages gradients over ranks; scaling the summed loss by world/global_batch
        # makes that average the exact mean over the global batch even when ranks hold
        # unequal shares (global batch not divisible by the number of workers).
        loss = run.criterion(logits, y) * (world / cfg.batch_size)
    run.optimizer.zero_grad(set_to_none=True)
    backend.progress.enter("backward")
    loss.backward()
    backend.progress.enter("optimizer")
    freeze(run.optimizer, run.step < cfg.freeze_backbone * run.steps_per_epoch)
    run.optimizer.step()
    run.scheduler.step()
    if run.ema is not None:
        run.ema.update()
    run.step += 1
    with torch.no_grad():
        summed = loss.detach().double() * cfg.batch_size / world  # this rank's summed loss
        return summed, (logits.argmax(1) == y).sum()


def checkpoint_inside_epoch(run: Run, epoch: int, steps_done: int, sums: torch.Tensor, elapsed: float) -> torch.Tensor:
    """A step checkpoint: the epoch's sums so far over all ranks go into it; returns the sums
    to go on with (rank 0 holds the total from here on, so it is counted once)."""
    backend = run.backend
    backend.progress.enter("sync")
    total = backend.all_reduce_sum(sums)
    progress = {"steps": steps_done, "sums": total.cpu(), "elapsed_s": elapsed}
    # Not evaluated: -1 ranks it below every evaluated checkpoint in Ray's retention
    # (a finite number: Ray's saved state turns -inf into null and then fails on it).
    metrics = {"epoch": epoch, "step": run.step, "val_accuracy": -1.0, "time": time.time()}
    name = ckpt.dir_name(epoch, backend.damaged, run.step)
    save(run, epoch, metrics, progress, name)
    if backend.rank == 0:
        backend.send({"kind": "checkpoint", "epoch": epoch, "step": run.step, "checkpoint": name, "time": time.time()})
    return total.to(backend.device) if backend.rank == 0 else torch.zeros_like(sums)


def end_epoch(run: Run, epoch: int, sums: torch.Tensor, timing: EpochTiming, train_s: float) -> None:
    """Validate, checkpoint, and (rank 0, once the checkpoint is stored) send the epoch record."""
    backend = run.backend
    started = time.perf_counter()
    backend.progress.enter("sync", run.step)
    train_loss, train_acc, seen = _global_means(backend, sums)
    rank_timing = timing.gather(backend)
    evaluated = evaluated_model(run)
    backend.progress.enter("eval")
    if backend.calibration_batches is not None:
        calibrate_batchnorm(evaluated, backend, run.manifest, run.memory_format)
    faults.maybe_fire(backend.fault, backend.rank, run.step, backend.run_dir, "validating")
    val_loss, val_acc, val_n = evaluate(evaluated, backend, run.manifest, run.cfg.label_smoothing,
                                        run.memory_format)
    metrics = {
        "epoch": epoch, "step": run.step, "train_loss": train_loss, "train_accuracy": train_acc,
        "val_loss": val_loss, "val_accuracy": val_acc, "val_samples": val_n,
        "val_split": eval_split(run.manifest),
        "train_samples": seen, "lr": run.scheduler.get_last_lr()[0], "world_size": backend.world_size,
        "epoch_time_s": train_s + time.perf_counter() - started,  # training + validation
        "images_per_s": seen / max(train_s, 1e-9),  # training only, validation excluded
        **rank_timing, "time": time.time(),
    }
    name = ckpt.dir_name(epoch, backend.damaged)
    run.history.append(dict(metrics, kind="epoch", checkpoint=name))
    save(run, epoch, metrics, None, name, evaluated)
    del evaluated  # with FSDP a full copy of the weights: not kept through the next epoch
    if backend.rank == 0:  # only once the checkpoint is stored: history never runs ahead of it
        backend.send(run.history[-1])


def save(run: Run, epoch: int, metrics: dict, epoch_progress: dict | None, name: str,
         evaluated: nn.Module | None = None) -> None:
    """Rank 0 writes the checkpoint ``name``; every rank reports it (report is a barrier).
    ``epoch_progress``: how far into ``epoch`` a step checkpoint was taken; ``evaluated``: the
    model validation just used, when it did.

    With FSDP every rank also writes its shards of the training state into ``sharded/`` of its
    own directory; Ray Train copies every rank's directory into the same checkpoint, and rank
    0's meta.json records the sha256 of all of their files."""
    backend, in_epoch = run.backend, epoch_progress is not None
    with tempfile.TemporaryDirectory(prefix="imgtrain-ckpt-") as tmp:
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
            meta = {
                "model_args": model_args(run.manifest, run.cfg.model, run.cfg.stem), "config": run.cfg.to_dict(),
                "metrics": metrics, "data": run.manifest, "epoch": train_state[ckpt.EPOCH_KEY], "step": run.step,
                "total_steps": run.total_steps, "created": time.time(), ckpt.HISTORY_KEY: run.history,
                **versions(),
            }
            if in_epoch:
                meta["in_epoch"] = {"epoch": epoch, "steps": epoch_progress["steps"]}
            model_state = _cpu((run.evaluated if evaluated is None else evaluated).state_dict())
            save_dir = str(ckpt.save(tmp, model_state, train_state, meta, shard_hashes))
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
        saved = ckpt.load_model_state(directory, device)
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
        history=ckpt.history(meta), restored_from=Path(directory).name,
    )


# ---------------------------------------------------------------- validation


def evaluate(
    model: nn.Module, backend: Backend, manifest: dict, label_smoothing: float = 0.0,
    memory_format: torch.memory_format = torch.contiguous_format,
):
    """Loss and accuracy on the validation split, each row counted once across all ranks: each
    rank gets its own rows (``ingest.py``) and the sums are all-reduced. The plain (unwrapped)
    model is used, so no rank waits on a DDP collective for a forward pass another rank does
    not make.
    """
    mean, std = manifest["normalize"]["mean"], manifest["normalize"]["std"]
    criterion = nn.CrossEntropyLoss(reduction="sum", label_smoothing=label_smoothing)
    sums = torch.zeros(3, dtype=torch.float64)
    was_training = model.training
    model.eval()
    with torch.inference_mode():
        for batch in backend.val_batches():
            if not len(batch["label"]):
                continue
            x = to_model_input(batch["image"], mean, std)
            y = batch["label"]
            logits = model(x.contiguous(memory_format=memory_format))
            sums += torch.tensor(
                [criterion(logits, y).item(), (logits.argmax(1) == y).sum().item(), len(y)],
                dtype=torch.float64,
            )
    model.train(was_training)
    loss, acc, n = _global_means(backend, sums)
    return loss, acc, n


def calibrate_batchnorm(model: nn.Module, backend: Backend, manifest: dict,
                        memory_format: torch.memory_format = torch.contiguous_format) -> None:
    """Recompute ``model``'s BatchNorm statistics from the calibration images (training images
    preprocessed as for evaluation), in place: what validation and model.pt then use. A
    collective: all ranks call it, and all end with the average over every rank's images.

    Training gathers running statistics from augmented images (rotated, zoomed, cropped,
    resampled), which evaluation never sees; on the embedded digits the recomputed ones gained
    0.2-0.4 points of test accuracy on average (docs/NOTES.md). One pass for all layers, as
    torch's ``swa_utils.update_bn``: each BatchNorm normalises with its batch's statistics while
    it gathers them; the rest of the model runs as in evaluation (no dropout). In place is safe:
    the statistics are only used in evaluation, recomputed from scratch each time, and a resumed
    run loads the same ones from model.pt."""
    layers = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    if not layers:
        return
    gathered = [(m.running_mean.clone(), m.running_var.clone(), m.momentum) for m in layers]
    images, batches = _statistics_of_calibration_images(model, layers, backend, manifest, memory_format)
    # every rank's averages weighted by its images (a rank may have had none)
    stats = [t for m in layers for t in (m.running_mean, m.running_var)]
    total = backend.all_reduce_sum(torch.cat([t.detach().double().flatten().cpu() * images for t in stats]
                                             + [torch.tensor([images, batches], dtype=torch.float64)]))
    images, batches = total[-2].item(), int(total[-1].item())
    with torch.no_grad():
        for m, (mean, var, momentum) in zip(layers, gathered):
            m.momentum = momentum
            if not images:  # no calibration image on any rank: keep what training gathered
                m.running_mean.copy_(mean)
                m.running_var.copy_(var)
            else:
                m.num_batches_tracked.fill_(batches)
        offset = 0
        for t in stats if images else ():
            t.copy_((total[offset:offset + t.numel()] / images).view_as(t))
            offset += t.numel()


def _statistics_of_calibration_images(model: nn.Module, layers: list, backend: Backend, manifest: dict,
                                      memory_format: torch.memory_format) -> tuple[int, int]:
    """This rank's pass over its calibration images: each layer's statistics become the average
    of its batches' weighted by their images. Returns (images, batches)."""
    mean, std = manifest["normalize"]["mean"], manifest["normalize"]["std"]
    was_training = model.training
    model.eval()
    for m in layers:
        m.reset_running_stats()
        m.train()
    images = batches = 0
    with torch.no_grad():
        for batch in backend.calibration_batches():
            n = len(batch["label"])
            if n < 2:  # one image has no batch variance
                continue
            for m in layers:  # running = (images x running + n x batch) / (images + n)
                m.momentum = n / (images + n)
            model(to_model_input(batch["image"], mean, std).contiguous(memory_format=memory_format))
            images, batches = images + n, batches + 1
    model.train(was_training)
    return images, batches


def _global_means(backend: Backend, sums: torch.Tensor) -> tuple[float, float, int]:
    total = backend.all_reduce_sum(sums.clone())
    n = int(total[2].item())
    return total[0].item() / max(n, 1), total[1].item() / max(n, 1), n


def evaluated_model(run: Run) -> nn.Module:
    """The plain model that validation runs and model.pt holds (the moving average, or the
    weights), with rank 0's BatchNorm statistics on every rank. A collective: all ranks call it.

    With FSDP a full, unsharded copy gathered from the shards (for the time of validation and
    saving). FSDP2 leaves buffers alone, so each rank's running statistics follow its own
    batches; DDP broadcasts rank 0's before every forward pass, which leaves rank 0's own as
    they were. Taking rank 0's wherever they are seen (here, for validation and every saved
    file) therefore gives what DDP gives, with no collective per step. The trained model's are
    taken too: DCP saves one copy of a tensor every rank holds, not necessarily rank 0's."""
    if not run.sharded:
        _buffers_from_rank0(run.evaluated, run.backend)
        return run.evaluated
    for module in (run.model, run.ema.module) if run.ema is not None else (run.model,):
        _buffers_from_rank0(module, run.backend)
    plain = _plain_model(run.cfg, run.manifest)
    plain.load_state_dict(fsdp.full_state(run.evaluated))
    return plain.to(run.backend.device, memory_format=run.memory_format)


def _plain_model(cfg: TrainConfig, manifest: dict) -> nn.Module:
    """The run's architecture with throwaway weights (they are overwritten), built without
    touching the global RNG that dropout and the checkpoint's RNG state use."""
    with torch.random.fork_rng(devices=[]):
        return build_from_args(model_args(manifest, cfg.model, cfg.stem))


def _buffers_from_rank0(model: nn.Module, backend: Backend) -> None:
    """Give every rank rank 0's BatchNorm statistics (a collective: all ranks call it).

    Parameters are identical on all ranks, but each rank's last forward pass updated its
    running statistics with its own batch. Validation and the saved model.pt must use the
    same statistics, or a later evaluation of the checkpoint would not reproduce the
    recorded accuracy.
    """
    if backend.world_size == 1:
        return
    buffers = [b for b in model.buffers() if b.is_floating_point()]
    flat = backend.broadcast(torch.cat([b.detach().flatten().cpu() for b in buffers]))
    offset = 0
    with torch.no_grad():
        for b in buffers:
            b.copy_(flat[offset : offset + b.numel()].view_as(b))
            offset += b.numel()


def _cpu(state: dict) -> dict:
    """A state_dict on the CPU, so that a checkpoint written on a GPU loads anywhere."""
    return {k: v.detach().cpu() for k, v in state.items()}
