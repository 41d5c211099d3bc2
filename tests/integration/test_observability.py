"""What a user sees and what the trackers receive, read back from one real two-worker run.

The run takes its settings from a TOML file plus a flag that overrides it, draws on a 140x30
pseudo-terminal read by a terminal emulator (the screen during start-up and after the last
line, and every live bar it drew), and logs to a real MLflow sqlite store and to TensorBoard
files.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from imgtrain.storage import runs
from imgtrain.training.tracking.mlflow_tracker import MLFLOW_RUN_FILE
from imgtrain.training.tracking.tensorboard_tracker import TENSORBOARD_DIR
from tests.conftest import cli_here, wait_for
from tests.terminal import Terminal

pytestmark = pytest.mark.integration

NO_VAL_NOTE = ("note: this data set has no val split, so training validates on, and picks the best checkpoint by, the "
               "test split: its test figure is optimistic; prepare the data set again with --val-fraction 0.1 to fix")
PHASE_LINE = re.compile(r"^\S starting 2 workers  (\d+) s  \(start-up \d+:\d\d\)$", re.M)
RAY_NOISE = ("INFO", "WARNING", "Warning", "(raylet)", "Traceback", "ray.", "Token authentication")


class RecordingTerminal(Terminal):
    """A Terminal that also keeps every byte the command wrote: the live bars the screen overwrites."""

    def __init__(self, *args, **kwargs):
        self.written = bytearray()
        super().__init__(*args, **kwargs)

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.leader, 65536)
            except OSError:  # EIO: every process holding the terminal has closed it
                return
            if not data:
                return
            with self.lock:
                self.written += data
                self.stream.feed(data)

    def drawn(self) -> str:
        """Everything written, one line per redraw, escape sequences left out."""
        with self.lock:
            text = self.written.decode(errors="replace")
        return re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", text).replace("\r", "\n")


@dataclass
class Observed:
    root: Path
    run_dir: Path
    during: str  # the screen a second into starting the workers
    after: str  # the screen once the command has exited
    drawn: str  # all it drew


@pytest.fixture(scope="module")
def observed(ray_cluster, tiny_data, tmp_path_factory) -> Observed:
    root = tmp_path_factory.mktemp("observed")
    config = root / "run.toml"
    config.write_text(f"""
