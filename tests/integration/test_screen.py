"""The terminal as a person sees it: the real CLI in a 140x30 pseudo-terminal, its screen read by
a terminal emulator during start-up and after the last line."""

from __future__ import annotations

import re
import sys

import pytest

from imgtrain import runs
from tests.conftest import wait_for
from tests.terminal import Terminal

pytestmark = pytest.mark.integration

PHASE_LINE = re.compile(r"^\S starting 2 workers  (\d+) s  \(start-up \d+:\d\d\)$", re.M)
RAY_NOISE = ("INFO", "WARNING", "Warning", "(raylet)", "Traceback", "ray.", "Token authentication")


def test_the_screen_from_the_first_second_to_the_last_line(ray_cluster, tiny_data, tmp_path):
    args = [sys.executable, "-m", "imgtrain.cli", "train", "--data", str(tiny_data), "--name", "scr",
            "--storage", str(tmp_path / "runs"), "--workers", "2", "--epochs", "2", "--batch-size", "32",
            "--eval-batch-size", "50", "--log-every-steps", "2", "--address", ray_cluster]
    with Terminal(args, cwd=tmp_path, columns=140, lines=30) as term:
        screens = []

        def a_second_into_starting_workers():  # all that start-up drew before the phase is on screen
            screens.append(term.text())
            assert term.proc.poll() is None, f"exited ({term.proc.returncode}) before starting workers:\n{screens[-1]}"
            found = PHASE_LINE.search(screens[-1])
            return found and int(found[1]) >= 1

        wait_for(a_second_into_starting_workers, 180, "the 'starting 2 workers' line")
        during = screens[-1]
        assert term.wait(timeout=240) == 0, term.text()
        after = term.text()

    # Start-up: where the run is, then one line saying what imgtrain waits for and for how long;
    # nothing else (no Ray noise, no bar yet). A line longer than the screen wraps onto the next.
    run_dir = tmp_path / "runs" / "scr"
    *above, phase = during.splitlines()
    assert "".join(above) == f"run scr: {run_dir}  (logs: {run_dir / 'logs'})", during
    assert PHASE_LINE.fullmatch(phase), during
    assert not any(noise in during + after for noise in RAY_NOISE), after

    # The end: the bar shows the last epoch's figures, those of its line and of metrics.jsonl,
    # and the start-up line is gone.
    last = runs.epoch_history(run_dir)[-1]
    val_acc = f"val_acc {last['val_accuracy']:.2%}"
    lines = after.splitlines()
    epoch_line = next(line for line in lines if line.startswith("epoch   2/2"))
    [bar] = [line for line in lines if line.startswith("train ")]
    finished = next(line for line in lines if line.startswith("finished scr:"))
    assert lines.index(epoch_line) < lines.index(bar) < lines.index(finished), after
    assert val_acc in epoch_line and f"train_loss {last['train_loss']:.4f}" in epoch_line
    assert "16/16 steps" in bar and "eta" not in bar, after
    assert bar.endswith(f"epoch 2/2  loss {last['train_loss']:.4f}  acc {last['train_accuracy']:.1%}  {val_acc}  "
                        f"{last['images_per_s']:.0f} img/s  data wait {last['data_wait_fraction']:.0%}"), after
    assert finished == f"finished scr: test accuracy {last['val_accuracy']:.2%}", after
    assert " s  (start-up " not in after, after
