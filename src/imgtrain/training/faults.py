"""Faults injected on purpose, to test recovery with real failures (``IMGTRAIN_INJECT_FAULT``).

``KIND:RANK:STEP[:TIMES]`` makes rank RANK, about to train global step STEP, either raise an
exception (``raise``), stop making progress forever (``hang``) or SIGKILL its own process
(``kill``), at most TIMES times over the whole run (default 1; counted with marker files in the
run directory, so a retried or resumed attempt does not fail the same way again unless asked to).
``@RUN`` at the end fires it in the run named RUN only: one trial of a sweep, whose trials all
reach the same steps.

The process can also be killed at named moments after step STEP: ``kill-saving`` (a checkpoint
half copied into the run directory; local backend), ``kill-saved`` (the checkpoint is stored,
its record not yet sent) and ``kill-validating`` (during the epoch's validation). With the
local backend rank 0 is the driver itself: these are real SIGKILLs of ``imgtrain train``.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from imgtrain.errors import ImgtrainError

ENV_VAR = "IMGTRAIN_INJECT_FAULT"
KINDS = ("raise", "hang", "kill", "kill-saving", "kill-saved", "kill-validating")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int
    times: int = 1
    run: str | None = None  # the run's name (its folder's) it fires in; None: every run

    @property
    def point(self) -> str:
        """Where in the loop it fires: "step" (before training the step) or a named moment."""
        return self.kind.removeprefix("kill-") if self.kind.startswith("kill-") else "step"


class InjectedFault(RuntimeError):
    pass


def parse(text: str | None) -> Fault | None:
    if not text:
        return None
    spec, at, run = text.partition("@")
    parts = spec.split(":")
    try:
        kind, numbers = parts[0], [int(p) for p in parts[1:]]
        if kind not in KINDS or len(numbers) not in (2, 3) or (at and not run):
            raise ValueError
    except ValueError:
        raise ImgtrainError(f"{ENV_VAR}={text!r} is not KIND:RANK:STEP[:TIMES][@RUN] with KIND one of "
                            f"{', '.join(KINDS)}") from None
    return Fault(kind, *numbers, run=run or None)


def maybe_fire(fault: Fault | None, rank: int, step: int, run_dir: Path | None, point: str = "step") -> None:
    if fault is None or rank != fault.rank or step != fault.step or run_dir is None or point != fault.point:
        return
    if fault.run is not None and Path(run_dir).name != fault.run:
        return
    markers = Path(run_dir) / ".faults"
    markers.mkdir(parents=True, exist_ok=True)
    fired = sorted(markers.glob(f"{fault.kind}-{rank}-{step}-*"))
    if len(fired) >= fault.times:
        return
    (markers / f"{fault.kind}-{rank}-{step}-{len(fired) + 1}").touch()
    if fault.kind == "raise":
        raise InjectedFault(f"injected fault: rank {rank} raised at step {step} ({ENV_VAR})")
    if fault.kind.startswith("kill"):
        os.kill(os.getpid(), signal.SIGKILL)  # no handler, no cleanup: as a machine that dies
    while True:  # "hang": alive, but never finishes the step
        time.sleep(3600)
