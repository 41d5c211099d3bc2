"""Checkpoints: the format (save, verify, load) and their folders in a run directory (listing,
best/latest, deleting those the policy lets go, resolution with fallback to the newest one that
verifies), used by training (save, resume) and inference (load). What they are called, which is
best and which are kept is decided by the policy (checkpoint_policy.py).

A checkpoint directory holds:
  model.pt        the unwrapped ``state_dict`` of the model that was evaluated (the moving
                  average of the weights when EMA is on); the Ray tutorial's own inference code,
                  ``build_model().load_state_dict(torch.load("model.pt", weights_only=True))``, loads it
  train_state.pt  optimizer, scheduler, epoch, step, RNG states (and --average-last's window):
                  plain types and tensors only, so it loads with ``weights_only=True``
  sharded/        only with ``--strategy fsdp``: the training weights, optimizer state and moving
                  average as a ``torch.distributed.checkpoint`` directory, one file per rank (each
                  rank writes its own); train_state.pt then holds neither optimizer nor weights
  thresholds.pt   only for a multi-label data set (training/multilabel.py), in a validated checkpoint:
                  {"thresholds": float32 [classes], each label's decision threshold on its
                  sigmoid, "chosen_on": "val" (the F1-best per label there) or None (0.5 each: no
                  val split to choose them on)}; tensors and plain types, ``weights_only=True``
  calibrated.pt   only once calibrated (inference/calibrate.py: at the end of training, or by
                  ``imgtrain calibrate``), added to a finished checkpoint with its sha256 put in
                  meta.json's table: {"temperature": float, T of the temperature scaling,
                  "fitted_on": "val", "images": int, "nll" and "ece": [before, after] on that
                  split, "ood_keep": 0.95, "ood_thresholds": {score method: the threshold that
                  keeps that share of the split}, "mahalanobis": {"whitening": float32 [D, D],
                  "means": float32 [classes, D]} or None}; plain types and tensors, ``weights_only=True``
  meta.json       config, model args, data set summary, metrics, and the sha256 of every file
                  above. Written last: a directory without a valid meta.json is not a checkpoint.
"""

from __future__ import annotations

import json
import os
import pickle
import warnings
from pathlib import Path

from imgtrain.checkpoint_policy import POLICY, CheckpointPolicy
from imgtrain.errors import ImgtrainError, ImgtrainWarning
from imgtrain.ops.files import atomic_write_text, sha256_file

MODEL_FILE = "model.pt"
TRAIN_STATE_FILE = "train_state.pt"
THRESHOLDS_FILE = "thresholds.pt"
CALIBRATION_FILE = "calibrated.pt"
META_FILE = "meta.json"
SHARDED_DIR = "sharded"
FORMAT_VERSION = 1

# train_state.pt keys
OPTIMIZER_KEY = "optimizer"
SCHEDULER_KEY = "scheduler"
EPOCH_KEY = "epoch"  # last completed epoch, 0-based (-1: none yet)
STEP_KEY = "step"  # optimizer steps taken so far, across epochs
RNG_KEY = "rng"  # {"torch": ByteTensor}; data order and augmentation are seeded per step instead
# Only in a checkpoint taken inside an epoch: {"steps": steps of the next epoch already taken,
# "sums": float64 [loss sum, correct, samples] of those steps over all ranks, "elapsed_s": float}
EPOCH_PROGRESS_KEY = "epoch_progress"
TRAIN_WEIGHTS_KEY = "train_weights"  # the raw weights, when model.pt holds their moving average
EMA_STEPS_KEY = "ema_steps"
# --average-last (training/averaging.py): the evaluated weights of the last epochs the average
# takes, {"epochs": [int], "weights": [state_dict]}, while there are any
AVERAGE_WINDOW_KEY = "average_window"
# Only in the average checkpoint, whose model.pt holds the average: the evaluated weights
# (model.pt of the last epoch's checkpoint) that a run resumed from it goes on with
EVALUATED_WEIGHTS_KEY = "evaluated_weights"
# Only with --precision fp16: torch.amp.GradScaler's state_dict (the loss scale and its growth
# counter, plain numbers), so a resumed run scales as the uninterrupted one would have
GRAD_SCALER_KEY = "grad_scaler"

