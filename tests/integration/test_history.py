"""Nothing lost from a run's history, however the driver dies: the kill matrix.

One run of the local backend (where the training loop runs in the driver's own process) is
SIGKILLed at named moments, one after the other: during the first steps, right after a step
checkpoint and right after an epoch checkpoint are stored (before their records reach
metrics.jsonl), while a checkpoint is being copied into the run, and during validation. Each
kill is followed by the same command. After every process, every epoch trained so far is in
metrics.jsonl exactly once (an epoch whose record was lost comes back from the checkpoint the
run resumes from), status.json and the checkpoints agree, and the final history equals an
uninterrupted run's, to the bit (--deterministic). The Ray backend's cases, a real SIGKILL of the
driver and of rank 0's worker right after a checkpoint, are in test_resume.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import imgtrain
from imgtrain import checkpoint as ckpt
from imgtrain import runs
from imgtrain.config import TrainConfig
from imgtrain.training.faults import ENV_VAR as FAULT_ENV
from imgtrain.training.progress import TrainingDisplay

pytestmark = pytest.mark.integration

# 256 rows / batch 32 = 8 steps per epoch, 24 in all; step checkpoints at steps 4, 12 and 20.
SETTINGS = dict(backend="local", epochs=3, batch_size=32, eval_batch_size=50, log_every_steps=1,
                checkpoint_every_steps=4, deterministic=True)
HISTORY_KEYS = ("epoch", "step", "train_loss", "train_accuracy", "val_loss", "val_accuracy",
                "train_samples", "val_samples", "lr")
# (fault, what the process has done when it dies), in the order the run reaches them
KILLS = [
    ("kill:0:2", "trained two steps, no checkpoint yet"),
    ("kill-saved:0:4", "stored a step checkpoint, not yet recorded"),
    ("kill-saved:0:8", "stored epoch 0's checkpoint, its epoch record not written"),
    ("kill-validating:0:16", "validating epoch 1"),
    ("kill-saving:0:20", "copying a step checkpoint into the run"),
    ("kill-saved:0:24", "stored the last epoch's checkpoint, its record not written"),
]


def cli_args(data: Path, storage: Path) -> list[str]:
    return ["train", "--data", str(data), "--storage", str(storage), "--name", "matrix", "--backend", "local",
            "--epochs", "3", "--batch-size", "32", "--eval-batch-size", "50", "--log-every-steps", "1",
            "--checkpoint-every-steps", "4", "--deterministic"]


def run_cli(args: list[str], fault: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    if fault:
        env[FAULT_ENV] = fault
    return subprocess.run([sys.executable, "-m", "imgtrain.cli", *args], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=240, env=env)


def epoch_records(run_dir: Path) -> list[dict]:
    """Every epoch record in metrics.jsonl, duplicates included (epoch_history would hide them)."""
    return [r for r in runs.read_metrics(run_dir) if r["kind"] == "epoch"]


def completed_epochs(run_dir: Path) -> int:
    """Epochs finished according to the newest checkpoint that verifies."""
    good, _ = ckpt.verified(run_dir)
    if not good:
        return 0
    meta = ckpt.read_meta(good[-1])
    return meta["in_epoch"]["epoch"] if "in_epoch" in meta else meta["epoch"] + 1


def assert_history_matches_checkpoints(run_dir: Path, lost_last: bool) -> None:
    epochs = [r["epoch"] for r in epoch_records(run_dir)]
    assert epochs == list(range(len(epochs))), f"epochs recorded: {epochs}"  # each once, none skipped
    done = completed_epochs(run_dir)
    # A driver killed between a checkpoint and its record has not written that epoch yet: the
    # next start recovers it. Nothing else may be missing.
    assert len(epochs) == (done - 1 if lost_last else done), (epochs, done)


def history(run_dir: Path) -> list[dict]:
    return [{k: r[k] for k in HISTORY_KEYS} for r in runs.epoch_history(run_dir)]


def test_a_driver_killed_at_any_moment_loses_no_epoch_of_the_history(tiny_data, tmp_path):
    reference = imgtrain.train(TrainConfig(data=str(tiny_data), storage=str(tmp_path / "ref"), name="ref",
                                           **SETTINGS), display=TrainingDisplay(quiet=True))
    storage = tmp_path / "runs"
    run_dir = storage / "matrix"
    args = cli_args(tiny_data, storage)
    for fault, moment in KILLS:
        proc = run_cli(args, fault)
        assert proc.returncode == -signal.SIGKILL, (fault, proc.returncode, proc.stderr[-2000:])
        assert (run_dir / ".faults" / f"{fault.split(':')[0]}-0-{fault.split(':')[2]}-1").is_file()
        assert runs.read_status(run_dir)["status"] == "interrupted", moment  # not "running" forever
        assert_history_matches_checkpoints(run_dir, lost_last=fault.startswith("kill-saved:0:") and fault.endswith(("8", "24")))
    lost_epoch_2 = epoch_records(run_dir)
    assert [r["epoch"] for r in lost_epoch_2] == [0, 1]  # epoch 2's record died with the driver

    final = run_cli(args)
    assert final.returncode == 0, final.stderr
    assert "already complete" in final.stdout  # the last checkpoint was stored before the kill...
    records = epoch_records(run_dir)
    assert [r["epoch"] for r in records] == [0, 1, 2]  # ...and its record is recovered from it
    recovered = {r["epoch"]: r.get("recovered_from") for r in records}
    assert recovered == {0: "checkpoint_epoch_0000", 1: None, 2: "checkpoint_epoch_0002"}
    assert history(run_dir) == history(reference.path)  # the same numbers as an uninterrupted run
    assert runs.read_status(run_dir)["status"] == "finished"
    assert not list(run_dir.glob(".checkpoint_*.tmp"))  # the half-copied checkpoint was cleaned up
    shown = subprocess.run([sys.executable, "-m", "imgtrain.cli", "runs", "show", "matrix", "--storage",
                            str(storage), "--json"], capture_output=True, text=True, timeout=60)
    assert [m["epoch"] for m in __import__("json").loads(shown.stdout)["metrics"]] == [0, 1, 2]
