"""The driver: checks the request, prepares the run directory, runs a backend, keeps the record.

``train(cfg)`` is the whole ``imgtrain train`` verb, in two parts: ``_plan`` makes every check
that can fail before anything is written, ``_execute`` writes the run's files and hands the
loop (``loop.run_loop``) to a backend: ``ray_backend`` (Ray Train workers) or
``local_backend`` (this process, plain PyTorch). What the ranks send comes back through
``Records`` to metrics.jsonl, the progress display and the trackers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

from imgtrain import cluster as cluster_mod
from imgtrain import configfile
from imgtrain.config import (AUTO_BATCH, AUTO_LR, DEFAULT_BATCH, FEW_STEPS, FIT_BATCH, LR_GIVEN, TrainConfig,
                             auto_batch_size, changed_fields, read_autos, steps_per_epoch, validate)
from imgtrain.data import staging
from imgtrain.errors import ImgtrainError, ImgtrainWarning, one_line
from imgtrain.ops import remote
from imgtrain.ops.files import check_writable, name_problem
from imgtrain.storage import checkpoint as ckpt
from imgtrain.storage import lease, location, mirror, ownership, runs
from imgtrain.training import tracking
from imgtrain.training.progress import TrainingDisplay


@dataclasses.dataclass
class Resume:
    """What the driver found in the run directory before starting the workers."""

    checkpoint: Path | None = None  # the newest checkpoint that passes verification
    damaged: list[str] = dataclasses.field(default_factory=list)  # names of those that fail it
    uri: str | None = None  # the run's URI in an object store: the workers fetch the checkpoint from there

    def to_worker(self) -> dict:
        fallback = self.checkpoint and (f"{self.uri}/{self.checkpoint.name}" if self.uri else str(self.checkpoint))
        return {"fallback": fallback or None, "damaged": self.damaged}


def train(cfg: TrainConfig, display: TrainingDisplay | None = None, overwrite: bool = False,
          ray_callbacks: Sequence = ()) -> runs.RunResult:
    """Train (or resume) the run ``cfg.name``; return its result. Raises ImgtrainError on bad input.

    ``overwrite`` replaces an existing run of that name and starts afresh; the old run is
    deleted once the new one has its first checkpoint, and restored if it fails before that.
    ``ray_callbacks``: Ray Train callbacks added to the run (the Ray backend's): a caller that
    needs the run's reports (a sweep's trial, for Ray Tune) passes them, so training knows no caller.
    """
    cfg, from_environment = configfile.environment_settings(read_autos(cfg))
    validate(cfg)
    tracking.require(cfg)  # a tracker asked for but not installed: before anything else
    cluster_mod.warn_if_oversubscribed(cfg)  # before the display's live line, long before Ray starts them all
    display = display or TrainingDisplay()
    if from_environment:
        display.note(f"settings from {configfile.ENV_VAR}: {', '.join(from_environment)}")
    display.pin_output()  # Ray redirects stdout to the run's logs: the display keeps the terminal
    try:
        return _train(cfg, display, overwrite, ray_callbacks)
    except BaseException as e:  # a start-up that fails says in which phase
        display.close("interrupted" if isinstance(e, KeyboardInterrupt) else "failed")
        raise
    finally:
        display.close()


def _train(cfg: TrainConfig, display: TrainingDisplay, overwrite: bool, ray_callbacks: Sequence) -> runs.RunResult:
    if cfg.data and not remote.is_remote(cfg.data):
        cfg = dataclasses.replace(cfg, data=str(Path(cfg.data).expanduser().resolve()))
    if cfg.init_from:  # the workers do not run in this directory
        cfg = dataclasses.replace(cfg, init_from=str(Path(cfg.init_from).expanduser().resolve()))
    if cfg.teacher:  # a folder, or a run's name in a local --storage: its folder, which the workers find anywhere
        found = Path(cfg.teacher).expanduser()
        if not found.exists() and not remote.is_remote(cfg.storage) and not name_problem(cfg.teacher):
            found = location.run_path(cfg.storage, cfg.teacher)
        if found.exists():
            cfg = dataclasses.replace(cfg, teacher=str(found.resolve()))
    if remote.is_remote(cfg.storage) and overwrite:
        raise ImgtrainError(f"--overwrite is not offered for runs in an object store ({cfg.storage}): delete the run "
                            f"with `imgtrain clean runs {cfg.name} --storage {cfg.storage}`, then train it again")
    store = location.store(cfg.storage) if remote.is_remote(cfg.storage) else None
    with contextlib.ExitStack() as held:  # the run's lease and lock, held until training ends
        # another machine's driver of this run: refused before anything of the run is touched
        token = held.enter_context(lease.leased(store, cfg.name, hint=_busy_hint(cfg, location.run_path(cfg.storage, cfg.name))))
        run_dir, locked = _working_copy(cfg, held)
        plan = _plan(cfg, run_dir, overwrite, display, held, locked)
        replaced = ownership.Replacement(run_dir) if plan.replace else None
        if replaced:
            display.note(f"replacing the previous run {cfg.name!r} and starting afresh; the old run is deleted "
                         "once this run has its first checkpoint")
        try:
            if not ownership.is_run(run_dir):  # a new run (or the old one just moved aside)
                with _turn(cfg.storage, cfg.name):  # no pull here finds it made but not locked
                    ownership.claim(run_dir)
                    held.enter_context(ownership.locked(run_dir, "trained"))
            _clear_staging(cfg, held)
            _probe_storage(run_dir, cfg.storage)
            # the driver's files go up every few seconds; the workers upload the checkpoints
            with mirror.mirrored(store, cfg.name, everything=cfg.backend == "local", token=token):
                return _execute(plan, run_dir, display, replaced, ray_callbacks)
        finally:
            if replaced and not replaced.done:  # the new run failed before its first checkpoint
                replaced.rollback()
                display.note(f"the previous run {cfg.name!r} was restored ({run_dir})")


def _clear_staging(cfg: TrainConfig, held: contextlib.ExitStack) -> None:
    """Remove what killed saves and failed uploads left in this node's checkpoint staging (a Ray
    rank clears its own on other nodes), now and when training ends. Only with the run's lock
    held: a second start of a live run, refused at the lock, must not delete the folder the live
    run is saving its next checkpoint into."""
    staged = location.checkpoint_staging(location.location(cfg.storage, cfg.name), 0).parent
    shutil.rmtree(staged, ignore_errors=True)
    held.callback(shutil.rmtree, staged, ignore_errors=True)  # runs before the lock is let go


def _working_copy(cfg: TrainConfig, held: contextlib.ExitStack) -> tuple[Path, bool]:
    """(the run's folder, whether its lock is taken). A run in an object store is brought up to
    date here first, and its lock is taken before that when this machine has a copy: a run
    trained here right now is refused before its files are touched."""
    run_dir = location.run_path(cfg.storage, cfg.name)
    if not remote.is_remote(cfg.storage):
        return run_dir, False
    st = location.store(cfg.storage)
    with mirror.turn(st, cfg.name):
        known = ownership.is_run(run_dir)
        if known:
            held.enter_context(ownership.locked(run_dir, "trained"))
        mirror.pull(st, cfg.name, owner=True)
        if not known and ownership.is_run(run_dir):  # first brought to this machine just now
            held.enter_context(ownership.locked(run_dir, "trained"))
    return run_dir, ownership.is_run(run_dir)  # a run here is locked (one the store no longer has is gone)


def _turn(storage: str, name: str):
    """The run's turn on this machine's working copy (``mirror.turn``); nothing for a folder."""
    return mirror.turn(location.store(storage), name) if remote.is_remote(storage) else contextlib.nullcontext()


@dataclasses.dataclass
class _Plan:
    """What ``train`` found and decided before touching the run directory."""

    cfg: TrainConfig
    manifest: dict
    stored: dict | None  # the config of the run being resumed; None for a new run
    replace: bool  # --overwrite of an existing run
    resume: Resume
    complete: bool = False  # every epoch is trained already: only its history is put right
    lr_curve: object = None  # --lr auto: the range test's curve (lr_find.Curve), kept in the run


def _plan(cfg: TrainConfig, run_dir: Path, overwrite: bool, display, held: contextlib.ExitStack,
          locked: bool = False) -> _Plan:
    """Every check that can fail, before anything is written. ``locked``: the run's lock is held already."""
    exists = ownership.is_run(run_dir)
    if not exists and (run_dir.is_symlink() or run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir()))):
        raise ImgtrainError(f"{run_dir} already exists and is not an imgtrain run (no {ownership.MARKER_FILE}); "
                            "imgtrain does not write into other folders: choose another --name or --storage")
    stored, resume = None, Resume()
    if exists:
        if not locked:
            held.enter_context(ownership.locked(run_dir, "trained"))  # refuses a run in use on this machine
        # another host's driver of a run in an object store: its lease was read before ours was written
        runs.refuse_if_trained(run_dir, this_host=False, other_hosts=not remote.is_remote(cfg.storage),
                               hint=_busy_hint(cfg, run_dir))
        if not ownership.is_marked(run_dir):
            ownership.mark(run_dir)  # a run made before markers: adopted
        if overwrite and not cfg.data:
            raise ImgtrainError("--overwrite starts the run afresh: pass --data as well")
        stored = None if overwrite else runs.read_config(run_dir)
    if stored is not None:
        cfg = _as_it_began(cfg, stored)
        changed = changed_fields(stored, cfg.to_dict())
        if changed:
            diffs = ", ".join(f"{k}: {stored[k]!r} -> {getattr(cfg, k)!r}" for k in changed)
            raise ImgtrainError(
                f"run {cfg.name!r} already exists in {run_dir.parent} with a different config ({diffs}); "
                "choose another --name, rerun with the original settings to resume it, or pass --overwrite "
                "to delete it and start afresh"
            )
        display.phase("checking the checkpoints")
        resume = _find_resume_point(run_dir, display)
        if remote.is_remote(cfg.storage):
            resume.uri = location.location(cfg.storage, cfg.name)
        meta = ckpt.read_meta(resume.checkpoint) if resume.checkpoint else {}
        if meta and _complete(cfg, meta):
            stop = runs.early_stop(cfg.to_dict(), ckpt.history(meta))
            display.note(f"run {cfg.name!r} is already complete ({_stopped_early(stop) if stop else f'{cfg.epochs} epochs'})"
                         "; nothing to train")
            return _Plan(cfg, meta.get("data") or {}, stored, False, resume, complete=True)
    if not cfg.data:
        raise ImgtrainError("--data is required for a new run (a directory made by `imgtrain data prepare`)")
    display.phase("checking the data set")
    # numpy and pyarrow from here: a refusal before the data set is read never waits for them
    from imgtrain.data.format import verify_dataset

    # one in an object store: copied here first, each file checked against its sha256 as it came
    manifest = verify_dataset(staging.local_data(cfg.data), check_hashes=not remote.is_remote(cfg.data))
    cfg = _batch_for(cfg, manifest["splits"]["train"]["num_samples"], display)
    _check_against_data(cfg, manifest)
    if cfg.teacher:
        from imgtrain.training import distill

        display.phase("loading the teacher")
        cfg = distill.resolved(cfg, manifest, stored, display.note)
    lr_curve = None
    if stored is None:
        _check_model(cfg, manifest, display)
        # lr-find and the batch fit try the student's own steps, without the teacher
        autos, lr_curve = _autos(dataclasses.replace(cfg, teacher=None), manifest, display)
        cfg = dataclasses.replace(autos, teacher=cfg.teacher)
    display.note(_selection_note(cfg, manifest))  # every check passed: what the run's figures will mean
    return _Plan(cfg, manifest, stored, exists and overwrite, resume, lr_curve=lr_curve)


