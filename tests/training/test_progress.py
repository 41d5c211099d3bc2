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
