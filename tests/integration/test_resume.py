"""Exact resumption, proved with the sample ledger and the final weights.

One uninterrupted reference run, then the same config interrupted in three real ways: an
exception on one rank (retried by Ray Train), a failure past ``max_failures`` resumed by hand
with another world size and the other ingest, and SIGKILLed worker processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

import imgtrain
from imgtrain import checkpoint as ckpt
from imgtrain import runs
from imgtrain.config import TrainConfig
from imgtrain.training.faults import ENV_VAR as FAULT_ENV
from imgtrain.training.watchdog import read_workers
from tests.conftest import quiet_display, run_cli, wait_for

pytestmark = pytest.mark.integration

QUIET = quiet_display()
# 256 rows / batch 16 = 16 steps per epoch, 48 in all; step checkpoints at global steps 8, 24, 40.
SETTINGS = dict(workers=2, epochs=3, batch_size=16, eval_batch_size=50, log_every_steps=1,
                checkpoint_every_steps=8, deterministic=True, ledger=True, max_failures=0)
STEPS_PER_EPOCH = 16
HISTORY_KEYS = ("epoch", "step", "train_loss", "train_accuracy", "val_loss", "val_accuracy",
                "train_samples", "val_samples", "lr")


def config(data, storage, name, **overrides) -> TrainConfig:
    return TrainConfig(data=str(data), storage=str(storage), name=name, **{**SETTINGS, **overrides})


def cli_args(data, storage, name) -> list[str]:
    return ["train", "--data", str(data), "--storage", str(storage), "--name", name, "--workers", "2",
            "--epochs", "3", "--batch-size", "16", "--checkpoint-every-steps", "8", "--deterministic",
            "--ledger", "--log-every-steps", "1", "--eval-batch-size", "50"]


@pytest.fixture(scope="module")
def reference(ray_cluster, tiny_data, tmp_path_factory) -> Path:
    """The uninterrupted run every interrupted one must reproduce."""
    storage = tmp_path_factory.mktemp("reference")
    result = imgtrain.train(config(tiny_data, storage, "ref"), display=QUIET)
    assert result.status == "finished"
    return result.path


def ledger_lines(run_dir: Path) -> list[dict]:
    return [line for path in sorted((run_dir / "ledger").glob("rank-*.jsonl")) for line in runs.read_jsonl(path)]


def committed_batches(run_dir: Path) -> dict[int, dict[int, list[int]]]:
    """{global step: {rank: ids}} as they went into the final weights: when a step was trained
    again after a failure, the worker group that trained it last is the one whose update
    survived (the dead group's work after its last checkpoint was lost with it)."""
    started: dict[int, float] = {}
    steps: dict[int, dict[int, dict[int, list[int]]]] = defaultdict(lambda: defaultdict(dict))
    for line in ledger_lines(run_dir):
        started[line["group"]] = min(started.get(line["group"], line["group_started"]), line["group_started"])
        steps[line["step"]][line["group"]][line["rank"]] = line["ids"]
    return {step: by_group[max(by_group, key=started.get)] for step, by_group in steps.items()}


def global_batches(run_dir: Path) -> dict[int, list[int]]:
    """{global step: the ids of the whole global batch, rank 0's rows first}."""
    return {step: [i for rank in sorted(ranks) for i in ranks[rank]]
            for step, ranks in committed_batches(run_dir).items()}


def assert_each_row_once_per_epoch(batches: dict[int, list[int]]) -> None:
    assert sorted(batches) == list(range(3 * STEPS_PER_EPOCH))  # every step, none missing
    for epoch in range(3):
        ids = [i for s in range(epoch * STEPS_PER_EPOCH, (epoch + 1) * STEPS_PER_EPOCH) for i in batches[s]]
        assert len(ids) == len(set(ids)) == STEPS_PER_EPOCH * 16  # none replayed, none skipped


def history(run_dir: Path) -> list[dict]:
    return [{k: r[k] for k in HISTORY_KEYS} for r in runs.epoch_history(run_dir)]


def final_weights(run_dir: Path) -> dict:
    _, latest = ckpt.best_and_latest(run_dir)
    assert latest.name == "checkpoint_epoch_0002"
    return ckpt.load_model_state(latest)


def max_weight_difference(a: Path, b: Path) -> float:
    wa, wb = final_weights(a), final_weights(b)
    assert wa.keys() == wb.keys()
    return max((wa[k].double() - wb[k].double()).abs().max().item() for k in wa)


def test_the_reference_ledger_shows_one_global_order(reference):
    batches = global_batches(reference)
    assert_each_row_once_per_epoch(batches)
    lines = ledger_lines(reference)
    assert {line["group"] for line in lines} == {lines[0]["group"]}  # one worker group
    assert {line["rank"] for line in lines} == {0, 1}


def test_an_exception_on_one_rank_is_retried_and_the_run_is_the_same_run(
        ray_cluster, tiny_data, tmp_path, reference, monkeypatch):
    # Rank 1 raises while training global step 27 (epoch 2, its 12th step); Ray Train restarts
    # the worker group from the step checkpoint taken after step 24.
    monkeypatch.setenv(FAULT_ENV, "raise:1:27")
    result = imgtrain.train(config(tiny_data, tmp_path, "retry", max_failures=1), display=QUIET)

    assert result.status == "finished"
    assert (result.path / ".faults" / "raise-1-27-1").is_file()  # the fault really fired
    starts = [r for r in runs.read_metrics(result.path) if r["kind"] == "start"]
    assert [(s["step"], s["epoch_step"]) for s in starts] == [(0, 0), (24, 8)]
    assert global_batches(result.path) == global_batches(reference)
    assert history(result.path) == history(reference)
    assert max_weight_difference(result.path, reference) <= 1e-6


def test_failures_past_the_limit_fail_clearly_then_resume_exactly_with_another_world_size(
        ray_cluster, tiny_data, tmp_path, reference):
    args = cli_args(tiny_data, tmp_path, "grow") + ["--ingest", "torch", "--address", ray_cluster]
    env_fault = {**os.environ, FAULT_ENV: "raise:0:27", "COLUMNS": "200"}
    failed = subprocess.run([sys.executable, "-m", "imgtrain.cli", *args], capture_output=True, text=True,
                            timeout=300, env=env_fault)
    assert failed.returncode != 0
    message = failed.stderr.strip().splitlines()[-1]
    assert message.startswith("error: training failed: rank 0: InjectedFault"), failed.stderr
    assert "resumes from checkpoint_epoch_0001_step_0000024" in message
    run_dir = tmp_path / "grow"
    assert runs.read_status(run_dir)["status"] == "failed"

    # The same command, now with one worker: the torch DataLoader ingest at world size 1
    # continues the global order where two workers stopped.
    again = run_cli(*args, "--workers", "1")
    assert again.returncode == 0, again.stderr
    assert "resuming run 'grow' at epoch 2, step 24" in again.stdout
    batches = global_batches(run_dir)
    assert_each_row_once_per_epoch(batches)
    assert batches == global_batches(reference)  # the same rows at every step, at any world size
    ranks_per_step = {len(ranks) for step, ranks in committed_batches(run_dir).items() if step >= 24}
    assert ranks_per_step == {1}  # one worker trained everything after the checkpoint
    assert [r["epoch"] for r in runs.epoch_history(run_dir)] == [0, 1, 2]


def test_sigkilled_workers_are_replaced_and_the_run_ends_as_if_nothing_happened(
        ray_cluster, tiny_data, tmp_path, reference):
    args = cli_args(tiny_data, tmp_path, "kill") + ["--max-failures", "2", "--address", ray_cluster]
    run_dir = tmp_path / "kill"
    driver = subprocess.Popen([sys.executable, "-m", "imgtrain.cli", *args], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "COLUMNS": "200"})
    killed = []
    try:
        for rank, after_step in ((1, 8), (0, 24)):  # SIGKILL two worker processes, one at a time
            def checkpointed_by_this_group():
                records = runs.read_metrics(run_dir)
                start = max((i for i, r in enumerate(records) if r["kind"] == "start"), default=None)
                return start is not None and any(
                    r["kind"] == "checkpoint" and r["step"] >= after_step for r in records[start:])

            wait_for(checkpointed_by_this_group, 240, f"a checkpoint at step {after_step}", driver)
            wait_for(lambda: all(w["pid"] not in killed for w in read_workers(run_dir)), 60,
                     "the new worker group", driver)
            workers = {w["rank"]: w["pid"] for w in read_workers(run_dir)}
            os.kill(workers[rank], signal.SIGKILL)
            killed.append(workers[rank])
        assert driver.wait(timeout=300) == 0, driver.stderr.read()
    finally:
        if driver.poll() is None:
            driver.kill()

    starts = [r["step"] for r in runs.read_metrics(run_dir) if r["kind"] == "start"]
    assert len(starts) == 3 and starts[0] == 0  # two restarts, each from a checkpoint
    assert [r["epoch"] for r in runs.epoch_history(run_dir)] == [0, 1, 2]
    assert history(run_dir) == history(reference)  # same losses and accuracies, to the bit
    assert max_weight_difference(run_dir, reference) <= 1e-6
    assert global_batches(run_dir) == global_batches(reference)