def _as_it_began(cfg: TrainConfig, stored: dict) -> TrainConfig:
    """``cfg`` of a run being resumed, with what the run chose when it began (``stored``): its
    data when not given, the batch and LR that ``auto`` found, how they were chosen, and the
    distillation mode; the teacher's identity is checked later (distill.resolved)."""
    if not cfg.data:  # `imgtrain train --name X` alone resumes X
        cfg = dataclasses.replace(cfg, data=stored["data"])
    if cfg.batch_size in (AUTO_BATCH, FIT_BATCH):  # the batch chosen when the run began, whatever the rule is now
        cfg = dataclasses.replace(cfg, batch_size=stored.get("batch_size", DEFAULT_BATCH))
    if cfg.lr == AUTO_LR:  # --lr auto: what the run chose when it began, never found again
        cfg = dataclasses.replace(cfg, lr=stored.get("lr", TrainConfig.lr))
    # how they were chosen: records of the run's start, not settings to compare
    cfg = dataclasses.replace(cfg, lr_source=stored.get("lr_source", ""),
                              batch_source=stored.get("batch_source", ""))
    if cfg.teacher:
        cfg = dataclasses.replace(cfg, teacher_sha256=stored.get("teacher_sha256", ""),
                                  distillation=stored.get("distillation", ""),
                                  distill_mode=stored.get("distill_mode", cfg.distill_mode)
                                  if cfg.distill_mode == "auto" else cfg.distill_mode)
    return cfg


