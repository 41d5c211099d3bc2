"""The checkpoint policy: what a run's checkpoints are called, which one is best and which are
kept. One object drives both retentions, the local backend's (``checkpoint.retain``) and Ray
Train's (``ray_config``: its ``CheckpointConfig``), so they cannot disagree; a new checkpoint
rule is a change here. Pure rules: storage/checkpoint.py reads and deletes the folders.

Names: ``checkpoint_epoch_0003`` at the end of epoch 3; ``checkpoint_epoch_0003_step_0000120``
inside it, after global step 120; ``checkpoint_epoch_0011_average`` the average of the last
epochs' weights (``--average-last``) made after epoch 11, the last; ``...-2``, ``...-3`` when a
damaged checkpoint still holds the name (Ray Train's retention deletes by path, and would delete
the replacement along with the damaged original).

Ranking: by the run's ``--select-metric`` (``for_metric``; a reader takes it from the run's
config, ``for_config``), which also drives early stopping (``stopped_early``): a pure function
of the epoch history, so every rank, a resumed run and a reader of the run decide alike.
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Literal

PREFIX = "checkpoint_"
# Ray Train v2's own record of the run's checkpoints, written beside them
# (ray/train/v2/_internal/constants.py: CHECKPOINT_MANAGER_SNAPSHOT_FILENAME) at a path no
# setting changes, and read back from there when the run is resumed. Nothing may take it for a
# checkpoint; between two fits of a run in a folder it is parked under a hidden name
# (RAY_SNAPSHOT_PARKED, ray_backend), so that `ls runs/NAME/checkpoint_*` lists checkpoints only.
RAY_SNAPSHOT_FILE = "checkpoint_manager_snapshot.json"
RAY_SNAPSHOT_PARKED = ".ray_checkpoint_manager_snapshot.json"

_NAME = re.compile(rf"{PREFIX}epoch_(\d{{4,}})(?:_step_(\d{{7,}})|(_average))?(?:-(\d+))?")
AVERAGE_SUFFIX = "_average"

# The metrics a run's checkpoints can be ranked by (--select-metric), each with its direction.
# val_map: multi-label data sets only (training/multilabel.py)
SELECTION_METRICS = {"val_accuracy": "max", "val_loss": "min", "val_f1_macro": "max", "val_map": "max"}
MULTI_LABEL_METRICS = ("val_map",)
DEFAULT_METRIC = "val_accuracy"


@dataclass(frozen=True)
class CheckpointName:
    """A checkpoint's folder name read back."""

    epoch: int
    step: int | None  # None: taken at the end of the epoch
    copy: int = 1  # 2, 3, ...: the name of a damaged checkpoint was taken
    average: bool = False  # the average of the last epochs' weights, made after ``epoch``


