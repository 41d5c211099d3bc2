"""Training for real on a local Ray cluster, through the Python API and the CLI."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from torchvision.models import resnet18

import imgtrain
from imgtrain import checkpoint as ckpt
from imgtrain import runs
from imgtrain.errors import ImgtrainError
from tests.conftest import quiet_display, run_cli, tiny_config, wait_for

pytestmark = pytest.mark.integration

QUIET = quiet_display()




@pytest.mark.parametrize("ingest", ["ray-data", "torch"])
def test_two_workers_train_and_write_the_run_directory(ray_cluster, tiny_data, tmp_path, ingest):
    result = imgtrain.train(tiny_config(tiny_data, tmp_path, f"r-{ingest}", ingest=ingest), display=QUIET)

    assert result.status == "finished"
    df = result.metrics
    assert list(df["epoch"]) == [0, 1]
    assert (df["world_size"] == 2).all()
    assert (df["val_samples"] == 100).all()  # every test row counted exactly once across ranks
    assert (df["train_samples"] == 8 * 32).all()  # 256 rows / global batch 32 = 8 whole steps
    assert df["train_loss"].iloc[1] < df["train_loss"].iloc[0]
    run_dir = tmp_path / f"r-{ingest}"
    for name in (runs.CONFIG_FILE, runs.METRICS_FILE, runs.STATUS_FILE, "logs/driver.log"):
        assert (run_dir / name).is_file(), name
    kinds = [r["kind"] for r in runs.read_metrics(run_dir)]
    assert kinds.count("epoch") == 2 and "step" in kinds and kinds[0] == "start"
    assert "phase" not in kinds  # start-up phases are for the screen
    assert result.latest_checkpoint.name == "checkpoint_epoch_0001"
    meta = ckpt.verify(result.latest_checkpoint)
    # what wrote the run, beside its settings
    assert {k: meta[k] for k in runs.VERSION_KEYS} == runs.versions() and runs.versions()["imgtrain_version"]
    assert {k: runs.read_config(run_dir)[k] for k in runs.VERSION_KEYS} == runs.versions()
    assert meta["metrics"]["val_accuracy"] == df["val_accuracy"].iloc[1]
    assert meta["model_args"] == {"architecture": "resnet18", "in_channels": 1, "num_classes": 10}


def tutorial_build_model() -> nn.Module:
    model = resnet18(num_classes=10)
    model.conv1 = nn.Conv2d(in_channels=1, out_channels=64, kernel_size=(7, 7), stride=(2, 2),
                            padding=(3, 3), bias=False)
    return model


def test_tutorial_inference_code_loads_model_pt(ray_cluster, tiny_data, tmp_path):
    from imgtrain.data.format import read_split

    result = imgtrain.train(tiny_config(tiny_data, tmp_path, "tut", epochs=1), display=QUIET)
    model = tutorial_build_model()
    model.load_state_dict(torch.load(result.latest_checkpoint / "model.pt", map_location="cpu",
                                     weights_only=True))
    model.eval()
    _, images, labels = read_split(tiny_data, "test")
    # The tutorial's preprocessing: ToTensor() then Normalize((0.5,), (0.5,)).
    x = torch.from_numpy(images).permute(0, 3, 1, 2).float().div(255).sub(0.5).div(0.5)
    with torch.no_grad():
        acc = (model(x).argmax(1) == torch.from_numpy(labels)).float().mean().item()
    assert acc == pytest.approx(result.final_accuracy, abs=1e-6)


def test_local_backend_runs_the_same_loop(tiny_data, tmp_path):
    result = imgtrain.train(tiny_config(tiny_data, tmp_path, "loc", backend="local"), display=QUIET)
    assert list(result.metrics["world_size"]) == [1, 1]
    assert result.final_accuracy > 0.2  # far above chance (0.1) after 16 steps on real digits
    assert [p.name for p, _ in ckpt.listing(result.path)] == sorted(
        {result.best_checkpoint.name, result.latest_checkpoint.name})


# A child inherits an ignored or blocked SIGINT from its parent, and in the whole suite something
# before this test left the pytest process so (the CLI then trained on through the signal); a
# user's shell gives the default disposition, which this sets before the CLI starts.
DEFAULT_SIGINT_THEN_CLI = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); sys.argv[0] = 'imgtrain'; "
    "runpy.run_module('imgtrain.cli', run_name='__main__')"
)


def test_ctrl_c_stops_training_and_says_how_to_resume(tiny_data, tmp_path):
    """SIGINT, as Ctrl-C sends it: exit 130, one line saying what to do, the run marked interrupted."""
    args = ["train", "--data", str(tiny_data), "--storage", str(tmp_path), "--name", "cc", "--backend", "local",
            "--epochs", "100", "--batch-size", "32", "--quiet"]
    proc = subprocess.Popen([sys.executable, "-c", DEFAULT_SIGINT_THEN_CLI, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    try:
        wait_for(lambda: any((tmp_path / "cc").glob("checkpoint_epoch_*")), 180, "the first checkpoint", proc)
        masks = [line for line in open(f"/proc/{proc.pid}/status") if line.startswith(("SigBlk", "SigIgn"))]
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"SIGINT ignored; the child's signal masks: {masks}") from None
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in out + err
    assert err.strip().splitlines()[-1] == "interrupted; run the same command again to resume", err
    assert runs.read_status(tmp_path / "cc")["status"] == "interrupted"


def test_same_name_resumes_from_the_latest_checkpoint(ray_cluster, tiny_data, tmp_path):
    first = imgtrain.train(tiny_config(tiny_data, tmp_path, "res", epochs=1), display=QUIET)
    assert len(first.history) == 1
    stored = runs.read_config(first.path)  # as an imgtrain that recorded no versions wrote it
    runs.write_config(first.path, {k: v for k, v in stored.items() if k not in runs.VERSION_KEYS})
    second = imgtrain.train(tiny_config(tiny_data, tmp_path, "res", epochs=3), display=QUIET)
    assert [r["epoch"] for r in second.history] == [0, 1, 2]
    assert second.history[0] == first.history[0]  # epoch 0 was not trained again
    starts = [r for r in runs.read_metrics(second.path) if r["kind"] == "start"]
    assert [s["step"] for s in starts] == [0, 8]  # the second run started at step 8

    again = imgtrain.train(tiny_config(tiny_data, tmp_path, "res", epochs=3), display=QUIET)
    assert again.history == second.history  # already complete: nothing retrained

    with pytest.raises(ImgtrainError, match="different config.*lr"):
        imgtrain.train(tiny_config(tiny_data, tmp_path, "res", epochs=3, lr=0.5), display=QUIET)


def test_cli_train_prints_progress_and_runs_show_json(ray_cluster, tiny_data, tmp_path):
    storage = tmp_path / "runs"
    proc = run_cli("train", "--data", str(tiny_data), "--name", "cli", "--epochs", "2",
                   "--batch-size", "32", "--storage", str(storage), "--address", ray_cluster)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "epoch   1/2" in out and "epoch   2/2" in out and "test accuracy" in out
    assert "Traceback" not in out + proc.stderr
    assert "WARNING" not in out + proc.stderr  # Ray's own noise goes to logs/
    # off a terminal, one line per start-up phase with its duration, in order
    phases = re.findall(r"^(checking the data set|starting Ray|joining the Ray cluster at \S+|checking resources and storage|starting 2 workers|"
                        r"loading data|building the model|first \d+ steps?): \d+\.\d s$", out, re.M)
    assert phases == ["checking the data set", f"joining the Ray cluster at {ray_cluster}", "checking resources and storage", "starting 2 workers",
                      "loading data", "building the model", "first 8 steps"], out

    shown = run_cli("runs", "show", "cli", "--json", "--storage", str(storage))
    data = json.loads(shown.stdout)
    for key in ("name", "status", "epochs_completed", "metrics", "best_checkpoint", "latest_checkpoint"):
        assert key in data
    assert data["status"] == "finished" and data["epochs_completed"] == 2
    assert {"epoch", "train_loss", "val_accuracy"} <= set(data["metrics"][0])

    listed = run_cli("runs", "list", "--storage", str(storage))
    assert listed.returncode == 0 and "cli" in listed.stdout and "finished" in listed.stdout


def test_overwrite_replaces_a_run_only_when_the_new_request_is_good(tiny_data, tmp_path):
    first = imgtrain.train(tiny_config(tiny_data, tmp_path, "ow", backend="local", epochs=1), display=QUIET)
    changed = tiny_config(tiny_data, tmp_path, "ow", backend="local", epochs=1, lr=0.01)
    with pytest.raises(ImgtrainError, match="--overwrite"):
        imgtrain.train(changed, display=QUIET)
    # A bad new request leaves the old run untouched.
    bad = tiny_config(tmp_path / "no-such-data", tmp_path, "ow", backend="local", epochs=1, lr=0.01)
    with pytest.raises(ImgtrainError):
        imgtrain.train(bad, display=QUIET, overwrite=True)
    assert runs.read_config(first.path)["lr"] == first.config["lr"]
    assert first.latest_checkpoint.is_dir()

    proc = run_cli("train", "--data", str(tiny_data), "--name", "ow", "--storage", str(tmp_path),
                   "--backend", "local", "--epochs", "1", "--batch-size", "32", "--lr", "0.01",
                   "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert "starting afresh" in proc.stdout
    again = runs.load_run(str(tmp_path), "ow")
    assert again.config["lr"] == 0.01 and again.config["eval_batch_size"] == 500  # defaults, not the old run's
    assert [r["epoch"] for r in again.history] == [0]
    starts = [r for r in runs.read_metrics(again.path) if r["kind"] == "start"]
    assert [s["step"] for s in starts] == [0]  # a fresh history, not the old one continued


def test_overwrite_with_a_request_that_fails_late_gives_the_old_run_back(ray_cluster, tiny_data, tmp_path):
    # No GPU in the cluster: found only once Ray is joined, after the old run was moved aside.
    first = imgtrain.train(tiny_config(tiny_data, tmp_path, "gpu", backend="local", epochs=1), display=QUIET)
    files = sorted(p.relative_to(tmp_path) for p in first.path.rglob("*") if p.is_file())
    proc = run_cli("train", "--data", str(tiny_data), "--name", "gpu", "--storage", str(tmp_path),
                   "--address", ray_cluster, "--gpu", "--overwrite")
    assert proc.returncode == 2 and "GPU worker(s)" in proc.stderr, proc.stderr
    assert "was restored" in proc.stdout
    assert sorted(p.relative_to(tmp_path) for p in first.path.rglob("*") if p.is_file()) == files
    assert runs.load_run(str(tmp_path), "gpu").history == first.history
    assert [p.name for p in tmp_path.iterdir()] == ["gpu"]


def damage(checkpoint_dir):
    with open(checkpoint_dir / ckpt.MODEL_FILE, "r+b") as f:
        f.truncate(1000)  # as a full disk or a killed copy would leave it


def test_resume_skips_a_damaged_checkpoint_for_the_previous_good_one(ray_cluster, tiny_data, tmp_path):
    first = imgtrain.train(tiny_config(tiny_data, tmp_path, "dmg", epochs=2, num_to_keep=2), display=QUIET)
    assert first.latest_checkpoint.name == "checkpoint_epoch_0001"
    damage(first.latest_checkpoint)

    proc = run_cli("train", "--name", "dmg", "--epochs", "3", "--storage", str(tmp_path), "--address", ray_cluster)
    assert proc.returncode == 0, proc.stderr
    assert "skipping checkpoint checkpoint_epoch_0001" in proc.stdout and "sha256" in proc.stdout
    assert "resuming from checkpoint_epoch_0000" in proc.stdout
    result = runs.load_run(str(tmp_path), "dmg")
    assert [r["epoch"] for r in result.history] == [0, 1, 2]
    assert result.history[1]["checkpoint"] == "checkpoint_epoch_0001-2"  # never the damaged one's path
    starts = [r["step"] for r in runs.read_metrics(result.path) if r["kind"] == "start"]
    assert starts == [0, 8]  # resumed after epoch 0, the last good checkpoint
    assert result.latest_checkpoint.name == "checkpoint_epoch_0002"
    ckpt.verify(result.latest_checkpoint)


def test_loading_best_or_latest_skips_a_damaged_checkpoint(tiny_data, tmp_path):
    from imgtrain.inference.predictor import resolve_checkpoint

    first = imgtrain.train(tiny_config(tiny_data, tmp_path, "dmgl", backend="local", num_to_keep=2), display=QUIET)
    damage(first.latest_checkpoint)
    for which in ("latest", "best"):
        with pytest.warns(ckpt.DamagedCheckpointWarning, match="skipping checkpoint checkpoint_epoch_0001"):
            assert resolve_checkpoint("dmgl", which, str(tmp_path)).name == "checkpoint_epoch_0000"
    proc = run_cli("evaluate", "dmgl", "--checkpoint", "latest", "--backend", "local", "--storage", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.startswith("warning: skipping checkpoint checkpoint_epoch_0001:")  # one line, no traceback