def _check_against_data(cfg: TrainConfig, manifest: dict) -> None:
    """The settings that this data set (or this machine) cannot train with, refused in one line."""
    from imgtrain.data import stream

    if cfg.backend == "ray" and cfg.address:  # an unreachable cluster: say so before making the run
        cluster_mod.check_joinable(cfg.address)
    if cfg.data_on_device and not stream.in_memory(cfg, manifest):
        raise ImgtrainError("--data-on-device holds a small data set in device memory; this one is streamed "
                            "(encoded images, or too large): drop --data-on-device")
    if (cfg.augment_policy != "none" or cfg.color_jitter or cfg.random_erasing) \
            and stream.preset(cfg, manifest) != "photos":
        raise ImgtrainError("--augment-policy, --color-jitter and --random-erasing augment photos; this data set "
                            "trains with the digits preset: drop them, or pass --preset photos")
    if problem := _label_problem(cfg, manifest):
        raise ImgtrainError(problem)
    if cfg.backend == "local" and cfg.use_gpu and not _cuda_available():
        raise ImgtrainError("--gpu asked for, but PyTorch sees no CUDA device here; use --cpu")


def _autos(cfg: TrainConfig, manifest: dict, display):
    """A new run's ``--batch-size auto`` (``batch_fit``), then its LR: ``--lr auto`` found by the
    range test (``lr_find``) at that batch, or the default LR scaled with an auto batch
    (``scaled_lr``); (the config with both decided, the range test's curve or None)."""
    curve = None
    if cfg.batch_size == FIT_BATCH:
        display.phase("fitting the batch size")
        from imgtrain.training import batch_fit

        fitted = batch_fit.fit(cfg, manifest)
        cfg = dataclasses.replace(cfg, batch_size=fitted.batch_size, batch_source=fitted.detail)
        display.note(fitted.note())
        if cfg.lr == TrainConfig.lr and cfg.lr_source != LR_GIVEN:  # the recipe's LR, for its batch, scaled to this one
            lr, rule = scaled_lr(cfg)
            cfg = dataclasses.replace(cfg, lr=lr, lr_source=rule)
            display.note(f"lr {lr:.3g}: {rule} (--lr sets it)")
        cfg = _batch_for(cfg, manifest["splits"]["train"]["num_samples"], display)
    if cfg.lr == AUTO_LR:
        display.phase("finding the learning rate")
        from imgtrain.training import lr_find

        curve = lr_find.range_test(cfg, manifest)
        if problem := lr_find.refusal(curve):
            raise ImgtrainError(problem)
        cfg = dataclasses.replace(cfg, lr=round_lr(curve.suggestion),
                                  lr_source=f"lr-find: the steepest descent of {len(curve.lrs)} steps from "
                                            f"{curve.lrs[0]:.2g} (batch {cfg.batch_size})")
        display.note(f"lr {cfg.lr:.3g}: lr-find's suggestion ({len(curve.lrs)} steps, {curve.stopped}; "
                     f"the curve: {lr_find.FILE}.png in the run)")
    validate(cfg)  # --min-lr, --accumulate against what was chosen
    return cfg, curve


