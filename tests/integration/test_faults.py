"""Failures for real: processes killed with SIGKILL, then the same command run again."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import imgtrain
from imgtrain import checkpoint as ckpt
from imgtrain import runs
from imgtrain.training.faults import ENV_VAR as FAULT_ENV
from tests.conftest import run_cli

pytestmark = pytest.mark.integration


def epochs_recorded(run_dir) -> list[int]:
    return [r["epoch"] for r in runs.read_metrics(run_dir) if r.get("kind") == "epoch"]


def test_a_stuck_rank_is_named_and_killed_within_the_stall_timeout(ray_cluster, tiny_data, tmp_path):
    # Rank 1 stops making progress before its forward pass of step 3 (it sleeps forever, the
    # process alive); rank 0 waits in DDP's all-reduce, which by default would wait forever.
    env = {**os.environ, FAULT_ENV: "hang:1:3", "COLUMNS": "200"}
    args = ("train", "--data", str(tiny_data), "--name", "stuck", "--epochs", "1", "--batch-size", "32",
            "--storage", str(tmp_path), "--address", ray_cluster, "--stall-timeout", "8", "--log-every-steps", "1")
    done = subprocess.run([sys.executable, "-m", "imgtrain.cli", *args], capture_output=True, text=True,
                          timeout=240, env=env)

    assert done.returncode == 2
    message = done.stderr.strip().splitlines()[-1]
    assert message.startswith("error: training failed: rank 1 stuck: rank 1 (pid "), done.stderr
    assert "at step 3, in phase 'compute'" in message and "(rank 0 waited for it)" in message
    assert "no progress for 8 s (--stall-timeout)" in message

    # The diagnosis: the stuck rank's Python stack (where it hangs), its log files, where the
    # other rank waits, and every rank's full stacks in logs/hang-*.txt.
    out = done.stdout
    stack = out.split("rank 1 (stuck) stack, innermost last:\n")[1].split("rank 1 logs")[0]
    frames = [line.strip() for line in stack.splitlines() if line.strip()]
    assert frames[0].endswith("in run_loop") and "training/loop.py" in frames[0]
    assert "faults.py" in frames[-1] and frames[-1].endswith("in maybe_fire"), frames  # the injected hang
    logs_line = next(line for line in out.splitlines() if line.strip().startswith("rank 1 logs (on "))
    log_files = logs_line.split("): ", 1)[1].split(", ")
    assert [Path(p).suffix for p in log_files] == [".out", ".err"] and all(Path(p).is_file() for p in log_files)
    assert "rank 0 waits in: File " in out
    report = Path(re.search(r"stacks and logs: (\S+hang-[0-9-]+\.txt)", message).group(1))
    assert "OOM" not in message  # the rank the watchdog killed is not reported as a possible OOM kill
    assert report.parent == tmp_path / "stuck" / "logs"
    text = report.read_text()
    assert "(pid" in text and ": STUCK" in text and ": waiting" in text
    assert text.count("in run_loop") == 2 and "in maybe_fire" in text  # both ranks' training threads

    records = runs.read_metrics(tmp_path / "stuck")
    last_step = max(r["time"] for r in records if r["kind"] == "step")
    failed_at = runs.read_status(tmp_path / "stuck")["time"]
    assert failed_at - last_step < 8 + 30  # detected and ended soon after the timeout, not never


def test_a_full_disk_leaves_no_broken_checkpoint_and_says_the_disk_is_full(ray_cluster, tiny_data, tmp_path):
    storage = tmp_path / "small-disk"
    storage.mkdir()
    # 280 MB: room for one checkpoint (about 171 MB for ResNet-18 with AdamW state), not two.
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=280m", "tmpfs", str(storage)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({mounted.stderr.strip()}); needs root")
    try:
        done = run_cli("train", "--data", str(tiny_data), "--name", "full", "--epochs", "3",
                       "--batch-size", "32", "--storage", str(storage), "--address", ray_cluster)
        assert done.returncode == 2
        message = done.stderr.strip().splitlines()[-1]
        assert "is full (No space left on device)" in message, done.stderr
        assert "resumes from checkpoint_epoch_0000" in message
        run_dir = storage / "full"
        good, bad = ckpt.verified(run_dir)
        assert [p.name for p in good] == ["checkpoint_epoch_0000"] and bad == []
        leftovers = [d.name for d in run_dir.iterdir() if d.is_dir() and d.name.startswith("checkpoint_epoch")
                     and d not in good]
        assert leftovers == []  # nothing half written left visible
        model, _ = imgtrain.load_model(good[0])  # the last good checkpoint still loads
        assert sum(p.numel() for p in model.parameters()) > 11_000_000
    finally:
        subprocess.run(["umount", "-l", str(storage)], check=False)