# meta.json: the epoch records of every epoch up to this checkpoint (its own included), so the
# run's history can be rebuilt from the checkpoint a run resumes from
HISTORY_KEY = "history"
# meta.json of the average checkpoint (--average-last): {"epochs": [the epochs averaged, 0-based]}
AVERAGE_KEY = "average"
# meta.json is parsed whole, and it is untrusted (its own sha256 is in no table). Its largest
# parts are the data set's manifest (a few MB for millions of images) and one record per epoch
# (about 300 bytes; at most 100,000 epochs: 30 MB).
MAX_META_BYTES = 64 << 20


class CheckpointError(ImgtrainError):
    """A checkpoint is missing, incomplete, tampered with, or of an incompatible model."""


def save(directory: str | os.PathLike, model_state: dict, train_state: dict, meta: dict,
         other_files: dict[str, str] | None = None, thresholds: dict | None = None) -> Path:
    """Write a checkpoint into ``directory`` (created); meta.json last, with every file's sha256.
    ``other_files``: {relative path: sha256} of files other ranks write into the same
    checkpoint (FSDP's shards), recorded and verified like the rest. ``thresholds``: a
    multi-label model's (THRESHOLDS_FILE)."""
    import torch

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    torch.save(model_state, d / MODEL_FILE)
    torch.save(train_state, d / TRAIN_STATE_FILE)
    written = [MODEL_FILE, TRAIN_STATE_FILE]
    if thresholds is not None:
        torch.save(thresholds, d / THRESHOLDS_FILE)
        written.append(THRESHOLDS_FILE)
    meta = dict(meta, format_version=FORMAT_VERSION)
    meta["sha256"] = {**(other_files or {}), **{name: sha256_file(d / name) for name in written}}
    atomic_write_text(d / META_FILE, json.dumps(meta, indent=2, default=str))
    return d


def read_meta(directory: str | os.PathLike) -> dict:
    d = Path(directory)
    path = d / META_FILE
    if not path.is_file():
        raise CheckpointError(f"{d} is not a complete imgtrain checkpoint: {META_FILE} is missing")
    size = path.stat().st_size
    if size > MAX_META_BYTES:  # refused before it is read
        raise CheckpointError(f"{path} is {size:,} bytes, over the {MAX_META_BYTES:,} a {META_FILE} can be; "
                              "use another checkpoint")
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is corrupt ({e}); use another checkpoint") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path} is corrupt (not a JSON object); use another checkpoint")
    return meta


def history(meta: dict) -> list[dict]:
    """The epoch records a checkpoint carries. Checkpoints written before they carried them
    give their own epoch's record (an epoch-end checkpoint) or nothing."""
    if isinstance(meta.get(HISTORY_KEY), list):
        return meta[HISTORY_KEY]
    metrics = meta.get("metrics") or {}
    if "in_epoch" in meta or "train_loss" not in metrics:
        return []
    return [dict(metrics, kind="epoch")]


def verify(directory: str | os.PathLike) -> dict:
    """Check every file against the sha256 in meta.json, and the model meta.json describes against
    the bounds of what imgtrain builds; return the meta or raise naming the file."""
    from imgtrain.models.zoo import args_problems  # imports no torch

    d = Path(directory)
    meta = read_meta(d)
    hashes = meta.get("sha256") or {}
    if not isinstance(hashes, dict):
        raise CheckpointError(f"{d / META_FILE} is corrupt (sha256 is not a table); use another checkpoint")
    # Before the hashes (seconds for a large model.pt): the table is meta.json's own word, and a
    # model_args.image_size of 65,536 would have every reader allocate 51 GB for one ViT.
    problems = args_problems(meta["model_args"]) if "model_args" in meta else []
    if problems:
        raise CheckpointError(f"checkpoint {d} holds a model imgtrain cannot build ({d / META_FILE} model_args: "
                              f"{'; '.join(problems)}); use another checkpoint")
    for name in dict.fromkeys([MODEL_FILE, TRAIN_STATE_FILE, *hashes]):  # the two always, then the shards
        expected = hashes.get(name)
        if not expected:
            raise CheckpointError(f"{d / META_FILE} records no sha256 for {name}; the checkpoint cannot be verified")
        if Path(name).is_absolute() or ".." in Path(name).parts:  # meta.json is untrusted input
            raise CheckpointError(f"{d / META_FILE} names a file outside the checkpoint: {name}")
        f = d / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint file {f} is missing")
        if sha256_file(f) != expected:
            raise CheckpointError(f"checkpoint file {f} fails its sha256 check (corrupt or modified)")
    return meta