REFERENCE_BATCH = DEFAULT_BATCH  # the batch the default --lr was tuned at (docs/training.md "The default recipe")


def scaled_lr(cfg: TrainConfig) -> tuple[float, str]:
    """The default LR scaled from REFERENCE_BATCH to ``cfg.batch_size``, and the rule in words:
    linear for SGD and LARS (Goyal et al. 2017), the square root for the adaptive AdamW and
    LAMB (Malladi et al. 2022: linear scaling overshoots with Adam); at most 10 (--lr's range)."""
    ratio = cfg.batch_size / REFERENCE_BATCH
    linear = cfg.optimizer in ("sgd", "lars")
    lr = round_lr(min(10.0, TrainConfig.lr * (ratio if linear else ratio ** 0.5)))
    how = "linear" if linear else "square-root"
    return lr, f"scaled: {TrainConfig.lr:g} x {'' if linear else 'sqrt'}({cfg.batch_size}/{REFERENCE_BATCH}), {how} scaling"


def round_lr(lr: float) -> float:
    """Two significant digits: what the run records and a person would type again."""
    return float(f"{lr:.2g}")


def _label_problem(cfg: TrainConfig, manifest: dict) -> str | None:
    """A setting that means nothing for this data set's kind of labels (one, or a set per image)."""
    from imgtrain.checkpoint_policy import MULTI_LABEL_METRICS
    from imgtrain.data.format import is_multi_label

    if is_multi_label(manifest) and cfg.sampling == "balanced":
        return ("--sampling balanced draws each class equally often, which has no meaning when an image carries "
                "several labels (drawing one draws all of them): use --sampling shuffle, and --class-weights auto "
                "to weigh rare labels up")
    if not is_multi_label(manifest) and cfg.select_metric in MULTI_LABEL_METRICS:
        return (f"--select-metric {cfg.select_metric} is a multi-label figure and this data set has one label per "
                "image: use val_accuracy, val_loss or val_f1_macro")
    return None


