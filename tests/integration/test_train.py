"""Training for real on a local Ray cluster, through the Python API and the CLI.

Facts of a finished run are read from the session's shared runs (``ray_run``, ``local_run``;
the torch DataLoader's ingest on 2 workers from test_fsdp's DDP run, and the CLI off a terminal
from test_s3's run: one Ray fit each for several files);
what does not depend on Ray (resume, overwrite, damaged checkpoints) runs on the local backend,
each test on a copy of a finished run."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
from torchvision.models import resnet18

import imgtrain
from imgtrain.checkpoint_policy import POLICY, PREFIX, RAY_SNAPSHOT_PARKED
from imgtrain.config import TrainConfig
from imgtrain.errors import ImgtrainError
from imgtrain.storage import checkpoint as ckpt
from imgtrain.storage import runs
from tests.conftest import cli_here, copy_run, quiet_display, run_cli, tiny_config

pytestmark = pytest.mark.integration

QUIET = quiet_display()


def config_of(run, storage, **overrides) -> TrainConfig:
    """The config ``run`` was trained with, for its copy in ``storage`` (what resumes it)."""
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    stored = {k: v for k, v in run.config.items() if k in fields}
    return TrainConfig(**{**stored, "storage": str(storage), **overrides})


def cli_train_here(capsys, monkeypatch, *args: str):
    """``cli_here`` for a command that trains on the local backend. ``train`` pins the CLI's
    console to sys.stdout as it is then (TrainingDisplay.pin_output): here this test's capture,
    so the call gets a console of its own and later tests keep the module's."""
    from imgtrain import cli
    from imgtrain.console import SafeConsole

    monkeypatch.setattr(cli, "console", SafeConsole())
    return cli_here(capsys, *args)


def assert_a_two_worker_run(result, run_dir, architecture="resnet18"):
    assert result.status == "finished"
    df = result.metrics
    assert list(df["epoch"]) == [0, 1]
    assert (df["world_size"] == 2).all()
    assert (df["val_samples"] == 100).all()  # every test row counted exactly once across ranks
    assert (df["train_samples"] == 8 * 32).all()  # 256 rows / global batch 32 = 8 whole steps
    assert df["train_loss"].iloc[1] < df["train_loss"].iloc[0]
    for name in (runs.CONFIG_FILE, runs.METRICS_FILE, runs.STATUS_FILE, "logs/driver.log"):
        assert (run_dir / name).is_file(), name
    kinds = [r["kind"] for r in runs.read_metrics(run_dir)]
    assert kinds.count("epoch") == 2 and "step" in kinds and kinds[0] == "start"
    assert "phase" not in kinds  # start-up phases are for the screen
    assert result.latest_checkpoint.name == POLICY.epoch_name(1)
    meta = ckpt.verify(result.latest_checkpoint)
    # what wrote the run, beside its settings
    assert {k: meta[k] for k in runs.VERSION_KEYS} == runs.versions() and runs.versions()["imgtrain_version"]
    assert {k: runs.read_config(run_dir)[k] for k in runs.VERSION_KEYS} == runs.versions()
    assert meta["metrics"]["val_accuracy"] == df["val_accuracy"].iloc[1]
    assert {k: meta["model_args"][k] for k in ("architecture", "in_channels", "num_classes")} == \
        {"architecture": architecture, "in_channels": 1, "num_classes": 10}
    # `ls runs/NAME/checkpoint_*` lists checkpoints only: Ray Train's own record is parked, hidden
    assert all(p.is_dir() and POLICY.is_checkpoint(p.name) for p in run_dir.glob(f"{PREFIX}*"))
    assert (run_dir / RAY_SNAPSHOT_PARKED).is_file()


def test_two_workers_with_ray_data_ingest_train_and_write_the_run_directory(ray_run):
    assert ray_run.config["ingest"] == "ray-data" and ray_run.config["workers"] == 2
    assert_a_two_worker_run(ray_run, ray_run.path)


def tutorial_build_model() -> nn.Module:
    model = resnet18(num_classes=10)
    model.conv1 = nn.Conv2d(in_channels=1, out_channels=64, kernel_size=(7, 7), stride=(2, 2),
                            padding=(3, 3), bias=False)
    return model


