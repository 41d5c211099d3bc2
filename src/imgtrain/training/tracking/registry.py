"""The experiment trackers by name. Each tracker is a ``Tracker`` subclass (``base.py``) that
registers itself in its own module (``@register``) and says there what it is: its name, the
TrainConfig settings it reads (the first turns it on; which of them may hold a credential is said
where each is declared, ``setting(secret=True)``), the extra that installs it. The package's
``__init__.py`` imports the modules, in the order the trackers are opened; a tracker of one's own
registers where it likes (a test registers one).

Nothing here imports a tracker's library: ``require`` looks for it, the tracker imports it when
it opens."""

from __future__ import annotations

from imgtrain.config import TrainConfig, by_name
from imgtrain.errors import ImgtrainError
from imgtrain.training.tracking.base import Tracker

TRACKERS: dict[str, type[Tracker]] = {}
"""Every registered tracker by its ``key``, in the order of registration (the order they are opened)."""


def register(tracker: type[Tracker]) -> type[Tracker]:
    """Add a tracker (a class decorator). Its settings must be TrainConfig's."""
    if tracker.key in TRACKERS:
        raise ValueError(f"tracker {tracker.key!r} is registered twice")
    known = by_name()
    unknown = [s for s in tracker.settings if s not in known]
    if unknown:
        raise ValueError(f"tracker {tracker.key!r} reads settings TrainConfig does not have: {unknown}")
    TRACKERS[tracker.key] = tracker
    return tracker


def get(key: str) -> type[Tracker]:
    try:
        return TRACKERS[key]
    except KeyError:
        raise ImgtrainError(f"unknown tracker {key!r}; choose one of: {', '.join(TRACKERS)}") from None


def registered() -> list[type[Tracker]]:
    """Every tracker, in the order they are opened."""
    return list(TRACKERS.values())


def wanted(cfg: TrainConfig) -> list[type[Tracker]]:
    """The trackers ``cfg`` asks for."""
    return [kind for kind in TRACKERS.values() if kind.wanted(cfg)]


def require(cfg: TrainConfig) -> None:
    """Fail in seconds, before Ray starts, when a tracker is asked for but cannot be used
    (not installed; W&B without an API key)."""
    problems = [problem for kind in wanted(cfg) if (problem := kind.problem(cfg))]
    if problems:
        raise ImgtrainError("; ".join(problems))