def _selection_note(cfg: TrainConfig, manifest: dict) -> str:
    """One line: the split the best checkpoint is selected on, and what that means for the test figure."""
    if "val" in manifest["splits"]:
        return (f"selecting the best checkpoint by {cfg.select_metric} on the val split ("
                f"{manifest['splits']['val']['num_samples']:,} images); the test split is left for `imgtrain evaluate`")
    return ("note: this data set has no val split, so training validates on, and picks the best checkpoint by, the "
            "test split: its test figure is optimistic; prepare the data set again with --val-fraction 0.1 to fix")


def _batch_for(cfg: TrainConfig, n_train: int, display) -> TrainConfig:
    """The run's config with its global batch decided: ``--batch-size 0`` (the default) chosen
    from the training split's size (``config.auto_batch_size``), a batch the user set kept as
    given; checked against the split, and a warning when an epoch is only a few steps."""
    workers = cfg.effective_workers()
    if cfg.batch_size == FIT_BATCH:  # decided after the model's check (_autos)
        return cfg
    if cfg.batch_size == AUTO_BATCH:
        if n_train < workers:
            raise ImgtrainError(f"the {n_train} training samples are fewer than the --workers {cfg.workers}: every "
                                "worker needs at least one sample per step; use fewer workers or more data")
        cfg = dataclasses.replace(cfg, batch_size=min(auto_batch_size(n_train, workers * cfg.accumulate), n_train))
        validate(cfg)  # --accumulate against the chosen batch
        if cfg.batch_size != DEFAULT_BATCH:
            display.note(f"batch size {cfg.batch_size}: {n_train} training samples, "
                         f"{steps_per_epoch(n_train, cfg.batch_size)} steps an epoch (--batch-size sets it)")
    steps = steps_per_epoch(n_train, cfg.batch_size)
    if steps == 0:
        raise ImgtrainError(
            f"--batch-size {cfg.batch_size} is larger than the {n_train} training samples; use a smaller batch size"
        )
    if steps < FEW_STEPS:
        warnings.warn(f"an epoch is {steps} optimizer step{'s' * (steps > 1)} ({n_train} training samples, batch "
                      f"{cfg.batch_size}, {n_train % cfg.batch_size} left out each epoch): few steps train little "
                      "and may diverge; a smaller --batch-size gives more", ImgtrainWarning, stacklevel=2)
    return cfg


