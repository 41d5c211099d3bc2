"""A second start of a run that is being trained: refused, and the live run never notices.

The live run is a real `imgtrain train` process (local backend: no Ray needed for the point),
checkpointing every step. It is frozen (SIGSTOP) in the middle of a save, with its checkpoint
half written in this node's staging folder, while this process tries to train the same run and
to delete it, several times; then it goes on and must finish with every checkpoint.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

import imgtrain
from imgtrain.commands.clean import plan_runs, remove
from imgtrain.errors import ImgtrainError
from imgtrain.storage import checkpoint as ckpt
from imgtrain.storage import location, runs
from tests.conftest import quiet_display, tiny_config, wait_for

pytestmark = pytest.mark.integration

STEPS = 6


def frozen_in_a_save(proc: subprocess.Popen, staging) -> None:
    """Stop ``proc`` at a moment when a checkpoint is being written into ``staging`` (its
    temporary folder exists), so that a refused start gets its chance to delete it."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        wait_for(lambda: staging.is_dir() and any(staging.iterdir()), 120, "a checkpoint being saved", proc, poll_s=0.005)
        proc.send_signal(signal.SIGSTOP)
        if staging.is_dir() and any(staging.iterdir()):
            return
        proc.send_signal(signal.SIGCONT)  # the save ended before the stop: try the next one
    raise AssertionError("never caught the run in the middle of a save")


def test_starting_a_live_run_again_is_refused_and_the_live_run_keeps_every_checkpoint(tiny_data, tmp_path):
    settings = dict(backend="local", workers=1, epochs=1, batch_size=32, limit_train_batches=STEPS,
                    checkpoint_every_steps=1, num_to_keep=100, model="mobilenet_v3_small", log_every_steps=1)
    cfg = tiny_config(tiny_data, tmp_path, "twice", **settings)
    staging = location.checkpoint_staging(location.location(str(tmp_path), "twice"), 0)
    live = subprocess.Popen(
        [sys.executable, "-m", "imgtrain.cli", "train", "--data", str(tiny_data), "--storage", str(tmp_path),
         "--name", "twice", "--backend", "local", "--workers", "1", "--epochs", "1", "--batch-size", "32",
         "--limit-train-batches", str(STEPS), "--checkpoint-every-steps", "1", "--num-to-keep", "100",
         "--model", "mobilenet_v3_small", "--log-every-steps", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        frozen_in_a_save(live, staging)
        half_written = sorted(staging.iterdir())
        for _ in range(3):  # a second terminal, a retry, a script in a loop
            with pytest.raises(ImgtrainError, match=f"'twice' is being trained right now by process {live.pid}"):
                imgtrain.train(cfg, display=quiet_display())
            with pytest.raises(ImgtrainError, match="is being trained right now"):
                remove(plan_runs(str(tmp_path), ["twice"])[0])
        assert sorted(staging.iterdir()) == half_written  # the live run's save is untouched
        assert runs.read_status(tmp_path / "twice")["status"] == "running"
    finally:
        live.send_signal(signal.SIGCONT)
    _, err = live.communicate(timeout=240)
    assert live.returncode == 0, err

    run_dir = tmp_path / "twice"
    good, bad = ckpt.verified(run_dir)
    assert not bad and len(good) == STEPS, (good, bad)  # one per step, each complete
    assert runs.read_status(run_dir)["status"] == "finished"
    assert not staging.parent.exists() or not any(staging.parent.iterdir())  # cleared at the end, by its owner
    assert os.path.isdir(run_dir)