def _load(path: Path, map_location="cpu"):
    import torch  # here, not at the top: `imgtrain runs list` should not wait for torch

    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        # weights_only=True refuses arbitrary pickled objects: that is the point.
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"refusing to load {path}: it contains objects other than tensors and plain types ({first})"
        ) from None
    except (RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None


def load_model_state(directory: str | os.PathLike, map_location="cpu") -> dict:
    return _load(Path(directory) / MODEL_FILE, map_location)


def load_train_state(directory: str | os.PathLike) -> dict:
    return _load(Path(directory) / TRAIN_STATE_FILE)


def load_thresholds(directory: str | os.PathLike, num_classes: int):
    """A multi-label checkpoint's decision thresholds, float32 numpy [num_classes], and the split
    they were chosen on (None: 0.5 each); (None, None) when it has none (a checkpoint taken inside
    an epoch, never validated: the reader's 0.5 then). The file is verified by ``verify`` like
    the others; its values are still held to what a threshold can be."""
    import numpy as np

    path = Path(directory) / THRESHOLDS_FILE
    if not path.is_file():
        return None, None
    saved = _load(path)
    values = saved.get("thresholds") if isinstance(saved, dict) else None
    chosen_on = saved.get("chosen_on") if isinstance(saved, dict) else None
    values = values.detach().float().cpu().numpy() if hasattr(values, "detach") else None
    if values is None or values.shape != (num_classes,) or not np.all((values >= 0) & (values <= 1)):
        raise CheckpointError(f"{path} does not hold {num_classes} thresholds between 0 and 1; "
                              "use another checkpoint")
    return values, chosen_on if chosen_on in ("val",) else None


def add_file(directory: str | os.PathLike, name: str, payload: dict) -> None:
    """Add ``name`` (``payload`` saved by torch, plain types) to a complete checkpoint, or replace
    it: the file first, then meta.json with its sha256 in the table, each replaced whole. A reader
    between the two finds the old table, which does not list the new file (``load_calibration``
    reads only a listed file), or lists the old one, which then fails its sha256 check."""
    import torch

    d = Path(directory)
    meta = read_meta(d)
    partial = d / f".{name}.tmp"
    torch.save(payload, partial)
    os.replace(partial, d / name)
    meta["sha256"] = {**(meta.get("sha256") or {}), name: sha256_file(d / name)}
    atomic_write_text(d / META_FILE, json.dumps(meta, indent=2, default=str))


def load_calibration(directory: str | os.PathLike) -> dict | None:
    """A checkpoint's calibration (CALIBRATION_FILE) or None when it has none. Only a file its
    meta.json's table lists (and so ``verify`` checked) is read; its values are held to what they
    can be: a finite temperature above 0 and finite thresholds."""
    import math

    d = Path(directory)
    path = d / CALIBRATION_FILE
    if not (d / META_FILE).is_file():  # a model of the caller's own (a LoadedCheckpoint built in a notebook)
        return None
    if CALIBRATION_FILE not in (read_meta(d).get("sha256") or {}):
        return None
    saved = _load(path)
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)  # noqa: E731
    thresholds = saved.get("ood_thresholds") if isinstance(saved, dict) else None
    if (not isinstance(saved, dict) or not number(saved.get("temperature")) or saved["temperature"] <= 0
            or not isinstance(thresholds, dict)
            or not all(isinstance(k, str) and number(v) for k, v in thresholds.items())
            or not _class_means(saved.get("mahalanobis"))):
        raise CheckpointError(f"{path} does not hold a temperature above 0 and score thresholds; run "
                              "`imgtrain calibrate` again or use another checkpoint")
    return saved


def _class_means(fitted) -> bool:
    """None, or {"whitening": [D, D], "means": [K, D]} finite float tensors."""
    import torch

    if fitted is None:
        return True
    if not isinstance(fitted, dict) or not all(isinstance(fitted.get(k), torch.Tensor) for k in ("whitening", "means")):
        return False
    w, m = fitted["whitening"], fitted["means"]
    return (w.dim() == 2 and m.dim() == 2 and w.shape[0] == w.shape[1] == m.shape[1] and w.is_floating_point()
            and m.is_floating_point() and bool(torch.isfinite(w).all() and torch.isfinite(m).all()))


def unwrap(model):
    """The plain model inside DistributedDataParallel (``model.module``) or the model itself."""
    return getattr(model, "module", model)


# ---------------------------------------------------------------- checkpoints in a run directory