data = "{tiny_data}"
name = "obs"
storage = "{root / 'runs'}"
workers = 2
epochs = 3                # the --epochs flag below wins
batch-size = 32
log_every_steps = 2
eval_batch_size = 50
model = "timm:test_resnet"   # what is observed is the run, whatever the model: a small one is quick
tensorboard = true
mlflow = "sqlite:///{root / 'mlflow.db'}"
mlflow_experiment = "imgtrain-tests"
""")
    args = [sys.executable, "-m", "imgtrain.cli", "train", "--config", str(config), "--epochs", "2",
            "--address", ray_cluster]
    with RecordingTerminal(args, cwd=root, columns=140, lines=30) as term:
        screens = []

        def a_second_into_starting_workers():  # all that start-up drew before the phase is on screen
            screens.append(term.text())
            assert term.proc.poll() is None, f"exited ({term.proc.returncode}) before starting workers:\n{screens[-1]}"
            found = PHASE_LINE.search(screens[-1])
            return found and int(found[1]) >= 1

        wait_for(a_second_into_starting_workers, 180, "the 'starting 2 workers' line")
        assert term.wait(timeout=240) == 0, term.text()
        return Observed(root, root / "runs" / "obs", screens[-1], term.text(), term.drawn())


def test_the_screen_from_the_first_second_to_the_last_line(observed):
    during, after, run_dir = observed.during, observed.after, observed.run_dir
    # Start-up: the model when it is not the default, that the data set has no validation split
    # (the best checkpoint is picked on the test split), where the run is, then one line saying what imgtrain waits for and for how
    # long; nothing else (no Ray noise, no bar yet). A line longer than the screen wraps onto the
    # next (where a row ends in a space, the screen's row drops it: compared without spaces).
    *above, phase = during.splitlines()
    expected = "model test_resnet (timm)" + NO_VAL_NOTE + f"run obs: {run_dir}  (logs: {run_dir / 'logs'})"
    assert re.sub(r"\s", "", "".join(above)) == re.sub(r"\s", "", expected), during
    assert PHASE_LINE.fullmatch(phase), during
    assert not any(noise in during + after for noise in RAY_NOISE), after

    # The end: the bar shows the last epoch's figures, those of its line and of metrics.jsonl,
    # and the start-up line is gone.
    last = runs.epoch_history(run_dir)[-1]
    val_acc = f"val_acc {last['val_accuracy']:.2%}"
    lines = after.splitlines()
    epoch_line = next(line for line in lines if line.startswith("epoch   2/2"))
    [bar] = [line for line in lines if line.startswith("train ")]
    finished = next(line for line in lines if line.startswith("finished obs:"))
    finished += lines[lines.index(finished) + 1] if not finished.endswith("result") else ""  # wrapped at 140
    assert lines.index(epoch_line) < lines.index(bar) < lines.index(finished), after
    assert val_acc in epoch_line and f"train_loss {last['train_loss']:.4f}" in epoch_line
    assert "16/16 steps" in bar and "eta" not in bar, after
    assert bar.endswith(f"epoch 2/2  loss {last['train_loss']:.4f}  acc {last['train_accuracy']:.1%}  {val_acc}  "
                        f"{last['images_per_s']:.0f} img/s  data wait {last['data_wait_fraction']:.0%}"), after
    best = runs.read_run(run_dir).best_record
    assert finished == (f"finished obs: best checkpoint epoch {best['epoch'] + 1}, accuracy "
                        f"{best['val_accuracy']:.2%} on the test split that chose it (no val split): optimistic, "
                        "not a test result"), after
    assert " s  (start-up " not in after, after


def test_the_file_and_the_flag_resolve_into_the_saved_config(observed, capsys):
    saved = runs.read_config(observed.run_dir)
    assert saved["epochs"] == 2 and saved["batch_size"] == 32 and saved["log_every_steps"] == 2
    assert saved["tensorboard"] is True and saved["mlflow"].endswith("mlflow.db")
    assert saved["lr"] == 3e-3  # untouched fields keep their defaults
    shown = cli_here(capsys, "config", "show", "--run", "obs", "--storage", str(observed.run_dir.parent))
    assert re.search(r"^epochs\s+2\s+Passes over the training split\.$", shown.stdout, re.M), shown.stdout


def test_the_terminal_shows_live_step_progress_with_data_wait_and_eta(observed):
    drawn = observed.drawn
    bars = [line for line in drawn.splitlines() if line.startswith("train ") and "steps" in line]
    live = [line for line in bars if re.search(r"\d+/16 steps .*loss [\d.]+  acc [\d.]+%  .*\d+ img/s  "
                                               r"data wait \d+%  eta \d+:\d\d", line)]
    assert live, drawn[-3000:]
    assert any("16/16 steps" in line for line in bars)
    assert "epoch   1/2" in drawn and "epoch   2/2" in drawn and "finished obs" in drawn


def test_every_rank_records_its_step_and_data_wait_times(observed, capsys):
    run_dir = observed.run_dir
    records = runs.read_metrics(run_dir)
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["step"] for r in steps] == list(range(2, 17, 2))
    for r in steps:
        assert r["loss"] > 0 and 0 <= r["accuracy"] <= 1 and r["images_per_s"] > 0
        assert 0 <= r["data_wait_fraction"] < 1
    by_rank = {}
    for r in records:
        if r["kind"] == "rank":
            by_rank.setdefault(r["rank"], []).append(r)
            assert r["step_time_s"] > r["data_wait_s"] >= 0 and r["steps"] == 2
    assert sorted(by_rank) == [0, 1]
    assert [r["step"] for r in by_rank[1]] == [r["step"] for r in steps]  # every rank, every record
    for epoch in runs.epoch_history(run_dir):
        assert len(epoch["rank_step_time_s"]) == len(epoch["rank_data_wait_s"]) == 2
        assert all(t > w >= 0 for t, w in zip(epoch["rank_step_time_s"], epoch["rank_data_wait_s"]))
        assert 0 <= epoch["data_wait_fraction"] < 1
    shown = cli_here(capsys, "runs", "show", "obs", "--storage", str(run_dir.parent))
    assert "data wait" in shown.stdout


def test_mlflow_holds_the_params_every_metric_and_the_final_model(observed):
    from mlflow.tracking import MlflowClient

    root, run_dir = observed.root, observed.run_dir
    saved = json.loads((run_dir / MLFLOW_RUN_FILE).read_text())
    client = MlflowClient(saved["tracking_uri"])
    run = client.get_run(saved["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "obs"
    assert client.get_experiment(run.info.experiment_id).name == "imgtrain-tests"
    assert run.data.params["batch_size"] == "32" and run.data.params["epochs"] == "2"

    records = runs.read_metrics(run_dir)
    steps = [r for r in records if r["kind"] == "step"]
    logged = client.get_metric_history(run.info.run_id, "step/loss")
    assert [(m.step, m.value) for m in logged] == [(r["step"], pytest.approx(r["loss"])) for r in steps]
    history = runs.epoch_history(run_dir)
    val = client.get_metric_history(run.info.run_id, "epoch/val_accuracy")
    assert [(m.step, m.value) for m in val] == [(e["step"], e["val_accuracy"]) for e in history]
    assert len(client.get_metric_history(run.info.run_id, "rank1/data_wait_fraction")) == len(steps)

    result = runs.load_run(str(run_dir.parent), "obs")
    model_pt = client.download_artifacts(run.info.run_id, "model/model.pt", str(root))
    logged_weights = torch.load(model_pt, weights_only=True)
    best_weights = torch.load(result.best_checkpoint / "model.pt", weights_only=True)
    assert logged_weights.keys() == best_weights.keys()
    assert all(torch.equal(logged_weights[k], best_weights[k]) for k in best_weights)


def test_tensorboard_event_files_hold_the_same_numbers(observed):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = observed.run_dir
    events = EventAccumulator(str(run_dir / TENSORBOARD_DIR))
    events.Reload()
    records = runs.read_metrics(run_dir)
    steps = [r for r in records if r["kind"] == "step"]
    loss = [(e.step, e.value) for e in events.Scalars("step/loss")]
    assert loss == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in steps]
    assert [e.step for e in events.Scalars("epoch/val_accuracy")] == [e["step"] for e in runs.epoch_history(run_dir)]
    assert {"rank0/step_time_s", "rank1/data_wait_s", "step/data_wait_fraction"} <= set(events.Tags()["scalars"])
