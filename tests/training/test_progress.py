import io
import re

from rich.console import Console

from imgtrain.training.progress import Eta, TrainingDisplay, format_duration


def start(step=0, total=40, epochs=4, t=0.0):
    return {"kind": "start", "step": step, "start_epoch": step // 10, "epochs": epochs, "total_steps": total,
            "steps_per_epoch": 10, "time": t}


def step(s, t, epoch=None, **extra):
    return {"kind": "step", "epoch": (s - 1) // 10 if epoch is None else epoch, "step": s, "loss": 0.5,
            "accuracy": 0.9, "lr": 0.001, "images_per_s": 250.0, "data_wait_fraction": 0.02, "time": t, **extra}


def epoch(e, s, t):
    return {"kind": "epoch", "epoch": e, "step": s, "train_loss": 0.4, "train_accuracy": 0.9, "val_loss": 0.3,
            "val_accuracy": 0.95, "images_per_s": 250.0, "epoch_time_s": 12.0, "data_wait_fraction": 0.05,
            "time": t}


def test_eta_is_steps_left_at_the_recent_rate_plus_a_validation_per_epoch_left():
    eta = Eta()
    eta.start(start())
    assert eta.seconds_left(0, 0) is None  # no rate yet
    for s in range(1, 11):  # 2 steps per second
        eta.step(step(s, s * 0.5))
    eta.epoch(epoch(0, 10, 5.0 + 3.0))  # validation and checkpoint took 3 s
    assert eta.validation_s == 3.0
    eta.step(step(12, 9.0))  # the gap across the validation is not a step rate
    assert eta.rate == 2.0
    # 28 steps at 2/s, plus validations at the end of epochs 2, 3 and 4
    assert eta.seconds_left(12, 1) == 28 / 2 + 3 * 3.0


def test_a_resumed_run_does_not_count_the_resumed_steps_as_speed():
    eta = Eta()
    eta.start(start(step=30))
    eta.step(step(32, 100.0))
    eta.step(step(34, 101.0))
    assert eta.rate == 2.0 and eta.seconds_left(34, 3) == 3.0


def test_the_terminal_bar_shows_loss_accuracy_speed_data_wait_and_eta():
    out = io.StringIO()
    display = TrainingDisplay(Console(file=out, force_terminal=True, width=200, color_system=None))
    display.update(start())
    display.update({"kind": "rank", "rank": 1, "step": 2, "data_wait_fraction": 0.31})
    display.update(step(2, 1.0))
    display.update(step(4, 2.0))
    display.close()
    text = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", out.getvalue())
    assert "4/40 steps" in text
    assert "epoch 1/4  loss 0.5000  acc 90.0%  250 img/s  data wait 31%  eta 0:" in text  # the worst-fed rank


def test_without_a_terminal_epochs_print_as_lines_and_progress_now_and_then(monkeypatch):
    out = io.StringIO()
    display = TrainingDisplay(Console(file=out, force_terminal=False, width=200))
    display.update(start())
    display.update(step(2, 1.0))
    assert out.getvalue() == ""  # not yet: a log line every 30 s at most
    monkeypatch.setattr("imgtrain.training.progress.PLAIN_EVERY_S", 0.0)
    display.update(step(4, 2.0))
    display.update(epoch(0, 10, 6.0))
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("step 4/40  epoch 1/4  loss 0.5000")
    assert lines[1].startswith("epoch   1/4  train_loss 0.4000") and "data wait 5%" in lines[1]


def test_durations():
    assert format_duration(59.6) == "1:00" and format_duration(3725) == "1:02:05"


def screen(output: str, columns: int = 140, lines: int = 30) -> list[str]:
    """What a terminal shows after ``output``: its lines, trailing blanks dropped."""
    import pyte

    term = pyte.Screen(columns, lines)
    pyte.Stream(term).feed(output.replace("\n", "\r\n"))  # the terminal's own newline mapping
    return [line.rstrip() for line in term.display if line.strip()]


def terminal_display() -> tuple[TrainingDisplay, io.StringIO]:
    out = io.StringIO()
    return TrainingDisplay(Console(file=out, force_terminal=True, width=140, color_system=None)), out


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_start_up_is_one_updating_line_replaced_by_the_bar_at_the_first_step():
    display, out = terminal_display()
    display.phase("starting Ray")
    display.note("run r: /runs/r  (logs: /runs/r/logs)")
    display.phase("starting 2 workers")
    shown = screen(out.getvalue())
    assert shown[0] == "run r: /runs/r  (logs: /runs/r/logs)"
    assert re.fullmatch(r". starting 2 workers  0 s  \(start-up 0:00\)", shown[1]), shown
    assert len(shown) == 2  # one line, updated: "starting Ray" is gone
    display.update({"kind": "phase", "phase": "loading data", "time": 0.0})
    display.update(start(total=20, epochs=2))
    display.update(step(2, 1.0))
    shown = screen(out.getvalue())
    display.close()
    assert shown[0].startswith("run r:") and shown[1].startswith("train ") and "2/20 steps" in shown[1]
    assert len(shown) == 2 and not any("loading data" in line for line in shown)


