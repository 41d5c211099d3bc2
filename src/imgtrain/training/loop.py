"""The training loop, read top to bottom: ``run_loop`` = ``setup``, then per epoch
``train_epoch`` (``train_step`` for each batch) and ``end_epoch`` (validate, checkpoint, record).

It runs on every Ray Train worker and, unchanged, in one plain PyTorch process
(``--backend local``). What differs between the two is gathered in ``Backend`` (backend.py): how
batches arrive, the collectives between ranks, where checkpoints go and where records are sent.
Saving and restoring checkpoints is checkpointing.py's, validation evaluation.py's, BatchNorm
calibration calibration.py's.

Resuming is exact. A checkpoint (every epoch, and every ``checkpoint_every_steps`` steps)
holds the model, optimizer, scheduler, moving average, step counters and the epoch's partial
sums; the data order and the augmentation are functions of (seed, epoch, step) alone
(``data/order.py``). A run restarted from step S therefore trains on exactly the rows and
transformations the uninterrupted run would have used after S, at any world size.
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn

from imgtrain import finetune
from imgtrain.checkpoint_policy import POLICY
from imgtrain.config import TrainConfig, per_worker_batch_sizes
from imgtrain.config import steps_per_epoch as epoch_steps
from imgtrain.data.format import eval_split
from imgtrain.data.order import epoch_augment_draws
from imgtrain.data.tensors import affine_matrices, apply_affine, to_model_input
from imgtrain.errors import ImgtrainError
from imgtrain.models.zoo import build_from_args, model_args
from imgtrain.storage import checkpoint as ckpt
from imgtrain.training import distill, faults, mechanics, mixing, multilabel
from imgtrain.training.accounting import EpochTiming, Ledger, StepWindow
from imgtrain.training.averaging import save_average
from imgtrain.training.weight_window import WeightWindow
from imgtrain.training.backend import Backend, Batch
from imgtrain.training.calibration import calibrate_batchnorm
from imgtrain.training.checkpointing import checkpoint_inside_epoch, restore, save
from imgtrain.training.evaluation import (
    THRESHOLDS,
    evaluate,
    evaluated_model,
    global_means,
    plain_model,
)
from imgtrain.training.recipe import (
    freeze,
    optimizer_for,
    schedule_for,
    set_batchnorm_momentum,
    weight_average,
)
from imgtrain.training.run_state import Resumed, Run


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
    policy = POLICY.for_metric(cfg.select_metric)
    run.window = WeightWindow.restored(cfg, resumed.window, backend.rank)
    averaged = resumed.averaged  # restored from the average checkpoint: made already
    for epoch in range(resumed.epoch, cfg.epochs):
        # from the epoch records alone (the same on every rank: the metrics are all-reduced), so
        # a resumed run stops where the uninterrupted one did, with no collective
        if policy.stopped_early(run.history, cfg.early_stop, cfg.early_stop_min_delta):
            break
        partial = resumed if epoch == resumed.epoch and resumed.epoch_step > 0 else None
        sums, timing, train_s = train_epoch(run, epoch, partial)
        end_epoch(run, epoch, sums, timing, train_s)
        averaged = False
    if cfg.average_last and not averaged and run.history:
        save_average(run)
    backend.progress.enter("done", run.step)


def setup(cfg: TrainConfig, manifest: dict, backend: Backend) -> tuple[Run, Resumed]:
    """The model, optimizer, schedule and moving average, restored from the checkpoint the
    backend hands over (verified by it: a damaged checkpoint is never handed over)."""
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    if cfg.precision == "bf16" and backend.device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ImgtrainError(f"--precision bf16: {torch.cuda.get_device_name(backend.device)} has no bfloat16; "
                            "use fp16 or fp32")
    if cfg.accumulate > cfg.batch_size // backend.world_size:  # config.validate checks the largest world size
        raise ImgtrainError(f"--accumulate {cfg.accumulate}: a worker's share of --batch-size {cfg.batch_size} over "
                            f"{backend.world_size} workers is {cfg.batch_size // backend.world_size} samples; use at most that")
    # same initial weights on every rank (DDP also broadcasts them; FSDP takes each rank's
    # shard of its own copy, so this is what makes them one model)
    torch.manual_seed(cfg.seed)
    memory_format = torch.channels_last if cfg.channels_last else torch.contiguous_format
    with backend.restored_checkpoint() as restore_dir:
        try:  # the driver has built it with these options: a refusal here is unexpected
            net = build_from_args(model_args(manifest, cfg.model, cfg.stem), cfg.drop_path, cfg.grad_checkpointing)
        except ValueError as e:
            raise ImgtrainError(f"--model {cfg.model}: {e}") from None
        if not restore_dir and (weights := finetune.initial_weights(cfg)):  # the driver has checked the file
            finetune.initialise(net, weights, cfg.model)
        set_batchnorm_momentum(net, cfg.bn_momentum)
        model = backend.prepare_model(net.to(memory_format=memory_format))
        optimizer = optimizer_for(model, cfg)  # after sharding: it holds this rank's shards
        # FSDP: the average lives in a second model sharded the same way (its values come
        # from the first update, or the checkpoint)
        average_in = None
        if cfg.strategy == "fsdp" and cfg.ema_decay:
            average_in = backend.prepare_model(plain_model(cfg, manifest).to(memory_format=memory_format))
        ema = weight_average(ckpt.unwrap(model), cfg.ema_decay, average_in)
        resumed = restore(restore_dir, model, optimizer, ema, backend.device) if restore_dir else Resumed()
    n_train = manifest["splits"]["train"]["num_samples"]
    steps_per_epoch = max(1, epoch_steps(n_train, cfg.batch_size, cfg.limit_train_batches))
    total_steps = cfg.epochs * steps_per_epoch
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
    run = Run(
        cfg, manifest, backend, model, forward=torch.compile(model) if cfg.compile else model,  # same parameters
        optimizer=optimizer,
        scheduler=schedule_for(optimizer, cfg, resumed.step, total_steps, steps_per_epoch, resumed.schedule),
        ema=ema, criterion=criterion_for(cfg, manifest, backend.device),
        autocast=torch.autocast(backend.device.type, dtype=half or torch.bfloat16, enabled=half is not None),
        memory_format=memory_format, steps_per_epoch=steps_per_epoch, total_steps=total_steps,
        step=resumed.step, history=list(resumed.history), ledger=None,
        scaler=mechanics.grad_scaler(cfg, backend.device, resumed.grad_scaler),
        distill=distill.Signal(cfg, manifest, backend.device, backend.teacher_logits) if cfg.teacher else None,
    )
    if cfg.ledger and backend.run_dir:
        run.ledger = Ledger(backend, run.step)
    return run, resumed


def criterion_for(cfg: TrainConfig, manifest: dict, device) -> nn.Module:
    """The training loss, summed over the rows: the cross-entropy, or for a multi-label set one
    sigmoid loss per label (``multilabel.MultiLabelLoss``)."""
    if multilabel.is_multi_label(manifest):
        return multilabel.criterion_for(cfg, manifest, device)
    return nn.CrossEntropyLoss(weight=class_weights(cfg, manifest, device), reduction="sum",
                               label_smoothing=cfg.label_smoothing)


def class_weights(cfg: TrainConfig, manifest: dict, device) -> torch.Tensor | None:
    """``--class-weights auto``: n / (classes x n_class) per class of the training split (a class
    without training images gets 0: it never appears in a batch). The summed weighted loss is
    divided by the batch size as an unweighted one is, not by the batch's sum of weights: that
    would take a collective per step to stay exact across ranks, and the weights average 1 over
    the split anyway."""
    if cfg.class_weights != "auto":
        return None
    counts = torch.tensor(manifest["class_counts"]["train"], dtype=torch.float64)
    present = int((counts > 0).sum())
    weights = torch.where(counts > 0, counts.sum() / (present * counts.clamp(min=1)), torch.zeros_like(counts))
    return weights.float().to(device)


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
        loss, correct, grad_norm = train_step(run, batch, None if affines is None else affines[i])
        sums[0] += loss
        sums[1] += correct
        sums[2] += len(batch["label"])
        step_time = time.perf_counter() - t0
        window.add(len(batch["label"]), loss / len(batch["label"]), correct, data_wait, step_time, grad_norm)
        timing.add(data_wait, step_time)
        if run.step % cfg.log_every_steps == 0 or i == run.steps_per_epoch - 1:
            # Every rank reports its own step and data-wait times, rank 0 also the training
            # figures; fire and forget, so no rank ever waits for the driver.
            if backend.rank == 0:
                backend.send(window.step_record(epoch, run.step, run.scheduler.get_last_lr()[0], backend.world_size,
                                                run.scaler))
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


def train_step(run: Run, batch: Batch, affine: torch.Tensor | None = None):
    """One optimizer step on this rank's share of the global batch (``affine``: its augmentation's
    matrices); returns this rank's summed loss (float64), its number of correct predictions and
    the gradient norm before clipping (None without ``--clip-grad-norm``), all still on the device.

    With ``--accumulate N`` the share goes through forward and backward in N pieces whose
    gradients add up; ranks exchange gradients only in the last piece's backward."""
    cfg, backend, world = run.cfg, run.backend, run.backend.world_size
    x = to_model_input(batch["image"], run.manifest["normalize"]["mean"], run.manifest["normalize"]["std"])
    if affine is not None:  # x: [B, C, H, W] float32, normalised
        x = apply_affine(x, affine)
    y = target = counted = batch["label"]
    if (mix := mixing.draw(cfg, run.step, run.step // run.steps_per_epoch, x.shape[2], x.shape[3])) is not None:
        x, target, counted = mixing.mixed(x, y, mix, run.manifest["num_classes"], backend, cfg.batch_size)
    if cfg.drop_path is not None:
        mechanics.seed_step_randomness(cfg.seed, run.step, backend.rank)
    # the teacher's logits of these rows (cached) or of these very images (online), cut as they are
    taught = (run.distill.logits(batch, x),) if run.distill is not None else ()
    run.optimizer.zero_grad(set_to_none=True)
    summed = correct = None
    parts = mechanics.pieces(cfg.accumulate, x, target, counted, *taught)  # mixed as a whole, then cut
    for k, (xk, target_k, counted_k, *teacher_k) in enumerate(parts):
        with mechanics.gradient_sync(run.model, sync=k == len(parts) - 1):
            backend.progress.enter("forward")
            with run.autocast:
                logits = run.forward(xk.contiguous(memory_format=run.memory_format))
                # DDP averages gradients over ranks; scaling the summed loss by world/global_batch
                # makes that average the exact mean over the global batch even when ranks hold
                # unequal shares (global batch not divisible by the number of workers). Each
                # piece's summed loss is scaled the same: the pieces' gradients add up to it.
                loss = run.criterion(logits, target_k)
                if teacher_k:
                    loss = run.distill.loss(logits, teacher_k[0], loss)
                loss = loss * (world / cfg.batch_size)
            backend.progress.enter("backward")
            mechanics.backward(loss, run.scaler)
        with torch.no_grad():
            piece_loss = loss.detach().double() * cfg.batch_size / world  # this rank's summed loss
            piece_correct = multilabel.predicted_right(logits, counted_k) if counted_k.ndim == 2 \
                else (logits.argmax(1) == counted_k).sum()
            summed = piece_loss if summed is None else summed + piece_loss
            correct = piece_correct if correct is None else correct + piece_correct
    backend.progress.enter("optimizer")
    grad_norm = mechanics.clip_gradients(run.model, run.optimizer, run.scaler, cfg.clip_grad_norm)
    freeze(run.optimizer, run.step < cfg.freeze_backbone * run.steps_per_epoch)
    mechanics.optimizer_step(run.optimizer, run.scheduler, run.scaler)
    if run.ema is not None:
        run.ema.update()
    run.step += 1
    return summed, correct, grad_norm


def end_epoch(run: Run, epoch: int, sums: torch.Tensor, timing: EpochTiming, train_s: float) -> None:
    """Validate, checkpoint, and (rank 0, once the checkpoint is stored) send the epoch record."""
    backend = run.backend
    started = time.perf_counter()
    backend.progress.enter("sync", run.step)
    train_loss, train_acc, seen = global_means(backend, sums)
    rank_timing = timing.gather(backend)
    evaluated = evaluated_model(run)
    backend.progress.enter("eval")
    if backend.calibration_batches is not None:
        calibrate_batchnorm(evaluated, backend, run.manifest, run.memory_format)
    faults.maybe_fire(backend.fault, backend.rank, run.step, backend.run_dir, "validating")
    validation = evaluate(evaluated, backend, run.manifest, run.cfg.label_smoothing, run.memory_format,
                          multilabel.validation_loss(run.cfg, run.manifest, backend.device))
    thresholds = validation.pop(THRESHOLDS, None)  # a multi-label set's: stored beside model.pt
    metrics = {
        "epoch": epoch, "step": run.step, "train_loss": train_loss, "train_accuracy": train_acc,
        **validation, "val_split": eval_split(run.manifest),
        "train_samples": seen, "lr": run.scheduler.get_last_lr()[0], "world_size": backend.world_size,
        "epoch_time_s": train_s + time.perf_counter() - started,  # training + validation
        "images_per_s": seen / max(train_s, 1e-9),  # training only, validation excluded
        **rank_timing, "time": time.time(),
    }
    name = POLICY.epoch_name(epoch, backend.damaged)
    run.history.append(dict(metrics, kind="epoch", checkpoint=name))
    run.window.add(epoch, evaluated)  # --average-last's: before saving, as the checkpoint carries it
    save(run, epoch, metrics, None, name, evaluated, thresholds=thresholds)
    del evaluated  # with FSDP a full copy of the weights: not kept through the next epoch
    if backend.rank == 0:  # only once the checkpoint is stored: history never runs ahead of it
        backend.send(run.history[-1])


