"""The one progress display, fed by the records the ranks send (start, step, rank, epoch).

On a terminal: a rich progress bar over all the run's steps, with the epoch, loss, accuracy,
images/s, the share of step time spent waiting for data (the worst-fed rank's) and the time
left; one line is printed above it per finished epoch. Elsewhere (CI, pipes, log files): the
per-epoch lines, and a plain progress line every PLAIN_EVERY_S seconds.
"""

from __future__ import annotations

import collections
import time

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

PLAIN_EVERY_S = 30.0


def epoch_line(r: dict, epochs: int) -> str:
    wait = r.get("data_wait_fraction")
    return (
        f"epoch {r['epoch'] + 1:>3}/{epochs}  train_loss {r['train_loss']:.4f}  "
        f"train_acc {r['train_accuracy']:.2%}  val_loss {r['val_loss']:.4f}  "
        f"val_acc {r['val_accuracy']:.2%}  {r['images_per_s']:.0f} img/s  "
        + (f"data wait {wait:.0%}  " if wait is not None else "")
        + f"{r['epoch_time_s']:.1f}s"
    )


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class Eta:
    """Time left: the steps left at the recent step rate, plus one validation per epoch left.

    Only the records' own timestamps (rank 0's clock) are used. The rate comes from the step
    records of the current epoch (the gap across a validation is not a training step), and the
    validation time from the gap between an epoch's last step record and its epoch record.
    """

    def __init__(self):
        self.points: collections.deque = collections.deque(maxlen=30)  # (time, step)
        self.rate: float | None = None  # steps per second
        self.validation_s: float | None = None
        self.total_steps = self.epochs = 0

    def start(self, r: dict) -> None:
        self.total_steps, self.epochs = r["total_steps"], r["epochs"]
        self.points.clear()  # a new worker group: it may run at another pace

    def step(self, r: dict) -> None:
        self.points.append((r["time"], r["step"]))
        (t0, s0), (t1, s1) = self.points[0], self.points[-1]
        if t1 > t0 and s1 > s0:
            self.rate = (s1 - s0) / (t1 - t0)

    def epoch(self, r: dict) -> None:
        if self.points and self.points[-1][1] == r["step"]:
            self.validation_s = max(0.0, r["time"] - self.points[-1][0])
        self.points.clear()

    def seconds_left(self, step: int, epoch: int) -> float | None:
        if not self.rate:
            return None
        validations_left = max(0, self.epochs - epoch)  # this epoch's included
        return (self.total_steps - step) / self.rate + validations_left * (self.validation_s or 0.0)


class TrainingDisplay:
    def __init__(self, console: Console | None = None, quiet: bool = False):
        self.console = console or Console(stderr=False)
        self.quiet = quiet
        self.epochs = 0
        self.total_steps = 0
        self.progress: Progress | None = None
        self.task = None
        self.last_val = None
        self.eta = Eta()
        self.rank_wait: dict[int, float] = {}  # rank -> its share of step time waiting for data
        self.last_plain = time.monotonic()

    def pin_output(self) -> None:
        """Write to the current sys.stdout from now on, even if it is redirected later."""
        import sys

        if self.console.file is sys.stdout:
            self.console.file = sys.stdout

    def note(self, text: str) -> None:
        if not self.quiet:
            (self.progress.console if self.progress else self.console).print(
                text, highlight=False, markup=False, soft_wrap=True)

    def update(self, record: dict) -> None:
        if self.quiet:
            return
        kind = record.get("kind")
        if kind == "start":
            self._start(record)
        elif kind == "rank":
            self.rank_wait[record["rank"]] = record["data_wait_fraction"]
        elif kind == "step":
            self.eta.step(record)
            self._step(record)
        elif kind == "epoch":
            self.eta.epoch(record)
            self.last_val = record["val_accuracy"]
            self.note(epoch_line(record, self.epochs))
            if self.progress is not None:
                self.progress.update(self.task, completed=record["step"])

    def status(self, r: dict) -> str:
        """The figures shown beside the bar, from a step record."""
        wait = max(self.rank_wait.values(), default=r.get("data_wait_fraction", 0.0))
        left = self.eta.seconds_left(r["step"], r["epoch"])
        return (
            f"epoch {r['epoch'] + 1}/{self.epochs}  loss {r['loss']:.4f}  acc {r.get('accuracy', 0.0):.1%}"
            + (f"  val_acc {self.last_val:.2%}" if self.last_val is not None else "")
            + f"  {r['images_per_s']:.0f} img/s  data wait {wait:.0%}"
            + (f"  eta {format_duration(left)}" if left is not None else "")
        )

    def _step(self, r: dict) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=r["step"], status=self.status(r))
        elif time.monotonic() - self.last_plain >= PLAIN_EVERY_S:  # logs get a line now and then
            self.last_plain = time.monotonic()
            self.note(f"step {r['step']}/{self.total_steps}  {self.status(r)}")

    def _start(self, r: dict) -> None:
        self.epochs, self.total_steps = r["epochs"], r["total_steps"]
        self.eta.start(r)
        self.rank_wait.clear()  # ranks of an earlier worker group no longer report
        if r["step"] > 0:
            self.note(f"resuming at epoch {r['start_epoch'] + 1}, step {r['step']}")
        if not self.console.is_terminal:
            return
        if self.progress is None:
            self.progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("steps"),
                TimeElapsedColumn(), TextColumn("{task.fields[status]}"), console=self.console, transient=False,
            )
            self.progress.start()
            self.task = self.progress.add_task("train", total=r["total_steps"], status="")
        self.progress.update(self.task, total=r["total_steps"], completed=r["step"])

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
