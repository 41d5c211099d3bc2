"""Experiment tracking: MLflow (``--mlflow URI``), TensorBoard (``--tensorboard``) and Weights &
Biases (``--wandb PROJECT``), three implementations of one ``Tracker`` (``base.py``), each in its
own module that registers it (``registry.py``). Importing the package registers them, in the
order of the import line below, the order they are opened: a new tracker is one module, its
name in that line, and the ``setting(...)`` lines of what it reads in config.py.

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
# registered by being imported, in this order: the order they are opened
from imgtrain.training.tracking import mlflow_tracker, tensorboard_tracker, wandb_tracker
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
from imgtrain.training.tracking.registry import get, register, registered, require, wanted

__all__ = ["EPOCH_KEYS", "MODEL_FILES", "RANK_KEYS", "STEP_KEYS", "Tracker", "get", "metrics_of", "open_trackers",
           "params_of", "public_config", "public_uri", "register", "registered", "require", "scrub",
           "tracked_config", "wanted"]


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