def listing(run_dir: Path) -> list[tuple[Path, dict]]:
    """Complete checkpoints (a valid meta.json) in a run directory, oldest first."""
    found = []
    if not run_dir.is_dir():
        return found
    for d in run_dir.iterdir():
        if d.is_dir() and POLICY.is_checkpoint(d.name) and (d / META_FILE).is_file():
            try:
                found.append((d, read_meta(d)))
            except CheckpointError:
                continue
    return sorted(found, key=lambda item: (item[1].get("step", 0), item[0].name))


def verified(run_dir: Path) -> tuple[list[Path], list[tuple[Path, str]]]:
    """(checkpoints whose files match their sha256, oldest first; [(checkpoint, why)] for the rest)."""
    good, bad = [], []
    for path, _ in listing(run_dir):
        try:
            verify(path)
            good.append(path)
        except CheckpointError as e:
            bad.append((path, str(e)))
    return good, bad


def remove_incomplete(run_dir: Path, keep=()) -> list[str]:
    """Delete checkpoint directories that fail verification (half written when the disk filled
    up or the process died), except those named in ``keep``; return the names removed."""
    import shutil

    removed = []
    for d in sorted(run_dir.iterdir()) if run_dir.is_dir() else []:
        if not d.is_dir() or not POLICY.is_checkpoint(d.name) or d.name in keep:
            continue
        try:
            verify(d)
        except CheckpointError:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d.name)
    return removed


def run_policy(found: list[tuple[Path, dict]]) -> CheckpointPolicy:
    """How the run whose checkpoints are ``found`` ranks them: by the --select-metric its newest
    checkpoint's config names (a run keeps the setting when resumed)."""
    return POLICY.for_config(found[-1][1].get("config")) if found else POLICY


def best_and_latest(run_dir: Path) -> tuple[Path | None, Path | None]:
    found = listing(run_dir)
    if not found:
        return None, None
    policy = run_policy(found)
    return max(found, key=lambda item: policy.rank_key(item[1]))[0], found[-1][0]


def average_of(found: list[tuple[Path, dict]]) -> Path | None:
    """The newest average checkpoint (--average-last) among ``found``; None without one."""
    averages = [path for path, meta in found if AVERAGE_KEY in meta]
    return averages[-1] if averages else None


def retain(run_dir: Path, policy: CheckpointPolicy, ignore=()) -> None:
    """Delete the checkpoints ``policy`` lets go (local backend; Ray Train does the same itself,
    from ``policy.ray_config()``). Checkpoints named in ``ignore`` (known damaged) are neither
    counted nor deleted."""
    import shutil

    for path in policy.expendable(listing(run_dir), damaged=ignore):
        shutil.rmtree(path, ignore_errors=True)


CHOICES = ("best", "latest", "average")  # what --checkpoint may name besides a directory


def choose(run_dir: Path, which: str, run_name: str) -> Path:
    """The ``best``, ``latest`` or ``average`` checkpoint of a run, verified. A damaged one is
    skipped, with a warning, for the best / latest / average of those that verify. ``best``
    ranks by the run's --select-metric."""
    found = listing(run_dir)
    if not found:
        raise ImgtrainError(f"run {run_name!r} has no complete checkpoint yet ({run_dir}); train it first")
    best, latest = best_and_latest(run_dir)
    chosen = {"best": best, "latest": latest, "average": average_of(found)}[which]
    if chosen is None:
        raise ImgtrainError(f"run {run_name!r} has no averaged checkpoint ({run_dir}); train it with "
                            "--average-last K, or pass --checkpoint best or latest")
    try:
        verify(chosen)
        return chosen
    except CheckpointError:
        pass
    good, bad = verified(run_dir)
    for path, why in bad:
        warnings.warn(f"skipping checkpoint {path.name}: {why}", DamagedCheckpointWarning, stacklevel=2)
    if not good:
        raise ImgtrainError(f"run {run_name!r} has no checkpoint that passes verification ({run_dir})")
    if which == "latest":
        return good[-1]
    metas = [(path, read_meta(path)) for path in good]
    if which == "average":
        if (path := average_of(metas)) is None:
            raise ImgtrainError(f"run {run_name!r} has no averaged checkpoint that passes verification ({run_dir})")
        return path
    policy = run_policy(found)
    return max(metas, key=lambda item: policy.rank_key(item[1]))[0]


class DamagedCheckpointWarning(ImgtrainWarning):
    """A checkpoint failed verification and was passed over for another one."""
