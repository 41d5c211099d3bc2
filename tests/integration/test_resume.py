"""Exact resumption on Ray, proved with the sample ledger and the final weights.

One uninterrupted reference run, then the same config with SIGKILLed worker processes, which
Ray Train replaces: the run must end with the reference's numbers, to the bit. An exception
retried by Ray Train, a failure past ``max_failures`` and a resume with another world size are
proved on one streamed run in test_streamed.py; what does not depend on Ray (a SIGKILLed
driver, the history put right from a checkpoint) on the local backend in test_history.py.
"""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import imgtrain
from imgtrain.checkpoint_policy import POLICY
from imgtrain.config import TrainConfig, rank_share
from imgtrain.storage import checkpoint as ckpt
from imgtrain.storage import runs
from imgtrain.training.faults import ENV_VAR as FAULT_ENV
from imgtrain.training.watchdog import read_workers
from tests.conftest import quiet_display, wait_for
from tests.integration.ledger import global_batches, ledger_lines

pytestmark = pytest.mark.integration

QUIET = quiet_display()
# 256 rows / batch 32 = 8 steps per epoch, 24 in all; step checkpoints at global steps 4, 12, 20.
# One torch thread per worker, whatever the machine: more than the cores make OpenMP spin against
# the other processes (5 times slower on a busy machine here).
# A small model (timm's test ResNet): nine checkpoints a run, and ResNet-18's are 135 MB each;
# what is proved is the resumption, whatever the model.
SETTINGS = dict(workers=2, epochs=3, batch_size=32, eval_batch_size=50, log_every_steps=1,
                checkpoint_every_steps=4, deterministic=True, ledger=True, max_failures=0, threads_per_worker=1,
                model="timm:test_resnet")
STEPS_PER_EPOCH = 8
HISTORY_KEYS = ("epoch", "step", "train_loss", "train_accuracy", "val_loss", "val_accuracy", "val_f1_macro",
                "train_samples", "val_samples", "lr")


def config(data, storage, name, **overrides) -> TrainConfig:
    return TrainConfig(data=str(data), storage=str(storage), name=name, **{**SETTINGS, **overrides})


@pytest.fixture(scope="module")
def reference(ray_cluster, tiny_data, tmp_path_factory) -> Path:
    """The uninterrupted run every interrupted one must reproduce."""
    storage = tmp_path_factory.mktemp("reference")
    result = imgtrain.train(config(tiny_data, storage, "ref"), display=QUIET)
    assert result.status == "finished"
    return result.path


def assert_each_row_once_per_epoch(batches: dict[int, list[int]]) -> None:
    assert sorted(batches) == list(range(3 * STEPS_PER_EPOCH))  # every step, none missing
    for epoch in range(3):
        ids = [i for s in range(epoch * STEPS_PER_EPOCH, (epoch + 1) * STEPS_PER_EPOCH) for i in batches[s]]
        assert len(ids) == len(set(ids)) == STEPS_PER_EPOCH * 32  # none replayed, none skipped


def history(run_dir: Path) -> list[dict]:
    return [{k: r[k] for k in HISTORY_KEYS} for r in runs.epoch_history(run_dir)]


def starts(run_dir: Path) -> list[dict]:
    """The start records: one per worker group (the first, then one per retry or resume)."""
    return [r for r in runs.read_metrics(run_dir) if r["kind"] == "start"]


def final_weights(run_dir: Path) -> dict:
    _, latest = ckpt.best_and_latest(run_dir)
    assert latest.name == POLICY.epoch_name(2)
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


def assert_every_group_trained_the_reference_rows(run_dir: Path, reference: Path) -> None:
    """Every line of the ledger, the worker groups that died included, holds the rows the
    uninterrupted order gives its rank at its step and world size."""
    rows = global_batches(reference)
    for line in ledger_lines(run_dir):
        share = rank_share(SETTINGS["batch_size"], line["world_size"], line["rank"])
        assert line["ids"] == rows[line["step"]][share], (line["step"], line["rank"], line["world_size"])


def sigkill_rank_1_of_the_second_group(run_dir: Path, training_over: threading.Event) -> int:
    """Once the worker group that replaced the first one has stored a checkpoint at step 12 or
    later, SIGKILL its rank 1; returns the pid killed. Runs beside training, in a thread."""
    first_group: set[int] = set()

    def first_group_seen():
        first_group.update(w["pid"] for w in read_workers(run_dir))
        return len(first_group) == 2 or training_over.is_set()

    def second_group_checkpointed():
        records = runs.read_metrics(run_dir)
        begun = [i for i, r in enumerate(records) if r["kind"] == "start"]
        workers = {w["pid"] for w in read_workers(run_dir)}
        return training_over.is_set() or (
            len(begun) == 2 and any(r["kind"] == "checkpoint" and r["step"] >= 12 for r in records[begun[1]:])
            and len(workers) == 2 and not workers & first_group)

    # The first group lives for its first epoch at least: seen long before it is replaced.
    wait_for(first_group_seen, 240, "the first worker group")
    wait_for(second_group_checkpointed, 240, "a checkpoint at step 12 by the second worker group")
    assert not training_over.is_set(), "training ended before rank 1 of the second group was killed"
    pid = next(w["pid"] for w in read_workers(run_dir) if w["rank"] == 1)
    os.kill(pid, signal.SIGKILL)
    return pid


def test_sigkilled_workers_are_replaced_and_the_run_ends_as_if_nothing_happened(
        ray_cluster, tiny_data, tmp_path, reference, monkeypatch):
    # Two worker processes die by SIGKILL, one after the other; Ray Train replaces the group from
    # a checkpoint each time. First rank 0, right after epoch 0's checkpoint was stored, before it
    # sent the epoch's record: Ray Train restarts from the newest checkpoint it had registered,
    # epoch 0's (then its record comes back from the checkpoint's history) or, when the death was
    # noticed first, the step checkpoint before it (then epoch 0 is trained again). Then rank 1 of
    # the new group, killed from outside by this test. The torch DataLoader ingest here, Ray
    # Data's in the reference: each worker group starts it inside an epoch, and the two ingests
    # must give the same bits.
    monkeypatch.setenv(FAULT_ENV, "kill-saved:0:8")
    run_dir, training_over = tmp_path / "kill", threading.Event()
    with ThreadPoolExecutor(1) as pool:
        killer = pool.submit(sigkill_rank_1_of_the_second_group, run_dir, training_over)
        try:
            result = imgtrain.train(config(tiny_data, tmp_path, "kill", ingest="torch", max_failures=2), display=QUIET)
        finally:
            training_over.set()
        killed = killer.result()

    assert result.status == "finished"
    assert (run_dir / ".faults" / "kill-saved-0-8-1").is_file()  # the fault really fired
    begun = [s["step"] for s in starts(run_dir)]
    assert len(begun) == 3 and begun[0] == 0 and begun[1] in (4, 8)  # two restarts, each from a checkpoint
    assert [r["epoch"] for r in runs.read_metrics(run_dir) if r["kind"] == "epoch"] == [0, 1, 2]  # once each
    assert history(run_dir) == history(reference)  # same losses and accuracies, to the bit
    assert max_weight_difference(run_dir, reference) <= 1e-6
    assert global_batches(run_dir) == global_batches(reference)
    assert_every_group_trained_the_reference_rows(run_dir, reference)
    workers = read_workers(run_dir)  # the last worker group's
    assert sorted(w["rank"] for w in workers) == [0, 1] and killed not in {w["pid"] for w in workers}