def test_a_driver_sigkilled_right_after_a_checkpoint_loses_no_epoch(ray_cluster, tiny_data, tmp_path, reference):
    # The moment the second epoch's model.pt is on disk the driver dies, before (or while) the
    # epoch's record travels to it; the same command again must give the uninterrupted history.
    args = cli_args(tiny_data, tmp_path, "drv") + ["--address", ray_cluster]
    run_dir = tmp_path / "drv"
    driver = subprocess.Popen([sys.executable, "-m", "imgtrain.cli", *args], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "COLUMNS": "200"})
    try:
        model_pt = run_dir / "checkpoint_epoch_0001" / ckpt.MODEL_FILE
        wait_for(model_pt.is_file, 240, "the second epoch's checkpoint", driver, poll_s=0.01)
        driver.kill()  # SIGKILL: no handler runs, status.json still says "running"
        driver.wait(timeout=30)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert runs.read_status(run_dir)["status"] == "interrupted"  # the recorded pid is dead

    again = run_cli(*args)
    assert again.returncode == 0, again.stderr
    assert "resuming run 'drv'" in again.stdout
    assert [r["epoch"] for r in runs.read_metrics(run_dir) if r["kind"] == "epoch"] == [0, 1, 2]  # once each
    assert history(run_dir) == history(reference)
    assert runs.read_status(run_dir)["status"] == "finished"
    assert sorted(w["rank"] for w in read_workers(run_dir)) == [0, 1]  # the last worker group's


