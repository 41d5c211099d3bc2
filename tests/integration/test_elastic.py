"""Elastic training on a real multi-node Ray cluster: a node leaves, a node joins."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from imgtrain import runs
from imgtrain.training.watchdog import read_workers
from tests.conftest import wait_for
from tests.integration.test_resume import global_batches

pytestmark = pytest.mark.integration


def starts(run_dir) -> list[dict]:
    return [r for r in runs.read_metrics(run_dir) if r["kind"] == "start"]


def checkpointed_since_last_start(run_dir, world_size: int) -> bool:
    records = runs.read_metrics(run_dir)
    last = max((i for i, r in enumerate(records) if r["kind"] == "start"), default=None)
    return (last is not None and records[last]["world_size"] == world_size
            and any(r["kind"] == "checkpoint" for r in records[last:]))


# Growing back took about 35 s from the new node's start (Ray Train sees the cluster as of up to
# 20 s ago, and looks every ELASTIC_CHECK_S), 8 epochs of this data at one worker: with 8 epochs
# in all the run once grew back 4 s before its end; 10 leave two epochs to spare.
EPOCHS = 10


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
    try:
        cluster = ask()
        driver = subprocess.Popen(
            [sys.executable, "-m", "imgtrain.cli", "train", "--data", str(tiny_data), "--name", "elastic",
             "--storage", str(tmp_path), "--address", cluster["address"], "--workers", "1-2", "--ingest", "torch",
             "--epochs", str(EPOCHS), "--batch-size", "16", "--checkpoint-every-steps", "8", "--max-failures", "3",
             "--ledger", "--log-every-steps", "1", "--eval-batch-size", "50"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, "COLUMNS": "200"})

        wait_for(lambda: checkpointed_since_last_start(run_dir, 2), 240, "two workers and a checkpoint", driver)
        victim = next(w for w in read_workers(run_dir) if w["rank"] == 1)["node_id"]
        ask(f"remove {victim}")  # its raylet and the worker on it die at once
        wait_for(lambda: checkpointed_since_last_start(run_dir, 1), 180, "one worker going on", driver)
        ask("add")
        wait_for(lambda: starts(run_dir)[-1]["world_size"] == 2, 180, "growing back to two workers", driver)
        assert driver.wait(timeout=300) == 0, driver.stderr.read()
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
        if helper.poll() is None:
            helper.stdin.close()  # end of input: the helper stops every node it started
            helper.wait(timeout=60)

    worlds = [s["world_size"] for s in starts(run_dir)]
    assert worlds[0] == 2 and 1 in worlds and worlds[-1] == 2
    assert [r["epoch"] for r in runs.epoch_history(run_dir)] == list(range(EPOCHS))
    batches = global_batches(run_dir)
    assert sorted(batches) == list(range(EPOCHS * 16))
    for epoch in range(EPOCHS):  # every row exactly once per epoch, through both resizes
        ids = [i for s in range(epoch * 16, (epoch + 1) * 16) for i in batches[s]]
        assert len(ids) == len(set(ids)) == 16 * 16
    assert {len(ids) for ids in batches.values()} == {16}  # the global batch never changed
