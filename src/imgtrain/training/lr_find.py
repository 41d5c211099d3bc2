"""The learning-rate range test (``imgtrain lr-find``, ``train --lr auto``): Leslie Smith's test
as fastai's ``lr_find`` and Lightning's ``Tuner.lr_find`` run it.

The run's own step (``loop.train_step``: its model, optimizer, precision, augmentation, mixing,
``--accumulate``) is taken on the training split while the LR grows exponentially, from
``start_lr`` to ``end_lr`` over ``steps`` steps (torch's ``ExponentialLR``). The loss is smoothed
(an exponential moving average, beta 0.98, bias-corrected: both libraries' rule) and the test
stops once the smoothed loss exceeds 4 times its lowest (their divergence threshold). The
suggestion is the LR of the steepest descent of the smoothed loss per decade of LR before that
point, after the first 10 steps and before the last (``suggest``: fastai's ``steep``; Lightning
takes the gradient against the LR itself, which leans to the smallest LRs).

It trains a copy made for it, in this process, under the process settings put back afterwards
(torch's global RNG included), and writes nothing of a run: a run that starts after it begins
from the same seeded state as one that never ran it. A run of several workers is tested in one
process with ``--accumulate`` times the world size: the same global batch and gradient, each
piece the size of one worker's share (BatchNorm sees what it sees in the run).
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import math
from pathlib import Path

import numpy as np

from imgtrain.config import AUTO_BATCH, FIT_BATCH, LrFindOptions, TrainConfig, auto_batch_size
from imgtrain.errors import ImgtrainError

BETA = 0.98  # the loss's smoothing (fastai, Lightning)
DIVERGED = 4.0  # smoothed loss above this many times its lowest: stop (fastai, Lightning)
SKIP_BEGIN, SKIP_END = 10, 1  # Lightning's suggestion(skip_begin=10, skip_end=1)
START_LR, END_LR, STEPS = LrFindOptions.start_lr, LrFindOptions.end_lr, LrFindOptions.steps  # fastai's
FILE = "lr_find"  # a --lr auto run's curve: lr_find.csv and lr_find.png in its folder


@dataclasses.dataclass
class Curve:
    """What the test measured: the LR and raw and smoothed loss of every step taken, where it
    stopped and why, and the suggestion (None: no descent to suggest from)."""

    lrs: list[float]
    losses: list[float]
    smoothed: list[float]
    stopped: str  # "diverged" or "completed"
    suggestion: float | None

    def to_json(self) -> dict:
        return {"suggestion": self.suggestion, "steps": len(self.lrs), "stopped": self.stopped,
                "start_lr": self.lrs[0] if self.lrs else None, "end_lr": self.lrs[-1] if self.lrs else None}


def smooth(losses: list[float], beta: float = BETA) -> list[float]:
    """The bias-corrected exponential moving average of ``losses`` (fastai's and Lightning's)."""
    average, out = 0.0, []
    for i, loss in enumerate(losses):
        average = beta * average + (1 - beta) * loss
        out.append(average / (1 - beta ** (i + 1)))
    return out


def diverged(smoothed: list[float], threshold: float = DIVERGED) -> bool:
    """Whether the last smoothed loss is not finite or above ``threshold`` times the lowest so far."""
    last = smoothed[-1]
    return not math.isfinite(last) or last > threshold * min(smoothed)


def suggest(lrs: list[float], smoothed: list[float], skip_begin: int = SKIP_BEGIN,
            skip_end: int = SKIP_END) -> float | None:
    """The LR where the smoothed loss falls fastest per decade of LR, among the points after the
    first ``skip_begin`` and before the last ``skip_end``; None when fewer than 3 finite points
    remain or the loss falls nowhere (it only rose: no LR tried trains the model)."""
    lr = np.asarray(lrs[skip_begin:len(lrs) - skip_end], dtype=np.float64)
    loss = np.asarray(smoothed[skip_begin:len(smoothed) - skip_end], dtype=np.float64)
    finite = np.isfinite(loss)
    lr, loss = lr[finite], loss[finite]
    if len(loss) < 3:
        return None
    slope = np.gradient(loss, np.log10(lr))
    best = int(np.argmin(slope))
    return float(lr[best]) if slope[best] < 0 else None


def range_test(cfg: TrainConfig, manifest: dict, steps: int = STEPS, start_lr: float = START_LR,
               end_lr: float = END_LR) -> Curve:
    """Run the test for the run ``cfg`` would train (its global batch decided) on ``manifest``'s
    data set (local; on a worker's GPU where this process has none: ``on_worker``); see the module's doc."""
    import torch

    from imgtrain.training import on_worker
    from imgtrain.training.local_backend import process_settings_restored

    if on_worker.wanted(cfg):
        return on_worker.call(range_test, cfg, manifest, steps, start_lr, end_lr)

    if cfg.use_gpu and not torch.cuda.is_available():
        raise ImgtrainError("the learning-rate range test runs on this machine's GPU with --gpu, and PyTorch sees none "
                            "here: run it where the GPU is, or join a cluster with GPUs (--address: it runs on a worker's)")
    device = torch.device("cuda" if cfg.use_gpu else "cpu")
    with process_settings_restored(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        from imgtrain.cluster import threads_for

        torch.set_num_threads(threads_for(1, cfg.threads_per_worker, cfg.use_gpu))
        return _ramp(_test_config(cfg, start_lr), manifest, device, steps, start_lr, end_lr)


def _test_config(cfg: TrainConfig, start_lr: float) -> TrainConfig:
    """The run's settings as the test trains them: one process, the LR at the ramp's start held
    by a constant schedule the ramp replaces, no moving average, no compilation."""
    world = cfg.effective_workers()
    return dataclasses.replace(
        cfg, lr=start_lr, schedule="constant", warmup_epochs=0.0, warmup_fraction=TrainConfig.warmup_fraction,
        min_lr=0.0, ema_decay=0.0, compile=False, accumulate=cfg.accumulate * world, limit_train_batches=0,
        checkpoint_every_steps=0, ledger=False, backend="local", workers=1, min_workers=0)


def _ramp(cfg: TrainConfig, manifest: dict, device, steps: int, start_lr: float, end_lr: float) -> Curve:
    import torch

    from imgtrain.training import loop

    backend = _backend(cfg, manifest, device)
    run, _ = loop.setup(cfg, manifest, backend)
    gamma = (end_lr / start_lr) ** (1 / max(1, steps - 1))
    run.scheduler = torch.optim.lr_scheduler.ExponentialLR(run.optimizer, gamma)
    lrs, losses, smoothed = [], [], []
    run.model.train()
    for epoch in itertools.count():
        affines = loop.epoch_affines(run, run.step) if cfg.augment and backend.augment_in_step else None
        for i, batch in enumerate(backend.train_batches(epoch, 0)):
            lrs.append(run.optimizer.param_groups[0]["lr"])
            loss, _, _ = loop.train_step(run, batch, None if affines is None else affines[i])
            losses.append(float(loss) / len(batch["label"]))
            smoothed.append(smooth(losses)[-1])
            if diverged(smoothed):
                return Curve(lrs, losses, smoothed, "diverged", suggest(lrs, smoothed))
            if len(lrs) == steps:  # (train_step steps the ramp with the optimizer)
                return Curve(lrs, losses, smoothed, "completed", suggest(lrs, smoothed))


def _backend(cfg: TrainConfig, manifest: dict, device):
    """A world of one for the test: the training split's batches as the local backend reads them,
    nothing saved, nothing sent."""
    import contextlib

    import torch

    from imgtrain.data import stream
    from imgtrain.data.staging import local_data
    from imgtrain.training import ingest
    from imgtrain.training.backend import Backend, single_process_collectives

    data_cfg = dataclasses.replace(cfg, data=local_data(cfg.data))
    in_memory = stream.in_memory(cfg, manifest)
    if in_memory:
        from imgtrain.data.format import read_split
        from imgtrain.data.order import ordered_batches, sort_by_id

        rows = sort_by_id(*map(torch.from_numpy, read_split(data_cfg.data, "train")))
        batches = ordered_batches(rows, cfg.seed, cfg.batch_size, ingest.steps(cfg, manifest), world_size=1, rank=0,
                                  device=device, balanced=cfg.sampling == "balanced")
    else:
        batches = ingest.streamed_train_batches(data_cfg, manifest, 0, 1, device,
                                                "torch" if cfg.ingest == "torch" else "local")
    return Backend(rank=0, world_size=1, device=device, prepare_model=lambda m: m.to(device), train_batches=batches,
                   val_batches=lambda: iter(()), augment_in_step=in_memory, **single_process_collectives(),
                   restored_checkpoint=contextlib.nullcontext, report=lambda *a: None, send=lambda r: None)


# ---------------------------------------------------------------- imgtrain lr-find


def find(cfg: TrainConfig, options: LrFindOptions = LrFindOptions()) -> tuple[Curve, TrainConfig, Path]:
    """``imgtrain lr-find``: the test on ``cfg.data``'s training split with ``cfg``'s settings (its
    batch decided as ``train`` decides it), the curve written to ``options.out``; (the curve, the
    settings tested with, the plot's path). Raises ImgtrainError when it has nothing to suggest."""
    from imgtrain.config import read_autos, validate
    from imgtrain.data import staging
    from imgtrain.data.format import verify_dataset
    from imgtrain.ops import remote

    cfg = read_autos(dataclasses.replace(cfg, name=cfg.name or "lr-find"))
    validate(cfg)
    problems = [f"--{k.replace('_', '-')} must be above 0" for k in ("start_lr", "end_lr")
                if not getattr(options, k) > 0]
    if not problems and options.start_lr >= options.end_lr:
        problems.append(f"--start-lr {options.start_lr:g} must be below --end-lr {options.end_lr:g}")
    if options.steps < SKIP_BEGIN + SKIP_END + 2:
        problems.append(f"--steps must be at least {SKIP_BEGIN + SKIP_END + 2} (the suggestion skips the first "
                        f"{SKIP_BEGIN})")
    if not cfg.data:
        problems.append("--data is required (a directory made by `imgtrain data prepare`)")
    if problems:
        raise ImgtrainError("lr-find: " + "; ".join(problems))
    if cfg.data and not remote.is_remote(cfg.data):
        cfg = dataclasses.replace(cfg, data=str(Path(cfg.data).expanduser().resolve()))
    manifest = verify_dataset(staging.local_data(cfg.data), check_hashes=not remote.is_remote(cfg.data))
    n_train = manifest["splits"]["train"]["num_samples"]
    fewest = cfg.effective_workers() * cfg.accumulate
    if cfg.batch_size == FIT_BATCH:
        from imgtrain.training import batch_fit

        cfg = dataclasses.replace(cfg, batch_size=batch_fit.fit(cfg, manifest).batch_size)
    elif cfg.batch_size == AUTO_BATCH:
        cfg = dataclasses.replace(cfg, batch_size=min(auto_batch_size(n_train, fewest), n_train))
    if n_train < cfg.batch_size or cfg.batch_size < fewest:
        raise ImgtrainError(f"lr-find: --batch-size {cfg.batch_size} does not fit the {n_train} training samples and "
                            f"{fewest} worker piece(s)")
    curve = range_test(cfg, manifest, options.steps, options.start_lr, options.end_lr)
    _, plot = write_curve(curve, Path(options.out))
    if problem := refusal(curve):
        raise ImgtrainError(f"{problem} (the curve: {plot})")
    return curve, cfg, plot


# ---------------------------------------------------------------- what it says and writes


def refusal(curve: Curve) -> str | None:
    """The one line for a test that found nothing to suggest, or None."""
    if curve.suggestion is not None:
        return None
    where = f"step {len(curve.lrs)}, lr {curve.lrs[-1]:.2g}" if curve.lrs else "the first step"
    if curve.stopped == "diverged" and len(curve.lrs) <= SKIP_BEGIN + SKIP_END + 2:
        return (f"lr-find: the loss diverged at once ({where}, from {curve.lrs[0]:.2g}): no learning rate "
                "tried trains this model; try a smaller --start-lr, --precision fp32, --clip-grad-norm 1, or check "
                "the data's labels and the model")
    return (f"lr-find: the loss fell nowhere in {len(curve.lrs)} steps from lr {curve.lrs[0]:.2g} to "
            f"{curve.lrs[-1]:.2g}: nothing to suggest; try more --steps, a wider range, or set --lr yourself")


def write_curve(curve: Curve, out: Path) -> tuple[Path, Path]:
    """``out``.csv (step, lr, loss, smoothed) and ``out``.png (smoothed loss against LR, log x,
    the suggestion marked); returns both paths."""
    import io
    import os

    from imgtrain.ops.files import atomic_write_text

    out.parent.mkdir(parents=True, exist_ok=True)
    table, plot = out.with_suffix(".csv"), out.with_suffix(".png")
    text = io.StringIO()
    rows = csv.writer(text, lineterminator="\n")
    rows.writerow(["step", "lr", "loss", "smoothed_loss"])
    rows.writerows([i, f"{lr:.6g}", f"{a:.6g}", f"{b:.6g}"]
                   for i, (lr, a, b) in enumerate(zip(curve.lrs, curve.losses, curve.smoothed)))
    atomic_write_text(table, text.getvalue())
    partial = plot.with_name(f".{plot.name}.tmp")
    partial.write_bytes(_plot(curve))
    os.replace(partial, plot)  # complete or absent
    return table, plot


def _plot(curve: Curve) -> bytes:
    import io

    # matplotlib's object API, not pyplot: no global backend switch (as report.py)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4), dpi=100)
    ax = fig.add_subplot()
    finite = [(lr, s) for lr, s in zip(curve.lrs, curve.smoothed) if math.isfinite(s)]
    if finite:
        ax.plot(*zip(*finite), label="smoothed loss")
    ax.plot(curve.lrs, curve.losses, alpha=0.3, label="loss")
    if finite:  # the curve's own range: a diverged last step would flatten the rest
        low, high = min(s for _, s in finite), max(s for _, s in finite)
        ax.set_ylim(low - 0.05 * (high - low + 1e-9), high + 0.05 * (high - low + 1e-9))
    if curve.suggestion is not None:
        ax.axvline(curve.suggestion, color="tab:red", linestyle="--", label=f"suggestion {curve.suggestion:.2g}")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("training loss")
    ax.set_title(f"lr-find: {len(curve.lrs)} steps, {curve.stopped}")
    ax.legend()
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()
