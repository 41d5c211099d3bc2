"""The one progress display, fed by the records rank 0 sends (start, step, epoch).

On a terminal: a rich progress bar (epoch, step, loss, images/s, ETA) with one line printed
above it per finished epoch. Elsewhere (CI, pipes, logs): just the per-epoch lines.
"""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def epoch_line(r: dict, epochs: int) -> str:
    return (
        f"epoch {r['epoch'] + 1:>3}/{epochs}  train_loss {r['train_loss']:.4f}  "
        f"train_acc {r['train_accuracy']:.2%}  val_loss {r['val_loss']:.4f}  "
        f"val_acc {r['val_accuracy']:.2%}  {r['images_per_s']:.0f} img/s  {r['epoch_time_s']:.1f}s"
    )


class TrainingDisplay:
    def __init__(self, console: Console | None = None, quiet: bool = False):
        self.console = console or Console(stderr=False)
        self.quiet = quiet
        self.epochs = 0
        self.progress: Progress | None = None
        self.task = None
        self.last_val = None

    def pin_output(self) -> None:
        """Write to the current sys.stdout from now on, even if it is redirected later."""
        import sys

        if self.console.file is sys.stdout:
            self.console.file = sys.stdout

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def note(self, text: str) -> None:
        if not self.quiet:
            (self.progress.console if self.progress else self.console).print(text, highlight=False, markup=False)

    def update(self, record: dict) -> None:
        if self.quiet:
            return
        kind = record.get("kind")
        if kind == "start":
            self._start(record)
        elif kind == "step" and self.progress is not None:
            val = f"  val_acc {self.last_val:.2%}" if self.last_val is not None else ""
            self.progress.update(
                self.task, completed=record["step"],
                status=f"epoch {record['epoch'] + 1}/{self.epochs}  loss {record['loss']:.4f}{val}  "
                f"{record['images_per_s']:.0f} img/s",
            )
        elif kind == "epoch":
            self.last_val = record["val_accuracy"]
            self.note(epoch_line(record, self.epochs))
            if self.progress is not None:
                self.progress.update(self.task, completed=record["step"])

    def _start(self, r: dict) -> None:
        self.epochs = r["epochs"]
        if r["step"] > 0:
            self.note(f"resuming at epoch {r['start_epoch'] + 1}, step {r['step']}")
        if not self.console.is_terminal:
            return
        if self.progress is None:
            self.progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("steps"),
                TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                TextColumn("{task.fields[status]}"), console=self.console, transient=False,
            )
            self.progress.start()
            self.task = self.progress.add_task("train", total=r["total_steps"], status="")
        self.progress.update(self.task, total=r["total_steps"], completed=r["step"])

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