def _complete(cfg: TrainConfig, meta: dict) -> bool:
    """Whether a run whose latest checkpoint has this meta.json has nothing left to do: every
    epoch trained, or stopped early by its history (--early-stop: the loop's own rule), and its
    average checkpoint made (--average-last)."""
    trained = meta.get("epoch", -1) + 1 >= cfg.epochs or runs.early_stop(cfg.to_dict(), ckpt.history(meta))
    return bool(trained) and (not cfg.average_last or ckpt.AVERAGE_KEY in meta)


def _stopped_early(stop) -> str:
    best = f"its best, epoch {stop.best_epoch + 1}" if stop.best_epoch is not None else "no number at all"
    return (f"stopped early after epoch {stop.epoch + 1}: {stop.metric} did not improve for {stop.patience} "
            f"epoch{'s' * (stop.patience > 1)} after {best}")


def _busy_hint(cfg: TrainConfig, run_dir: Path) -> str:
    if remote.is_remote(cfg.storage):  # the status comes from the store: deleting the copy here is undone
        return (f"wait for it or stop it; if that driver is gone, its heartbeat has stopped and the run counts "
                f"as interrupted {lease.HEARTBEAT_STALE_S:.0f} s after the last one: run this again then")
    return f"wait for it or stop it (if that process is gone, delete {run_dir / runs.STATUS_FILE})"


def _check_model(cfg: TrainConfig, manifest: dict, display) -> None:
    """Build the model once here, run one image through it and load its initial weights, so
    that a wrong name, an image size it cannot take, --drop-path or --grad-checkpointing for a
    model without them, or a file that does not fit fails in seconds, before Ray starts;
    downloads --pretrained weights once for every worker. The
    default model from scratch takes any image size: nothing to check, and no torch import
    (zoo imports it: seconds before anything else shows, so the default is TrainConfig's)."""
    from imgtrain.models.zoo import chosen_stem  # imports no torch

    stem = chosen_stem(cfg.model, manifest["image_shape"][:2]) if cfg.stem == "auto" else cfg.stem
    if cfg.model == TrainConfig.model and stem == "standard" and not (cfg.init_from or cfg.pretrained) \
            and cfg.drop_path is None and not cfg.grad_checkpointing:
        return
    display.phase("checking the model")
    import torch

    from imgtrain import finetune
    from imgtrain.models import zoo

    args = zoo.model_args(manifest, cfg.model, cfg.stem)
    try:
        zoo.check_name(cfg.model, cfg.stem)
        with torch.random.fork_rng(devices=[]):
            model = zoo.build_from_args(args, cfg.drop_path, cfg.grad_checkpointing).eval()
    except ValueError as e:
        raise ImgtrainError(f"--model {cfg.model}: {e}") from None
    if cfg.layer_decay:  # a model without a known layer order: one line now, not from every worker
        from imgtrain.training.recipe import parameter_groups

        parameter_groups(model, cfg)
    h, w, c = manifest["image_shape"]
    try:
        with torch.no_grad():
            model(torch.zeros(1, c, h, w))
    except RuntimeError as e:
        raise ImgtrainError(f"--model {cfg.model} cannot take {h}x{w} images ({str(e).splitlines()[0][:160]}); "
                            "prepare the data with a larger --size or choose another model") from None
    if cfg.model != zoo.DEFAULT_MODEL or stem != "standard":
        display.note(zoo.describe(args, suggest=True))
    weights = finetune.initial_weights(cfg)  # --pretrained: downloaded here, or a one-line error
    if weights:
        display.note(finetune.initialise(model, weights, cfg.model).summary(weights))


def _cuda_available() -> bool:
    import torch  # here: the driver of a Ray run never needs it

    return torch.cuda.is_available()


def _find_resume_point(run_dir: Path, display) -> Resume:
    good, bad = ckpt.verified(run_dir)
    for path, why in bad:  # never resume from damaged weights: fall back to the previous good one
        display.note(f"warning: skipping checkpoint {path.name}: {why}")
    latest = good[-1] if good else None
    if bad:
        display.note(f"resuming from {latest.name}" if latest else "no good checkpoint left: starting from scratch")
    return Resume(latest, [p.name for p, _ in bad])