@dataclass(frozen=True)
class EarlyStop:
    """Why a run stopped before its last epoch (``CheckpointPolicy.stopped_early``); epochs 0-based."""

    epoch: int  # the last epoch trained
    best_epoch: int | None  # the last one that improved the metric (None: none gave a number)
    best: float | None  # its value
    metric: str
    patience: int

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class CheckpointPolicy:
    metric: str = "val_accuracy"
    """The metric of a checkpoint's record that ranks it."""
    mode: Literal["max", "min"] = "max"
    """Whether the highest (max) or the lowest (min) ``metric`` is the best."""
    unevaluated: float = -1.0
    """What a checkpoint taken inside an epoch, never validated, records as ``metric``: worse than
    every evaluated one. Finite: Ray's snapshot turns -inf into null and then fails on it. For a
    metric minimised, the largest float (``for_metric``)."""
    num_to_keep: int | None = None
    """The best checkpoints kept, the latest always in addition (--num-to-keep); None: all."""

    def keeping(self, num_to_keep: int) -> CheckpointPolicy:
        """This policy for a run that keeps ``num_to_keep`` best checkpoints."""
        return dataclasses.replace(self, num_to_keep=num_to_keep)

    def for_metric(self, metric: str) -> CheckpointPolicy:
        """This policy ranking by ``metric`` (one of SELECTION_METRICS: a run's --select-metric)."""
        mode = SELECTION_METRICS[metric]
        return dataclasses.replace(self, metric=metric, mode=mode,
                                   unevaluated=-1.0 if mode == "max" else sys.float_info.max)

    def for_config(self, config: dict | None) -> CheckpointPolicy:
        """The policy of the run whose config (config.json, or a checkpoint's meta.json
        ``config``) is ``config``: what reads a run ranks its checkpoints as training did. A
        config without the setting (older runs) or with a value it does not know: the default."""
        metric = config.get("select_metric") if isinstance(config, dict) else None
        return self.for_metric(metric if isinstance(metric, str) and metric in SELECTION_METRICS else DEFAULT_METRIC)

    # ---------------------------------------------------------------- names

    def epoch_name(self, epoch: int, taken: Iterable[str] = ()) -> str:
        """The checkpoint at the end of ``epoch`` (0-based); not one of the names in ``taken``."""
        return _free(f"{PREFIX}epoch_{epoch:04d}", taken)

    def step_name(self, epoch: int, step: int, taken: Iterable[str] = ()) -> str:
        """The checkpoint inside ``epoch`` after global optimizer step ``step``."""
        return _free(f"{PREFIX}epoch_{epoch:04d}_step_{step:07d}", taken)

    def average_name(self, epoch: int, taken: Iterable[str] = ()) -> str:
        """The average of the last epochs' weights, made after ``epoch`` (the last trained). It
        sorts after that epoch's own checkpoint (same step): the run's latest."""
        return _free(f"{PREFIX}epoch_{epoch:04d}{AVERAGE_SUFFIX}", taken)

    def parse(self, name: str) -> CheckpointName | None:
        """The epoch, step and copy a name stands for; None for a name this policy never gives."""
        found = _NAME.fullmatch(name)
        if not found:
            return None
        epoch, step, average, copy = found.groups()
        return CheckpointName(int(epoch), None if step is None else int(step), int(copy or 1), bool(average))

    def is_checkpoint(self, name: str) -> bool:
        """Whether an entry of a run folder is one of its checkpoints by name (its meta.json
        then tells whether it is whole): Ray's snapshot file shares the prefix."""
        return name.startswith(PREFIX) and name != RAY_SNAPSHOT_FILE

    # ---------------------------------------------------------------- ranking

    def unevaluated_metrics(self) -> dict:
        """The ranking metric a checkpoint taken inside an epoch reports."""
        return {self.metric: self.unevaluated}

    def rank_key(self, meta: dict) -> tuple[bool, float, int]:
        """How good a checkpoint is, from its meta.json: ``metric``, then the later one (as Ray
        Train breaks ties: by report order). One without the metric (or with anything but a
        number there) counts as ``unevaluated``; NaN (a diverged run's loss) ranks below
        everything, as in Ray Train's retention."""
        value = (meta.get("metrics") or {}).get(self.metric, self.unevaluated)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            value = self.unevaluated
        step = meta.get("step", 0)
        if math.isnan(value):
            return False, -math.inf, step
        return True, (value if self.mode == "max" else -value), step

    # ---------------------------------------------------------------- early stopping

    def stopped_early(self, history: list[dict], patience: int, min_delta: float = 0.0) -> EarlyStop | None:
        """Whether a run with this epoch ``history`` (the records every checkpoint carries)
        stops before its next epoch: ``metric`` has not improved on its best by more than
        ``min_delta`` for ``patience`` epochs. None: go on (or ``patience`` 0: never stop). A
        pure function of the records, so every rank (they hold the same all-reduced metrics),
        a resumed run and a reader of the finished run all decide alike."""
        if not patience:
            return None
        best = best_epoch = None
        stale = 0
        epochs = [r for r in history if r.get("kind", "epoch") == "epoch"]
        sign = 1 if self.mode == "max" else -1
        for record in epochs:
            value = record.get(self.metric)
            if _is_number(value) and not math.isnan(value) and (best is None or sign * (value - best) > min_delta):
                best, best_epoch, stale = value, record.get("epoch"), 0
            else:
                stale += 1
        if not epochs or stale < patience:
            return None
        return EarlyStop(epoch=epochs[-1].get("epoch"), best_epoch=best_epoch, best=best, metric=self.metric,
                         patience=patience)

    # ---------------------------------------------------------------- retention

    def expendable(self, found: list[tuple[Path, dict]], damaged: Iterable[str] = ()) -> list[Path]:
        """The checkpoints to delete among ``found`` ((folder, meta), oldest first): all but the
        ``num_to_keep`` best and the latest. Those named in ``damaged`` are neither counted nor
        deleted (the driver deals with them)."""
        damaged = set(damaged)
        found = [(path, meta) for path, meta in found if path.name not in damaged]
        if not found or self.num_to_keep is None:
            return []
        ranked = sorted(found, key=lambda item: self.rank_key(item[1]), reverse=True)
        keep = {path for path, _ in ranked[:self.num_to_keep]} | {found[-1][0]}
        return [path for path, _ in found if path not in keep]

    def ray_config(self):
        """Ray Train's ``CheckpointConfig`` with this policy's ranking and retention: Ray keeps
        the ``num_to_keep`` best by ``metric`` and always the latest, as ``expendable`` does."""
        import ray.train

        return ray.train.CheckpointConfig(num_to_keep=self.num_to_keep, checkpoint_score_attribute=self.metric,
                                          checkpoint_score_order=self.mode)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _free(name: str, taken: Iterable[str]) -> str:
    taken = set(taken)
    k, candidate = 1, name
    while candidate in taken:
        k += 1
        candidate = f"{name}-{k}"
    return candidate


POLICY = CheckpointPolicy()
"""imgtrain's checkpoint policy with the default metric: names are the same for every run. A
run's ranking: ``POLICY.for_metric(cfg.select_metric)`` (a reader: ``POLICY.for_config(config)``),
and ``.keeping(cfg.num_to_keep)`` for its retention."""