def test_off_a_terminal_each_start_up_phase_prints_one_line_with_its_duration(monkeypatch):
    clock = Clock()
    monkeypatch.setattr("imgtrain.training.progress.time.monotonic", clock)
    out = io.StringIO()
    display = TrainingDisplay(Console(file=out, force_terminal=False, width=200))
    display.phase("starting Ray")
    clock.now += 3.14
    display.phase("starting 2 workers")
    clock.now += 40
    display.update({"kind": "phase", "phase": "loading data", "time": 0.0})
    clock.now += 2
    display.update({"kind": "phase", "phase": "first 10 steps", "time": 0.0})
    display.update(start())
    clock.now += 5
    display.update(step(10, 5.0))
    display.update({"kind": "phase", "phase": "loading data", "time": 0.0})  # a restarted worker group
    display.close()
    assert out.getvalue().splitlines() == [
        "starting Ray: 3.1 s", "starting 2 workers: 40.0 s", "loading data: 2.0 s", "first 10 steps: 5.0 s",
        "step 10/40  epoch 1/4  loss 0.5000  acc 90.0%  250 img/s  data wait 2%",  # 30 s since the last line
    ]


def epoch_record(e, s, val, train_loss=0.4, images_per_s=250.0, wait=0.05):
    return dict(epoch(e, s, 0.0), val_accuracy=val, train_loss=train_loss, images_per_s=images_per_s,
                data_wait_fraction=wait)


def test_after_the_last_validation_the_bar_shows_that_epochs_figures_and_no_eta():
    display, out = terminal_display()
    display.update(start(total=20, epochs=2))
    for s in range(2, 11, 2):
        display.update(step(s, s * 0.5))
    display.update(epoch_record(0, 10, 0.84))
    bar = screen(out.getvalue())[-1]
    assert "10/20 steps" in bar and "epoch 1/2  loss 0.4000  acc 90.0%  val_acc 84.00%  250 img/s  data wait 5%" in bar
    assert re.search(r"eta \d+:\d\d$", bar)  # one epoch left
    for s in range(12, 21, 2):
        display.update(step(s, 10 + s * 0.5, images_per_s=300.0))
    assert "val_acc 84.00%" in screen(out.getvalue())[-1] and "eta" in screen(out.getvalue())[-1]
    display.update(epoch_record(1, 20, 0.953, train_loss=0.2, images_per_s=280.0, wait=0.0))
    display.close()
    shown = screen(out.getvalue())
    assert shown[-2].startswith("epoch   2/2  train_loss 0.2000") and "val_acc 95.30%" in shown[-2]
    assert "20/20 steps" in shown[-1]
    assert shown[-1].endswith("epoch 2/2  loss 0.2000  acc 90.0%  val_acc 95.30%  280 img/s  data wait 0%"), shown[-1]


def test_a_run_that_stops_says_where_and_keeps_no_eta():
    display, out = terminal_display()
    display.phase("starting 2 workers")
    display.close("failed")
    assert re.fullmatch(r"starting 2 workers: 0\.\d s \(failed\)", screen(out.getvalue())[-1])

    display, out = terminal_display()
    display.update(start(total=20, epochs=2))
    display.update(step(2, 1.0))
    display.update(step(4, 2.0))
    assert "eta" in screen(out.getvalue())[-1]
    display.close("interrupted")
    bar = screen(out.getvalue())[-1]
    assert "4/20 steps" in bar and bar.endswith("data wait 2%  interrupted") and "eta" not in bar


TRAINING_SCREEN = """
from imgtrain.training.progress import TrainingDisplay
from tests.training.test_progress import epoch_record, start, step

display = TrainingDisplay()  # its console: this process's terminal, as a run's
display.update(start(total=1200, epochs=12))
display.update(epoch_record(9, 1000, 0.84))
for s in range(1001, 1052, 10):
    display.update(step(s, 500 + s * 0.5, epoch=10))
display.close()
"""


def test_at_80_columns_the_bar_keeps_epoch_steps_loss_accuracy_speed_and_eta():
    """An 80-column terminal showed `t… s… epoch 10/12  loss ...  data wa…`: rich squeezed the bar,
    the step count and the label to an ellipsis each and cut the ETA off."""
    import sys
    from pathlib import Path

    from tests.terminal import Terminal

    for columns in (80, 140):
        with Terminal([sys.executable, "-c", TRAINING_SCREEN], cwd=Path(__file__).parents[2], columns=columns) as term:
            assert term.wait(timeout=60) == 0, term.text()
            bar = term.text().splitlines()[-1]
        assert re.search(r"━ +1051/1200( steps \d:\d\d:\d\d)?  epoch 11/12  loss 0\.5000  acc 90\.0%  .*250 img/s"
                         r"  .*eta \d+:\d\d$", bar), (columns, term.text())
        assert "…" not in bar and len(bar) <= columns
        if columns == 140:  # room for everything
            assert bar.startswith("train ━") and "steps" in bar and "val_acc 84.00%" in bar and "data wait 2%" in bar


def test_a_closed_terminal_ends_the_display_quietly(monkeypatch):
    """The terminal window closes mid-run (writes to it fail with EIO): the display goes on
    silently and closes without an error, so the run stops as the hangup asks (interrupted),
    not as a failure to draw its bar."""
    import os
    import pty
    import sys

    from imgtrain.console import SafeConsole

    leader, follower = pty.openpty()
    terminal = open(follower, "w", buffering=1)  # as sys.stdout on a terminal: line-buffered
    monkeypatch.setattr(sys, "stdout", terminal)
    display = TrainingDisplay(SafeConsole(force_terminal=True, width=200))
    display.pin_output()
    display.update(start(total=20, epochs=2))
    display.update(step(2, 1.0))
    os.close(leader)
    display.update(step(4, 2.0))
    display.note("a line nobody will see")
    display.close("interrupted")
    assert display.console.file is sys.stdout  # unpinned, as before
    monkeypatch.undo()
    try:
        terminal.close()
    except OSError:  # what the display left unsaid, flushed into a closed terminal
        pass