def _execute(plan: _Plan, run_dir: Path, display, replaced: ownership.Replacement | None,
             ray_callbacks: Sequence) -> runs.RunResult:
    cfg, manifest = plan.cfg, plan.manifest
    runs.write_config(run_dir, {**tracking.public_config(cfg), **runs.versions()})
    runs.write_status(run_dir, "running", started=time.time())
    if tracking.wanted(cfg):
        display.phase("opening the trackers")
    try:
        trackers = tracking.open_trackers(cfg, run_dir, manifest, display.note)
    except ImgtrainError as e:  # a tracking URI that does not work: fail before any training
        _record_status(run_dir, "failed", error=str(e))
        raise
    records = Records(run_dir, display, trackers, on_checkpoint=replaced.commit if replaced else None)
    if plan.lr_curve is not None:  # --lr auto: the curve it chose from, beside the run's history
        from imgtrain.training import lr_find

        lr_find.write_curve(plan.lr_curve, run_dir / lr_find.FILE)
        records.log.append({"kind": "lr_find", "step": 0, "lr": cfg.lr, **plan.lr_curve.to_json(),
                            "time": time.time()})
    if plan.resume.checkpoint is not None:  # the history up to it, whatever the last driver wrote
        meta = ckpt.read_meta(plan.resume.checkpoint)
        records.recover(meta.get("step", 0), ckpt.history(meta), plan.resume.checkpoint.name)
    if plan.stored is not None and not plan.complete:
        display.note(f"resuming run {cfg.name!r} {_resume_point(plan.resume.checkpoint)} ({run_dir})")
    try:
        if not plan.complete:
            # only the backend in use: local_backend imports torch (seconds), which a Ray driver
            # would import before Ray starts, with nothing on the screen
            if cfg.backend == "local":
                display.phase("importing PyTorch")
                from imgtrain.training import local_backend

                local_backend.fit(cfg, manifest, run_dir, records, plan.resume)
            else:
                from imgtrain.training import ray_backend

                ray_backend.fit(cfg, manifest, run_dir, records, plan.resume, ray_callbacks)
    except BaseException as e:  # a truthful status behind, whatever the failure
        status = "interrupted" if isinstance(e, KeyboardInterrupt) else "failed"
        error = str(e) if isinstance(e, ImgtrainError) else f"{type(e).__name__}: {e}"
        _record_status(run_dir, status, **({} if status == "interrupted" else {"error": error}))
        records.finish(status)
        if replaced and ckpt.verified(run_dir)[0]:
            replaced.commit()  # the new run can be resumed: the old one goes as asked
        raise
    if replaced:
        replaced.commit()
    if remote.is_remote(cfg.storage) and cfg.backend == "ray":
        _checkpoint_records(cfg, display)
    result = runs.read_run(run_dir, cfg.storage)
    _calibrate(cfg, result.best_checkpoint, display, again=not plan.complete)
    stop = result.stopped_early
    if stop and not plan.complete:
        display.note(_stopped_early(stop))
    runs.write_status(run_dir, "finished", val_accuracy=result.final_accuracy,
                      **({"stopped_early": stop.to_json()} if stop else {}))
    records.finish("finished", result.best_checkpoint)
    result.status = "finished"
    return result


def _calibrate(cfg: TrainConfig, best: Path | None, display, again: bool) -> None:
    """Temperature scaling and the --reject auto thresholds of the best checkpoint, fitted on the
    val split in this process and stored with it (inference/calibrate.py); ``again``: even where
    it has them (it is a new best, or trained on). The checkpoint of a Ray run in an object store
    is there, its workers uploaded it: its weights come down for the pass and go after, and the
    calibration goes up into it. Training is over: a failure is a warning."""
    from imgtrain.inference import calibrate

    if best is None or not again and ckpt.CALIBRATION_FILE in (ckpt.read_meta(best).get("sha256") or {}):
        return
    try:
        if (best / ckpt.MODEL_FILE).is_file():
            fitted = calibrate.calibrate_checkpoint(best, cfg.data)
        else:  # only its record is here; the run's lease and lock are this driver's
            fitted = calibrate.calibrate_stored(location.store(cfg.storage), cfg.name, best, cfg.data,
                                                keep_weights=False)
        display.note(f"calibration of {best.name}: {fitted.line()}")
    except calibrate.NotFitted as e:
        display.note(str(e))
    except ImgtrainError as e:
        again_with = f"imgtrain calibrate {cfg.name}" + (f" --storage {cfg.storage}" if remote.is_remote(cfg.storage) else "")
        display.note(f"warning: calibration failed ({e}); run `{again_with}` to try again")


