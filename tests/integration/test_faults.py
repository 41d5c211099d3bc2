"""Failures for real: processes killed with SIGKILL, then the same command run again."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from imgtrain import runs
from tests.conftest import run_cli

pytestmark = pytest.mark.integration


def wait_for(condition, timeout: float, what: str, proc=None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited ({proc.returncode}) before {what}: {proc.stderr.read()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.2)


def epochs_recorded(run_dir) -> list[int]:
    return [r["epoch"] for r in runs.read_metrics(run_dir) if r.get("kind") == "epoch"]


def test_killed_driver_then_the_same_command_resumes(ray_cluster, tiny_data, tmp_path):
    args = ("train", "--data", str(tiny_data), "--name", "kill", "--epochs", "3", "--batch-size", "32",
            "--storage", str(tmp_path), "--address", ray_cluster)
    run_dir = tmp_path / "kill"
    driver = subprocess.Popen([sys.executable, "-m", "imgtrain.cli", *args], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "COLUMNS": "200"})
    try:
        wait_for(lambda: epochs_recorded(run_dir), 240, "the first epoch's checkpoint", driver)
        driver.kill()  # SIGKILL: no handler runs, status.json still says "running"
        driver.wait(timeout=30)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert runs.read_status(run_dir)["status"] == "interrupted"  # the recorded pid is dead

    again = run_cli(*args)
    assert again.returncode == 0, again.stderr
    assert "resuming run 'kill'" in again.stdout
    assert epochs_recorded(run_dir) == [0, 1, 2]  # every epoch exactly once
    starts = [r["step"] for r in runs.read_metrics(run_dir) if r["kind"] == "start"]
    assert starts[0] == 0 and starts[-1] >= 8  # the second run began after a saved epoch
    assert runs.read_status(run_dir)["status"] == "finished"
