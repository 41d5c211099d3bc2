"""What a user sees and what the trackers receive, read back from one real two-worker run.

The run takes its settings from a TOML file plus a flag that overrides it, draws its progress
bar on a pseudo-terminal, and logs to a real MLflow sqlite store and to TensorBoard files.
"""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
import time

import pytest
import torch

from imgtrain import runs
from imgtrain.training.tracking import MLFLOW_RUN_FILE, TENSORBOARD_DIR
from tests.conftest import run_cli

pytestmark = pytest.mark.integration


def run_in_terminal(args: list[str], cwd, timeout: float = 240) -> str:
    """Run a command with a pseudo-terminal as stdout and stderr; return what it drew."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=follower, stderr=follower, cwd=cwd,
                            env={**os.environ, "COLUMNS": "220", "TERM": "xterm"})
    os.close(follower)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                data = os.read(leader, 65536)
            except OSError:  # EIO: the command closed the terminal (it exited)
                break
            if not data:
                break
            chunks.append(data)
        assert proc.wait(timeout=max(1, deadline - time.monotonic())) == 0, b"".join(chunks).decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(leader)
    text = b"".join(chunks).decode(errors="replace")
    return re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", text).replace("\r", "\n")


@pytest.fixture(scope="module")
def observed(ray_cluster, tiny_data, tmp_path_factory):
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
tensorboard = true
mlflow = "sqlite:///{root / 'mlflow.db'}"
mlflow_experiment = "imgtrain-tests"
""")
    drawn = run_in_terminal([sys.executable, "-m", "imgtrain.cli", "train", "--config", str(config), "--epochs", "2",
                             "--address", ray_cluster], cwd=root)
    return root, root / "runs" / "obs", drawn


def test_the_file_and_the_flag_resolve_into_the_saved_config(observed):
    root, run_dir, _ = observed
    saved = runs.read_config(run_dir)
    assert saved["epochs"] == 2 and saved["batch_size"] == 32 and saved["log_every_steps"] == 2
    assert saved["tensorboard"] is True and saved["mlflow"].endswith("mlflow.db")
    assert saved["lr"] == 3e-3  # untouched fields keep their defaults
    shown = run_cli("config", "show", "--run", "obs", "--storage", str(root / "runs"))
    assert re.search(r"^epochs\s+2\s+Passes over the training split\.$", shown.stdout, re.M), shown.stdout


def test_the_terminal_shows_live_step_progress_with_data_wait_and_eta(observed):
    _, _, drawn = observed
    bars = [line for line in drawn.splitlines() if line.startswith("train ") and "steps" in line]
    live = [line for line in bars if re.search(r"\d+/16 steps .*loss [\d.]+  acc [\d.]+%  .*\d+ img/s  "
                                               r"data wait \d+%  eta \d+:\d\d", line)]
    assert live, drawn[-3000:]
    assert any("16/16 steps" in line for line in bars)
    assert "epoch   1/2" in drawn and "epoch   2/2" in drawn and "finished obs" in drawn


def test_every_rank_records_its_step_and_data_wait_times(observed):
    _, run_dir, _ = observed
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
    shown = run_cli("runs", "show", "obs", "--storage", str(run_dir.parent))
    assert "data wait" in shown.stdout


def test_mlflow_holds_the_params_every_metric_and_the_final_model(observed):
    from mlflow.tracking import MlflowClient

    root, run_dir, _ = observed
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

    _, run_dir, _ = observed
    events = EventAccumulator(str(run_dir / TENSORBOARD_DIR))
    events.Reload()
    records = runs.read_metrics(run_dir)
    steps = [r for r in records if r["kind"] == "step"]
    loss = [(e.step, e.value) for e in events.Scalars("step/loss")]
    assert loss == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in steps]
    assert [e.step for e in events.Scalars("epoch/val_accuracy")] == [e["step"] for e in runs.epoch_history(run_dir)]
    assert {"rank0/step_time_s", "rank1/data_wait_s", "step/data_wait_fraction"} <= set(events.Tags()["scalars"])