def test_rank_0_killed_right_after_saving_is_retried_and_no_epoch_is_lost(
        ray_cluster, tiny_data, tmp_path, reference, monkeypatch):
    # Rank 0's process dies (SIGKILL) right after epoch 0's checkpoint was stored, before it
    # sent the epoch's record. Ray Train restarts the group from the newest checkpoint it had
    # registered: epoch 0's (then its record comes back from the checkpoint's history) or, when
    # the death was noticed first, the step checkpoint before it (then epoch 0 is trained again).
    monkeypatch.setenv(FAULT_ENV, "kill-saved:0:16")
    result = imgtrain.train(config(tiny_data, tmp_path, "saved", max_failures=1), display=QUIET)
    assert result.status == "finished"
    assert (result.path / ".faults" / "kill-saved-0-16-1").is_file()  # the fault really fired
    starts = [r for r in runs.read_metrics(result.path) if r["kind"] == "start"]
    assert [s["step"] for s in starts] in ([0, 8], [0, 16])  # one retry, from a checkpoint
    assert [r["epoch"] for r in runs.read_metrics(result.path) if r["kind"] == "epoch"] == [0, 1, 2]
    assert history(result.path) == history(reference)
    assert max_weight_difference(result.path, reference) <= 1e-6
    assert sorted(w["rank"] for w in read_workers(result.path)) == [0, 1]