def test_tutorial_inference_code_loads_model_pt(ray_run, tiny_data):
    """A checkpoint written by rank 0 of a DDP run loads into the seed tutorial's own model."""
    from imgtrain.data.format import read_split

    model = tutorial_build_model()
    model.load_state_dict(torch.load(ray_run.latest_checkpoint / "model.pt", map_location="cpu",
                                     weights_only=True))
    model.eval()
    _, images, labels = read_split(tiny_data, "test")
    # The tutorial's preprocessing: ToTensor() then Normalize((0.5,), (0.5,)).
    x = torch.from_numpy(images).permute(0, 3, 1, 2).float().div(255).sub(0.5).div(0.5)
    with torch.no_grad():
        acc = (model(x).argmax(1) == torch.from_numpy(labels)).float().mean().item()
    assert acc == pytest.approx(ray_run.final_accuracy, abs=1e-6)


def test_local_backend_runs_the_same_loop(local_run):
    assert local_run.config["backend"] == "local"
    assert list(local_run.metrics["world_size"]) == [1, 1]
    assert local_run.final_accuracy > 0.2  # far above chance (0.1) after 16 steps on real digits
    assert [p.name for p, _ in ckpt.listing(local_run.path)] == sorted(
        {local_run.best_checkpoint.name, local_run.latest_checkpoint.name})


# A child inherits an ignored or blocked SIGINT from its parent, and in the whole suite something
# before this test left the pytest process so (the CLI then trained on through the signal); a
# user's shell gives the default disposition, which this sets before the CLI starts.
DEFAULT_SIGINT_THEN_CLI = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); sys.argv[0] = 'imgtrain'; "
    "runpy.run_module('imgtrain.cli', run_name='__main__')"
)


def test_same_name_resumes_from_the_latest_checkpoint(local_run, tmp_path):
    storage = copy_run(local_run, tmp_path)
    run_dir = storage / local_run.name
    stored = runs.read_config(run_dir)  # as an imgtrain that recorded no versions wrote it
    runs.write_config(run_dir, {k: v for k, v in stored.items() if k not in runs.VERSION_KEYS})
    more = imgtrain.train(config_of(local_run, storage, epochs=3), display=QUIET)
    assert [r["epoch"] for r in more.history] == [0, 1, 2]
    assert more.history[:2] == local_run.history  # epochs 0 and 1 were not trained again
    starts = [r for r in runs.read_metrics(run_dir) if r["kind"] == "start"]
    assert [s["step"] for s in starts] == [0, 16]  # the second driver started at step 16

    again = imgtrain.train(config_of(local_run, storage, epochs=3), display=QUIET)
    assert again.history == more.history  # already complete: nothing retrained

    with pytest.raises(ImgtrainError, match="different config.*lr"):
        imgtrain.train(config_of(local_run, storage, epochs=3, lr=0.5), display=QUIET)


