"""The watchdog's judgement on synthetic heartbeats: who is stuck, who is a victim waiting in a
collective, and what it writes. Taking stacks and killing go through Ray tasks on the rank's
node; here they are the two functions replaced, the decision is the real code."""

from __future__ import annotations

import json

import pytest

from imgtrain.training import watchdog
from imgtrain.training.watchdog import WORKERS_FILE, Watchdog, read_workers


def beat(rank, phase, since, now, pid=None, world=2):
    return {"rank": rank, "world_size": world, "pid": pid or 1000 + rank, "node_ip": "10.0.0.1",
            "node_id": "n1", "phase": phase, "phase_since": since, "step": 7, "time": now,
            "stack_file": f"/tmp/stacks-{rank}", "log_files": [f"/tmp/worker-{rank}.out"]}


@pytest.fixture
def acted(monkeypatch):
    """What the watchdog did: the ranks it asked for stacks and the pids it killed."""
    done = {"dumped": [], "killed": []}
    monkeypatch.setattr(watchdog, "dump_stacks", lambda beats: done["dumped"].append(sorted(b["rank"] for b in beats))
                        or {b["rank"]: 'File "loop.py", line 1 in run_loop\n' for b in beats})
    monkeypatch.setattr(watchdog, "kill_worker", lambda b: done["killed"].append(b["pid"]) or True)
    return done


def test_a_rank_in_its_own_work_past_the_timeout_is_named_and_killed_not_the_one_waiting(tmp_path, acted):
    (tmp_path / "logs").mkdir()
    notes = []
    dog = Watchdog(tmp_path, timeout_s=10, note=notes.append)
    now = 1000.0
    dog.observe([beat(0, "backward", now - 30, now), beat(1, "compute", now - 30, now)])  # rank 1 hangs
    assert [w["rank"] for w in read_workers(tmp_path)] == [0, 1]
    dog.check(now=now)
    assert acted["killed"] == [1001]  # rank 0 waits for it in a collective: a victim
    assert "rank 1 stuck" in dog.incident and "(rank 0 waited for it)" in dog.incident
    assert list((tmp_path / "logs").glob("hang-*.txt")) and notes and notes[0].startswith("warning: rank 1 stuck")
    dog.check(now=now + 5)
    assert acted["killed"] == [1001]  # acted once for this worker group


def test_nobody_is_killed_before_the_timeout_or_when_the_timeout_is_off(tmp_path, acted):
    now = 1000.0
    dog = Watchdog(tmp_path, timeout_s=10)
    dog.observe([beat(0, "compute", now - 9, now), beat(1, "data", now - 9, now)])
    dog.check(now=now)
    off = Watchdog(tmp_path, timeout_s=0)
    off.observe([beat(0, "compute", now - 999, now)])
    off.check(now=now)
    assert acted == {"dumped": [], "killed": []}


def test_a_slow_start_is_not_a_hang_but_a_start_past_its_allowance_is(tmp_path, acted):
    # Loading the data and building the model outlasted test_faults' 8 s stall timeout in a full
    # test run beside another (a busy machine; a data set in a bucket would too): the start has
    # its own, longer allowance.
    (tmp_path / "logs").mkdir()
    now = 1000.0
    dog = Watchdog(tmp_path, timeout_s=10)
    dog.observe([beat(0, "start", now - 60, now), beat(1, "start", now - 60, now)])
    dog.check(now=now)
    assert acted == {"dumped": [], "killed": []}
    late = now + watchdog.START_ALLOWANCE_S
    dog.observe([beat(0, "compute", late - 1, late), beat(1, "start", now - 60, late)])
    dog.check(now=late)
    assert acted["killed"] == [1001] and "rank 1 stuck" in dog.incident and "phase 'start'" in dog.incident


def test_every_rank_waiting_in_a_collective_too_long_is_a_deadlock_and_all_are_named(tmp_path, acted):
    (tmp_path / "logs").mkdir()
    now = 1000.0
    dog = Watchdog(tmp_path, timeout_s=10, note=lambda _: None)
    dog.observe([beat(0, "sync", now - 60, now), beat(1, "report", now - 60, now)])
    dog.check(now=now)
    assert sorted(acted["killed"]) == [1000, 1001] and "ranks 0, 1 stuck" in dog.incident


def test_silent_heartbeats_mean_a_frozen_process(tmp_path, acted):
    (tmp_path / "logs").mkdir()
    start = 1000.0
    dog = Watchdog(tmp_path, timeout_s=10, note=lambda _: None)
    dog.observe([beat(0, "forward", start, start), beat(1, "forward", start, start)])
    for t in range(1, 41):  # rank 1 beats every second, rank 0 has gone silent
        dog.observe([beat(1, "forward", start, start + t)])
    dog.check(now=start + 40)
    assert acted["killed"] == [1000] and "no heartbeat for 40 s" in dog.incident


def test_a_new_worker_group_replaces_the_old_ranks_in_workers_json(tmp_path, acted):
    now = 1000.0
    dog = Watchdog(tmp_path, timeout_s=10)
    dog.observe([beat(0, "compute", now, now), beat(1, "compute", now, now)])
    later = now + 60  # a retry with one worker: the old ranks stopped beating a minute ago
    dog.observe([beat(0, "compute", later, later, pid=2000, world=1)])
    workers = json.loads((tmp_path / WORKERS_FILE).read_text())["workers"]
    assert [(w["rank"], w["pid"], w["world_size"]) for w in workers] == [(0, 2000, 1)]
    dog.check(now=later + 1)
    assert acted["killed"] == []