def _checkpoint_records(cfg: TrainConfig, display) -> None:
    """The meta.json of each checkpoint the workers uploaded (the best and the latest are read
    from them; the weights stay in the store until a command needs them). Training is over: a
    store failing now is a warning, and the run is still recorded as finished."""
    try:
        mirror.pull(location.store(cfg.storage), cfg.name, checkpoints=False, only_checkpoints=True, owner=True)
    except Exception as e:  # noqa: BLE001 - whatever it is, the run's status is written next
        display.note(f"warning: the checkpoints' records could not be read from the store ({one_line(e)}); "
                     f"`imgtrain runs show {cfg.name} --storage {cfg.storage}` reads them later")


class Records:
    """Where the ranks' records go: metrics.jsonl, the progress display and the trackers.
    ``on_checkpoint`` runs once, when the first checkpoint of this session is stored."""

    def __init__(self, run_dir: Path, display: TrainingDisplay, trackers: list, on_checkpoint=None):
        self.log, self.display, self.trackers = runs.MetricsLog(run_dir), display, trackers
        self.on_checkpoint = on_checkpoint

    def send(self, record: dict) -> None:
        if record.get("kind") == "phase":  # start-up progress: for the screen, not the run's history
            self.display.update(record)
            return
        if record.get("checkpoint") and self.on_checkpoint:
            self.on_checkpoint()
            self.on_checkpoint = None
        if record.get("kind") == "start":  # a worker group starts: from a checkpoint, maybe a retry
            record = dict(record)
            history, source = record.pop("history", []), record.get("restored_from")
            self.log.append(record)
            self._to_screen_and_trackers(record)
            self.recover(record["step"], history, source)
            return
        self.log.append(record)
        self._to_screen_and_trackers(record)

    def recover(self, step: int, history: list[dict], source: str | None) -> None:
        """Put back the epoch records up to ``step`` that the checkpoint ``source`` holds and
        metrics.jsonl lacks (a driver killed between the checkpoint and its record)."""
        recovered = self.log.reconcile(step, history, source)
        if recovered:
            epochs = ", ".join(str(r["epoch"] + 1) for r in recovered)
            self.display.note(f"recovered the record of epoch {epochs} from {source} (the previous driver "
                              "stopped before writing it)")
        for lost in recovered:  # after the start record: TensorBoard purges what lies past it first
            for tracker in self.trackers:
                tracker.log(lost)

    def _to_screen_and_trackers(self, record: dict) -> None:
        self.display.update(record)
        for tracker in self.trackers:
            tracker.log(record)

    def finish(self, status: str, best_checkpoint: Path | None = None) -> None:
        for tracker in self.trackers:
            tracker.finish(status, best_checkpoint)


def _record_status(run_dir: Path, status: str, **extra) -> None:
    # On a full disk this write fails too; the error being raised matters more.
    with contextlib.suppress(OSError):
        runs.write_status(run_dir, status, **extra)


def _resume_point(checkpoint: Path | None) -> str:
    """'at epoch E, step S from checkpoint_...' (1-based epoch, as the display counts them)."""
    if checkpoint is None:
        return "from the start"
    meta = ckpt.read_meta(checkpoint)
    epoch = (meta.get("in_epoch") or {}).get("epoch", meta.get("epoch", -1) + 1)
    return f"at epoch {epoch + 1}, step {meta.get('step', 0)} from {checkpoint.name}"


def _probe_storage(run_dir: Path, storage: str) -> None:
    check_writable(run_dir / runs.LOGS_DIR, "storage")
    if remote.is_remote(storage):
        remote.probe(location.store(storage))
