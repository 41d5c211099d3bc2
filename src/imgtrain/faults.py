"""Faults injected on purpose, to test recovery with real failures (``IMGTRAIN_INJECT_FAULT``).

``KIND:RANK:STEP[:TIMES]`` makes rank RANK, about to train global step STEP, either raise an
exception (``raise``) or stop making progress forever (``hang``), at most TIMES times over the
whole run (default 1; counted with marker files in the run directory, so a retried or resumed
attempt does not fail the same way again unless asked to).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from imgtrain.errors import ImgtrainError

ENV_VAR = "IMGTRAIN_INJECT_FAULT"
KINDS = ("raise", "hang")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int
    times: int = 1


class InjectedFault(RuntimeError):
    pass


def parse(text: str | None) -> Fault | None:
    if not text:
        return None
    parts = text.split(":")
    try:
        kind, numbers = parts[0], [int(p) for p in parts[1:]]
        if kind not in KINDS or len(numbers) not in (2, 3):
            raise ValueError
    except ValueError:
        raise ImgtrainError(f"{ENV_VAR}={text!r} is not KIND:RANK:STEP[:TIMES] with KIND one of {', '.join(KINDS)}") from None
    return Fault(kind, *numbers)


def maybe_fire(fault: Fault | None, rank: int, step: int, run_dir: Path | None) -> None:
    if fault is None or rank != fault.rank or step != fault.step or run_dir is None:
        return
    markers = Path(run_dir) / ".faults"
    markers.mkdir(parents=True, exist_ok=True)
    fired = sorted(markers.glob(f"{fault.kind}-{rank}-{step}-*"))
    if len(fired) >= fault.times:
        return
    (markers / f"{fault.kind}-{rank}-{step}-{len(fired) + 1}").touch()
    if fault.kind == "raise":
        raise InjectedFault(f"injected fault: rank {rank} raised at step {step} ({ENV_VAR})")
    while True:  # "hang": alive, but never finishes the step
        time.sleep(3600)
