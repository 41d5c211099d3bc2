"""The one progress display, fed by the driver's start-up phases and the records the ranks
send (phase, start, step, rank, epoch).

Start-up (Ray starting, workers starting, data loading, the first steps) can take a minute: on
a terminal one updating line says what imgtrain waits for and for how long, replaced by the
bar at the first step; elsewhere each finished phase prints one line with its duration.

Then, on a terminal: a rich progress bar over all the run's steps, with the epoch, loss,
accuracy, images/s, the share of step time spent waiting for data (the worst-fed rank's) and
the time left; one line is printed above it per finished epoch, and after each validation the
bar shows that epoch's figures. Elsewhere (CI, pipes, log files): the per-epoch lines, and a
plain progress line every PLAIN_EVERY_S seconds.
"""

from __future__ import annotations

import collections
import time

from rich.console import Console
from rich.live import Live
from rich.progress import Progress
from rich.spinner import Spinner
from rich.text import Text

from imgtrain.console import SafeConsole

PLAIN_EVERY_S = 30.0
Figures = list  # [(what, its text)]: ("epoch", "epoch 3/12"), ("loss", "loss 0.4312"), ...

BAR_WIDTH = 40  # rich's own; a narrower terminal gets a shorter bar, down to BAR_MIN
BAR_MIN = 10
# What the bar's line gives up, in this order, when the terminal is too narrow for all of it. The
# epoch, the steps, loss, accuracy, images/s and the ETA stay: 80 columns hold them (rich cut the
# line at the right and squeezed the rest to "t… s…" instead).
NARROWING = ("elapsed", "label", "wait", "steps_word", "val_acc", "bar")


def joined(figures: Figures) -> str:
    return "  ".join(text for _, text in figures)


def fitted(width: int, figures: Figures, completed: int, total: int, elapsed: str) -> tuple[str, int, str]:
    """The bar's line at ``width`` columns: (the label before the bar, the bar's width (0: no
    bar), the words after it), what matters least left out first (NARROWING)."""
    from rich.cells import cell_len

    left_out: set[str] = set()
    for narrower in (None, *NARROWING):
        left_out.add(narrower)
        label = "" if "label" in left_out else "train"
        words = [f"{completed}/{total}" + ("" if "steps_word" in left_out else " steps")]
        words += [] if "elapsed" in left_out else [elapsed]
        after = " ".join(words) + "  " + joined([f for f in figures if f[0] not in left_out])
        room = width - cell_len(after) - (cell_len(label) + 1 if label else 0) - 1  # a space each side of the bar
        if "bar" in left_out:
            return label, 0, after
        if room >= BAR_MIN:
            return label, min(BAR_WIDTH, room), after
    raise AssertionError("unreachable: the last narrowing leaves the bar out")


class FittedBar(Progress):
    """rich's progress display with one line per task laid out by ``fitted`` for the console's
    width now (a terminal may be resized while a run trains)."""

    def get_renderables(self):
        from datetime import timedelta

        from rich.progress_bar import ProgressBar
        from rich.table import Table

        for task in self.tasks:
            elapsed = str(timedelta(seconds=max(0, int(task.elapsed or 0))))  # as rich's TimeElapsedColumn
            label, bar, after = fitted(self.console.width, task.fields.get("figures") or [], int(task.completed),
                                       int(task.total or 0), elapsed)
            line = Table.grid(padding=(0, 1))
            cells = ([Text(label, style="bold")] if label else []) + (
                [ProgressBar(total=task.total, completed=task.completed, width=bar)] if bar else []) + [
                Text(after, no_wrap=True, overflow="ellipsis")]
            for _ in cells:
                line.add_column(no_wrap=True)
            line.add_row(*cells)
            yield line


