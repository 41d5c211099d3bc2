"""Experiment tracking: MLflow (``--mlflow URI``), TensorBoard (``--tensorboard``) and Weights &
Biases (``--wandb PROJECT``), three implementations of one ``Tracker`` (``base.py``).

Only rank 0's records (and each rank's own timing records) reach the trackers, through the
driver: the same records that go to ``metrics.jsonl`` and the progress display. Logging from
the driver means one tracker run per imgtrain run however often the worker group is restarted,
and the workers never wait for a tracking server. The trackers are optional extras
(``pip install 'imgtrain[mlflow]'``, ``'imgtrain[tensorboard]'``, ``'imgtrain[wandb]'``); the base
install stays lean, and nothing here imports them until a tracker is asked for.

Metric names, the same in all (x axis: the global optimizer step):
  step/loss, step/accuracy, step/images_per_s, step/data_wait_fraction, step/lr
  epoch/train_loss, epoch/train_accuracy, epoch/val_loss, epoch/val_accuracy,
  epoch/images_per_s, epoch/data_wait_fraction, epoch/epoch_time_s
  rank{R}/step_time_s, rank{R}/data_wait_s, rank{R}/data_wait_fraction
"""

from __future__ import annotations

from pathlib import Path

from imgtrain.config import TrainConfig
from imgtrain.errors import ImgtrainError
from imgtrain.training.tracking.base import (
    EPOCH_KEYS,
    MODEL_FILES,
    RANK_KEYS,
    STEP_KEYS,
    Tracker,
    first_line,
    metrics_of,
    params_of,
    public_config,
    public_uri,
    scrub,
    tracked_config,
)
from imgtrain.training.tracking.mlflow_tracker import MLFLOW_RUN_FILE, MLflowTracker
from imgtrain.training.tracking.tensorboard_tracker import TENSORBOARD_DIR, TensorBoardTracker
from imgtrain.training.tracking.wandb_tracker import WANDB_RUN_FILE, WandbTracker

__all__ = ["EPOCH_KEYS", "MLFLOW_RUN_FILE", "MODEL_FILES", "RANK_KEYS", "STEP_KEYS", "TENSORBOARD_DIR", "TRACKERS",
           "WANDB_RUN_FILE", "MLflowTracker", "TensorBoardTracker", "Tracker", "WandbTracker", "metrics_of",
           "open_trackers", "params_of", "public_config", "public_uri", "require", "scrub", "tracked_config", "wanted"]

TRACKERS: tuple[type[Tracker], ...] = (MLflowTracker, TensorBoardTracker, WandbTracker)  # opened in this order


def wanted(cfg: TrainConfig) -> list[type[Tracker]]:
    """The trackers ``cfg`` asks for."""
    return [kind for kind in TRACKERS if kind.wanted(cfg)]


def require(cfg: TrainConfig) -> None:
    """Fail in seconds, before Ray starts, when a tracker is asked for but cannot be used
    (not installed; W&B without an API key)."""
    problems = [problem for kind in wanted(cfg) if (problem := kind.problem(cfg))]
    if problems:
        raise ImgtrainError("; ".join(problems))


def open_trackers(cfg: TrainConfig, run_dir: Path, manifest: dict, note) -> list:
    """The trackers ``cfg`` asks for, open, each behind a guard that turns a failure mid-run into
    one warning (``note``). One that cannot open raises ImgtrainError; those opened before it end
    as failed."""
    opened = []
    try:
        for kind in wanted(cfg):
            opened.append(kind(cfg, run_dir, manifest))
            if opened[-1].opened:
                note(opened[-1].opened)
    except BaseException:
        for tracker in opened:
            _Guarded(tracker, note).finish("failed", None)
        raise
    return [_Guarded(t, note) for t in opened]


class _Guarded:
    """A tracker failing mid-run (a tracking server gone) warns once; training goes on."""

    def __init__(self, tracker: Tracker, note):
        self.tracker, self.note, self.failed = tracker, note, False

    def log(self, record: dict) -> None:
        self._call(self.tracker.log, record)

    def finish(self, status: str, best_checkpoint: Path | None) -> None:
        try:
            self._call(self.tracker.finish, status, best_checkpoint)
        finally:
            self.tracker.close()  # even after a failure: what it changed in the process is put back

    def _call(self, method, *args) -> None:
        if self.failed:
            return
        try:
            method(*args)
        except Exception as e:  # never let tracking fail the training it tracks
            self.failed = True
            self.note(f"warning: {self.tracker.name} logging stopped: {first_line(e)}")