def test_overwrite_replaces_a_run_only_when_the_new_request_is_good(local_run, tiny_data, tmp_path, capsys,
                                                                   monkeypatch):
    storage = copy_run(local_run, tmp_path)
    first = runs.load_run(str(storage), local_run.name)
    with pytest.raises(ImgtrainError, match="--overwrite"):
        imgtrain.train(config_of(local_run, storage, lr=0.01), display=QUIET)
    # A bad new request leaves the old run untouched.
    bad = config_of(local_run, storage, data=str(tmp_path / "no-such-data"), lr=0.01)
    with pytest.raises(ImgtrainError):
        imgtrain.train(bad, display=QUIET, overwrite=True)
    assert runs.read_config(first.path)["lr"] == first.config["lr"]
    assert first.latest_checkpoint.is_dir()

    proc = cli_train_here(capsys, monkeypatch, "train", "--data", str(tiny_data), "--name", local_run.name,
                          "--storage", str(storage), "--backend", "local", "--epochs", "1", "--batch-size", "32",
                          "--lr", "0.01", "--limit-train-batches", "2", "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert "starting afresh" in proc.stdout
    again = runs.load_run(str(storage), local_run.name)
    assert again.config["lr"] == 0.01 and again.config["eval_batch_size"] == 500  # defaults, not the old run's
    assert [r["epoch"] for r in again.history] == [0]
    starts = [r for r in runs.read_metrics(again.path) if r["kind"] == "start"]
    assert [s["step"] for s in starts] == [0]  # a fresh history, not the old one continued


def test_overwrite_with_a_request_that_fails_late_gives_the_old_run_back(ray_cluster, local_run, tiny_data, tmp_path):
    # No GPU in the cluster: found only once Ray is joined, after the old run was moved aside.
    storage = copy_run(local_run, tmp_path)
    first = runs.load_run(str(storage), local_run.name)
    files = sorted(p.relative_to(storage) for p in first.path.rglob("*") if p.is_file())
    proc = run_cli("train", "--data", str(tiny_data), "--name", local_run.name, "--storage", str(storage),
                   "--address", ray_cluster, "--gpu", "--overwrite")
    assert proc.returncode == 2 and "GPU worker(s)" in proc.stderr, proc.stderr
    assert "was restored" in proc.stdout
    assert sorted(p.relative_to(storage) for p in first.path.rglob("*") if p.is_file()) == files
    assert runs.load_run(str(storage), local_run.name).history == first.history
    assert [p.name for p in storage.iterdir()] == [local_run.name]


@pytest.fixture(scope="module")
def two_checkpoints(tiny_data, tmp_path_factory):
    """A finished local run that keeps both epochs' checkpoints (local_run keeps the best and the
    latest, maybe one): the start of the damaged-checkpoint tests, which work on copies. Epochs of
    2 steps: what is checked is which checkpoint is read, not what was learnt."""
    storage = tmp_path_factory.mktemp("two-checkpoints")
    config = tiny_config(tiny_data, storage, "dmg", backend="local", workers=1, num_to_keep=2, limit_train_batches=2)
    result = imgtrain.train(config, display=QUIET)
    assert [p.name for p, _ in ckpt.listing(result.path)] == [POLICY.epoch_name(0), POLICY.epoch_name(1)]
    return result


def damage(checkpoint_dir):
    with open(checkpoint_dir / ckpt.MODEL_FILE, "r+b") as f:
        f.truncate(1000)  # as a full disk or a killed copy would leave it


def test_resume_skips_a_damaged_checkpoint_for_the_previous_good_one(two_checkpoints, tmp_path, capsys, monkeypatch):
    storage = copy_run(two_checkpoints, tmp_path)
    damage(storage / "dmg" / POLICY.epoch_name(1))

    # The name alone resumes the run with its stored settings: epoch 1 is trained again.
    proc = cli_train_here(capsys, monkeypatch, "train", "--name", "dmg", "--storage", str(storage))
    assert proc.returncode == 0, proc.stderr
    assert "skipping checkpoint checkpoint_epoch_0001" in proc.stdout and "sha256" in proc.stdout
    assert "resuming from checkpoint_epoch_0000" in proc.stdout
    result = runs.load_run(str(storage), "dmg")
    assert [r["epoch"] for r in result.history] == [0, 1]
    replacement = POLICY.epoch_name(1, taken=[POLICY.epoch_name(1)])  # checkpoint_epoch_0001-2
    assert result.history[1]["checkpoint"] == replacement  # never the damaged one's path
    starts = [r["step"] for r in runs.read_metrics(result.path) if r["kind"] == "start"]
    assert starts == [0, 2]  # resumed after epoch 0 (2 steps), the last good checkpoint
    assert result.latest_checkpoint.name == replacement
    ckpt.verify(result.latest_checkpoint)


def test_loading_best_or_latest_skips_a_damaged_checkpoint(two_checkpoints, tmp_path, capsys):
    from imgtrain.storage.runs import resolve_checkpoint

    storage = copy_run(two_checkpoints, tmp_path)
    damage(storage / "dmg" / POLICY.epoch_name(1))
    for which in ("latest", "best"):
        with pytest.warns(ckpt.DamagedCheckpointWarning, match="skipping checkpoint checkpoint_epoch_0001"):
            assert resolve_checkpoint("dmg", which, str(storage)).name == POLICY.epoch_name(0)
    proc = cli_here(capsys, "evaluate", "dmg", "--checkpoint", "latest", "--backend", "local", "--storage", str(storage))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.startswith("warning: skipping checkpoint checkpoint_epoch_0001:")  # one line, no traceback