def epoch_line(r: dict, epochs: int) -> str:
    """One epoch record as the display prints it; a number the record lacks shows as '?'."""
    def num(key: str, spec: str) -> str:
        return format(r[key], spec) if key in r else "?"

    wait = r.get("data_wait_fraction")
    return (
        f"epoch {r['epoch'] + 1:>3}/{epochs}  train_loss {num('train_loss', '.4f')}  "
        f"train_acc {num('train_accuracy', '.2%')}  val_loss {num('val_loss', '.4f')}  "
        f"val_acc {num('val_accuracy', '.2%')}  " + (f"val_mAP {r['val_map']:.4f}  " if "val_map" in r else "")
        + f"{num('images_per_s', '.0f')} img/s  "
        + (f"data wait {wait:.0%}  " if wait is not None else "")
        + f"{num('epoch_time_s', '.1f')}s"
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


class StartupLine:
    """The updating start-up line: what imgtrain waits for, since when, and the start-up so far
    (rendered afresh at each refresh of the live display)."""

    def __init__(self, name: str, now: float):
        self.name, self.since, self.started = name, now, now
        self.spinner = Spinner("dots")

    def __rich__(self) -> Spinner:
        now = time.monotonic()
        self.spinner.update(text=Text(f"{self.name}  {now - self.since:.0f} s  "
                                      f"(start-up {format_duration(now - self.started)})"))
        return self.spinner


class Output:
    """The display's stream. Once writing to it fails (the terminal closed: EIO; a pipe whose
    reader is gone: EPIPE) it takes every later write without a word: a run must stop (a
    hangup) or go on as it would, never fail because its progress could not be shown, and rich's
    refresh thread must not die with a traceback."""

    def __init__(self, stream):
        self.stream, self.gone = stream, False

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                return self.stream.write(text)
            except OSError:
                self.gone = True
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            try:
                self.stream.flush()
            except OSError:
                self.gone = True

    def __getattr__(self, name):  # isatty, fileno, encoding: the stream's own
        return getattr(self.stream, name)


class TrainingDisplay:
    def __init__(self, console: Console | None = None, quiet: bool = False):
        self.console = console or SafeConsole(stderr=False)
        self.quiet = quiet
        self.epochs = 0
        self.total_steps = 0
        self.phase_now: tuple[str, float] | None = None  # the start-up phase under way, since when
        self.startup: Live | None = None  # its updating line, on a terminal
        self.startup_line: StartupLine | None = None
        self.training = False  # the first step (or epoch) record has come: start-up is over
        self.progress: Progress | None = None
        self.task = None
        self.last_val = None
        self.figures: Figures = []  # what the bar shows now, its ETA left out
        self.eta = Eta()
        self.rank_wait: dict[int, float] = {}  # rank -> its share of step time waiting for data
        self.last_plain = time.monotonic()
        self.pinned = False  # pin_output fixed the console's file

    def pin_output(self) -> None:
        """Write to the current sys.stdout from now on, even if it is redirected later, until
        ``close`` (the console is the caller's: the CLI's module-wide one, in-process)."""
        import sys

        if self.console.file is sys.stdout:
            self.console.file = Output(sys.stdout)
            self.pinned = True

    def note(self, text: str) -> None:
        if not self.quiet:
            (self.progress.console if self.progress else self.console).print(
                text, highlight=False, markup=False, soft_wrap=True)

    def phase(self, name: str) -> None:
        """Start-up now waits for ``name`` (the driver's own steps, or a worker's phase record);
        the previous phase is over. Once training has started (a worker group restarting after
        a failure), the bar stays."""
        if self.quiet or self.training:
            return
        self._end_phase()
        now = time.monotonic()
        self.phase_now = (name, now)
        if not self.console.is_terminal:
            return
        if self.startup is None:
            self.startup_line = StartupLine(name, now)
            # Not sys.stdout and sys.stderr: Ray writes there, into the run's logs (process.output_to);
            # rich's redirection would bring its messages onto the screen.
            self.startup = Live(self.startup_line, console=self.console, refresh_per_second=4, transient=True,
                                redirect_stdout=False, redirect_stderr=False)
            self.startup.start()
        self.startup_line.name, self.startup_line.since = name, now
        self.startup.refresh()

    def _end_phase(self, outcome: str | None = None) -> None:
        """The phase under way is over: its line with its duration, off a terminal (a CI log
        tells where the start-up time went), and on a terminal too when the run stops in it."""
        if self.phase_now is None:
            return
        name, since = self.phase_now
        self.phase_now = None
        if outcome or not self.console.is_terminal:
            self.note(f"{name}: {time.monotonic() - since:.1f} s" + (f" ({outcome})" if outcome else ""))

    def _end_startup(self, outcome: str | None = None) -> None:
        self._end_phase(outcome)
        if self.startup is not None:
            self.startup.stop()  # transient: the bar takes its place
            self.startup = None

    def update(self, record: dict) -> None:
        if self.quiet:
            return
        kind = record.get("kind")
        if kind == "phase":
            self.phase(record["phase"])
        elif kind == "start":
            self._start(record)
        elif kind == "rank":
            self.rank_wait[record["rank"]] = record["data_wait_fraction"]
        elif kind == "step":
            self._begin_training()
            self.eta.step(record)
            self._step(record)
        elif kind == "epoch":
            self._begin_training()
            self.eta.epoch(record)
            self.last_val = record["val_accuracy"]
            self.note(epoch_line(record, self.epochs))
            if self.progress is not None:  # the epoch's own figures, never the last step's
                self.progress.update(self.task, completed=record["step"], figures=self.epoch_status(record),
                                     refresh=True)
        elif kind == "average":  # --average-last's checkpoint, after the last epoch
            epochs = ", ".join(str(e + 1) for e in record.get("epochs", []))
            self.note(f"average of epochs {epochs}: val_loss {record['val_loss']:.4f}  "
                      f"val_acc {record['val_accuracy']:.2%}  val_f1_macro {record['val_f1_macro']:.4f}")

    def status(self, r: dict) -> Figures:
        """The figures shown beside the bar, from a step record."""
        wait = max(self.rank_wait.values(), default=r.get("data_wait_fraction", 0.0))
        left = self.eta.seconds_left(r["step"], r["epoch"])
        return self._status(r["epoch"], r["loss"], r.get("accuracy", 0.0), r["images_per_s"], wait, left)

    def epoch_status(self, r: dict) -> Figures:
        """The figures beside the bar once epoch ``r`` is validated: that epoch's own (train
        loss and accuracy, val_acc, img/s, data wait), and the time left only while steps are."""
        left = self.eta.seconds_left(r["step"], r["epoch"] + 1) if r["step"] < self.total_steps else None
        wait = r.get("data_wait_fraction") or 0.0
        return self._status(r["epoch"], r["train_loss"], r["train_accuracy"], r["images_per_s"], wait, left)

    def _status(self, epoch: int, loss: float, acc: float, images_per_s: float, wait: float, left) -> Figures:
        self.figures = [("epoch", f"epoch {epoch + 1}/{self.epochs}"), ("loss", f"loss {loss:.4f}"),
                        ("acc", f"acc {acc:.1%}")]
        if self.last_val is not None:
            self.figures.append(("val_acc", f"val_acc {self.last_val:.2%}"))
        self.figures += [("speed", f"{images_per_s:.0f} img/s"), ("wait", f"data wait {wait:.0%}")]
        return self.figures + ([("eta", f"eta {format_duration(left)}")] if left is not None else [])

    def _step(self, r: dict) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=r["step"], figures=self.status(r), refresh=True)
        elif time.monotonic() - self.last_plain >= PLAIN_EVERY_S:  # logs get a line now and then
            self.last_plain = time.monotonic()
            self.note(f"step {r['step']}/{self.total_steps}  {joined(self.status(r))}")

    def _start(self, r: dict) -> None:
        self.epochs, self.total_steps = r["epochs"], r["total_steps"]
        self.eta.start(r)
        self.rank_wait.clear()  # ranks of an earlier worker group no longer report
        if r["step"] > 0:
            self.note(f"resuming at epoch {r['start_epoch'] + 1}, step {r['step']}")
        if self.progress is not None:  # a worker group restarted: from its checkpoint's step, no ETA yet
            self.progress.update(self.task, total=r["total_steps"], completed=r["step"], figures=self.figures)

    def _begin_training(self) -> None:
        """The first step record: the start-up line gives way to the bar."""
        if self.training:
            return
        self.training = True
        self._end_startup()
        if self.console.is_terminal:
            self.progress = FittedBar(console=self.console, transient=False,
                                      redirect_stdout=False, redirect_stderr=False)  # as the start-up line
            self.progress.start()
            self.task = self.progress.add_task("train", total=self.total_steps, figures=[])

    def close(self, outcome: str | None = None) -> None:
        """Stop the display. ``outcome`` ("failed", "interrupted") when the run stops early: the
        start-up phase it stopped in is printed, or the bar's last figures lose their ETA and
        say so."""
        self._end_startup(outcome)
        if self.progress is not None:
            if outcome and self.figures:
                self.progress.update(self.task, figures=[*self.figures, ("outcome", outcome)])
            self.progress.stop()
            self.progress = None
        if self.pinned:  # follows sys.stdout again, as before pin_output
            self.console.file = None
            self.pinned = False
