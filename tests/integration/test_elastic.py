"""Elastic training on a real multi-node Ray cluster: a node leaves, a node joins."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from imgtrain.storage import runs
from imgtrain.training.ray_backend import START_TIMEOUT_ENV
from imgtrain.training.watchdog import read_workers
from tests.conftest import wait_for
from tests.integration.ledger import global_batches

pytestmark = pytest.mark.integration

# 256 rows / batch 16: 16 steps an epoch. More epochs than the test ever waits for: how many
# pass before the run grows back depends on Ray's timers against this machine's speed (16-18 s
# from the new node's start: Ray Train looks every ELASTIC_CHECK_S, at a view of the cluster the
# helper's coordinator refreshes every 2 s; 7 epochs at one worker on a quiet machine). A run sized to
# end just after growing back once ended before it (8 epochs), and on a busy machine trains on
# for a minute after it (10 epochs); this one is stopped once the grown group has finished an
# epoch. SIGKILL: how a run ends is other tests' business, and Ray Train takes SIGINT over
# (the process then exits 1, the run marked failed).
EPOCHS, STEPS_PER_EPOCH = 100, 16
# After the loss Ray Train may still count the dead node (its view of the cluster is refreshed
# every 20 s by Ray, 2 s by the helper's), ask for two workers and wait for their placement
# before trying with one: imgtrain's 20 s for elastic runs, unless the user sets Ray's own
# variable, as this test does (the nodes here are up at once: placing a worker takes milliseconds).
PLACEMENT_WAIT_S = 5


def checkpointed_since_last_start(run_dir, world_size: int, epoch_end: bool = False) -> bool:
    """The latest worker group has ``world_size`` workers and has saved a checkpoint since it
    started (``epoch_end``: an epoch's, so that whole epoch is in the run)."""
    records = runs.read_metrics(run_dir)
    last = max((i for i, r in enumerate(records) if r["kind"] == "start"), default=None)
    return (last is not None and records[last]["world_size"] == world_size
            and any(r.get("checkpoint") and (r["kind"] == "epoch" or not epoch_end) for r in records[last + 1:]))


def print_timeline(run_dir, moments: dict[str, float]) -> None:
    """The test's moments and the run's worker-group starts and checkpoints, in seconds from the
    test's start (shown when the test fails: which wait took the time)."""
    for r in runs.read_metrics(run_dir) if run_dir.exists() else []:
        if r["kind"] == "start":
            moments[f"start at step {r['step']}, {r['world_size']} worker(s)"] = r["time"]
        elif r.get("checkpoint") and "time" in r:
            moments[f"{r['kind']} at step {r['step']}"] = r["time"]
    start = moments["test"]
    print("\n".join(f"{t - start:6.1f} s  {what}" for what, t in sorted(moments.items(), key=lambda m: m[1])))


def test_an_elastic_run_shrinks_when_a_node_leaves_and_grows_back_when_one_joins(tiny_data, tmp_path):
    helper = subprocess.Popen([sys.executable, "-m", "tests.integration.cluster_helper"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def ask(command: str | None = None) -> dict:
        if command:
            helper.stdin.write(command + "\n")
            helper.stdin.flush()
        return json.loads(helper.stdout.readline())

    run_dir = tmp_path / "elastic"
    driver = None
    moments = {"test": time.time()}  # printed at the end: where the minutes went, if it fails
    try:
        cluster = ask()
        moments["cluster up"] = time.time()
        driver = subprocess.Popen(
            [sys.executable, "-m", "imgtrain.cli", "train", "--data", str(tiny_data), "--name", "elastic",
             "--storage", str(tmp_path), "--address", cluster["address"], "--workers", "1-2", "--ingest", "torch",
             "--epochs", str(EPOCHS), "--batch-size", "16", "--checkpoint-every-steps", "8", "--max-failures", "3",
             "--ledger", "--log-every-steps", "1", "--eval-batch-size", "50",
             "--model", "timm:test_resnet", "--threads-per-worker", "1"],  # the resizes are the point, not the model
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "COLUMNS": "200", START_TIMEOUT_ENV: str(PLACEMENT_WAIT_S)})

        wait_for(lambda: checkpointed_since_last_start(run_dir, 2), 240, "two workers and a checkpoint", driver)
        victim = next(w for w in read_workers(run_dir) if w["rank"] == 1)["node_id"]
        moments["node removed"] = time.time()
        ask(f"remove {victim}")  # its raylet and the worker on it die at once
        wait_for(lambda: checkpointed_since_last_start(run_dir, 1), 180, "one worker going on", driver)
        moments["node added"] = time.time()
        ask("add")
        # Grown back, and through a whole epoch's end: the epoch it grew in is complete.
        wait_for(lambda: checkpointed_since_last_start(run_dir, 2, epoch_end=True), 180, "growing back to two workers",
                 driver)
        moments["driver stopped"] = time.time()
        driver.kill()  # everything the test asks of the run is on disk; the rest would repeat it
        driver.wait(timeout=60)
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
        if helper.poll() is None:
            helper.stdin.close()  # end of input: the helper stops every node it started
            helper.wait(timeout=60)
        print_timeline(run_dir, moments)

    worlds = [s["world_size"] for s in runs.read_metrics(run_dir) if s["kind"] == "start"]
    assert worlds[0] == 2 and 1 in worlds and worlds[-1] == 2
    epochs = [r["epoch"] for r in runs.epoch_history(run_dir)]
    assert epochs == list(range(len(epochs))) and len(epochs) >= 2  # none missing, the resizes' epochs among them
    batches = global_batches(run_dir)
    assert sorted(batches) == list(range(len(batches)))  # every step trained, none missing, in every group
    for epoch in epochs:  # every row exactly once per epoch, through both resizes
        ids = [i for s in range(epoch * STEPS_PER_EPOCH, (epoch + 1) * STEPS_PER_EPOCH) for i in batches[s]]
        assert len(ids) == len(set(ids)) == 16 * STEPS_PER_EPOCH
    # the global batch never changed; the steps after the last epoch's end are left out: the test
    # kills the run there, and a step one rank had logged and the other had not is cut in half
    assert {len(batches[s]) for s in range(len(epochs) * STEPS_PER_EPOCH)} == {16}
