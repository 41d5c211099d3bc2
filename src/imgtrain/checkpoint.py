"""The checkpoint format, used by training (save, resume) and inference (load).

A checkpoint directory holds:
  model.pt        the unwrapped ``state_dict`` of the model that was evaluated (the moving
                  average of the weights when EMA is on); the Ray tutorial's own inference code,
                  ``build_model().load_state_dict(torch.load("model.pt", weights_only=True))``, loads it
  train_state.pt  optimizer, scheduler, epoch, step, RNG states: plain types and tensors only,
                  so it loads with ``weights_only=True``
  meta.json       config, model args, data set summary, metrics, and the sha256 of the two files
                  above. Written last: a directory without a valid meta.json is not a checkpoint.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

from imgtrain.errors import ImgtrainError
from imgtrain.ops.files import atomic_write_text, sha256_file

MODEL_FILE = "model.pt"
TRAIN_STATE_FILE = "train_state.pt"
META_FILE = "meta.json"
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

# meta.json: the epoch records of every epoch up to this checkpoint (its own included), so the
# run's history can be rebuilt from the checkpoint a run resumes from
HISTORY_KEY = "history"


class CheckpointError(ImgtrainError):
    """A checkpoint is missing, incomplete, tampered with, or of an incompatible model."""


def save(directory: str | os.PathLike, model_state: dict, train_state: dict, meta: dict) -> Path:
    """Write a checkpoint into ``directory`` (created); meta.json last, with every file's sha256."""
    import torch

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    torch.save(model_state, d / MODEL_FILE)
    torch.save(train_state, d / TRAIN_STATE_FILE)
    meta = dict(meta, format_version=FORMAT_VERSION)
    meta["sha256"] = {name: sha256_file(d / name) for name in (MODEL_FILE, TRAIN_STATE_FILE)}
    atomic_write_text(d / META_FILE, json.dumps(meta, indent=2, default=str))
    return d


def read_meta(directory: str | os.PathLike) -> dict:
    d = Path(directory)
    path = d / META_FILE
    if not path.is_file():
        raise CheckpointError(f"{d} is not a complete imgtrain checkpoint: {META_FILE} is missing")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is corrupt ({e}); use another checkpoint") from None


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
    """Check every file against the sha256 in meta.json; return the meta or raise naming the file."""
    d = Path(directory)
    meta = read_meta(d)
    hashes = meta.get("sha256") or {}
    for name in (MODEL_FILE, TRAIN_STATE_FILE):
        expected = hashes.get(name)
        if not expected:
            raise CheckpointError(f"{d / META_FILE} records no sha256 for {name}; the checkpoint cannot be verified")
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


def unwrap(model):
    """The plain model inside DistributedDataParallel (``model.module``) or the model itself."""
    return getattr(model, "module", model)
