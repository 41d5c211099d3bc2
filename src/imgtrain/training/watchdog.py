"""The driver's view of its workers: who they are (``workers.json``) and whether one is stuck.

Every rank sends a heartbeat each second with its step and phase (``health.py``). A rank is
*stuck* when its heartbeats stop (the process is frozen) or when it has spent longer than
``stall_timeout_s`` in a phase where it waits for nobody. The other ranks are then blocked in
a collective (DDP's all-reduce, the report barrier) and would wait forever: the default in Ray
Train and torch.distributed. The watchdog names the stuck ranks, prints their Python stacks
and log files (every rank's stacks go to ``logs/hang-*.txt``), and kills their processes,
which turns the hang into an ordinary worker failure: Ray Train retries it from the latest
checkpoint while ``max_failures`` allows, and otherwise the run fails with this message.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from imgtrain.ops.files import atomic_write_text
from imgtrain.training import stacks
from imgtrain.training.health import COLLECTIVE_PHASES, HEARTBEAT_S

WORKERS_FILE = "workers.json"
# Before its first step a rank loads its data and builds its model, which take what they take (a
# data set read from a bucket, a busy machine's imports): the stall timeout is for a rank that
# trained, and its start gets at least this long. A start that hangs is still found, later.
START_ALLOWANCE_S = 120.0


class Watchdog:
    def __init__(self, run_dir: Path, timeout_s: float, note=print):
        self.path = run_dir / WORKERS_FILE
        self.timeout_s = timeout_s
        self.note = note
        self.beats: dict[int, dict] = {}  # rank -> latest heartbeat of the current worker group
        self.incident: str | None = None  # what was found stuck, for the final error
        self.acted = False  # killed ranks of the current worker group: wait for the next one
        self.killed_ranks: set[int] = set()  # their deaths are ours, not a cause to report
        self.seen_pids: set[int] = set()
        self.gone_pids: set[int] = set()  # found dead already: Ray Train handles those itself

    def observe(self, beats: list[dict]) -> None:
        changed = False
        for beat in sorted(beats, key=lambda b: b["time"]):
            if beat["pid"] not in self.seen_pids:
                self.seen_pids.add(beat["pid"])
                changed = True
                self.acted = False
                # A new process: maybe a new worker group (a retry, another world size). Ranks
                # of an old group have stopped beating and must not be taken for stuck ones.
                self.beats = {r: b for r, b in self.beats.items()
                              if b["time"] >= beat["time"] - 3 * HEARTBEAT_S and r < beat["world_size"]}
            if beat["pid"] not in self.gone_pids:
                self.beats[beat["rank"]] = beat
        if changed:
            self._write()

    def check(self, now: float | None = None) -> None:
        """Kill the stuck ranks, if any; afterwards ``incident`` says what happened."""
        if not self.timeout_s or not self.beats or self.acted:
            return
        now = now or time.time()
        stuck = [b for b in self.beats.values() if _stuck(b, now, self.timeout_s)]
        if not stuck and all(now - b["phase_since"] > _allowance(b, self.timeout_s) for b in self.beats.values()):
            stuck = list(self.beats.values())  # every rank waits in a collective: a deadlock
        if not stuck:
            return
        dumps = dump_stacks(list(self.beats.values()))  # before killing anything: where is each rank?
        for b in stuck:
            if dumps.get(b["rank"]) is None:  # already gone: a failure Ray Train handles itself
                self.gone_pids.add(b["pid"])
                self.beats.pop(b["rank"], None)
        stuck = [b for b in stuck if dumps.get(b["rank"]) is not None]
        if not stuck:
            return
        report = self._write_report(stuck, dumps, now)
        killed = [b for b in stuck if kill_worker(b)]
        if not killed:
            return
        self.acted = True  # the survivors fail next, as Ray Train restarts or ends the group
        self.killed_ranks.update(b["rank"] for b in killed)
        waiting = sorted(b["rank"] for b in self.beats.values() if b not in killed and b["phase"] in COLLECTIVE_PHASES)
        described = "; ".join(_describe(b, now) for b in sorted(killed, key=lambda b: b["rank"]))
        many = len(killed) > 1
        self.incident = (
            f"rank{'s' if many else ''} {', '.join(str(b['rank']) for b in killed)} stuck: {described}"
            + (f" (rank{'s' if len(waiting) > 1 else ''} {', '.join(map(str, waiting))} waited for "
               f"{'them' if many else 'it'})" if waiting else "")
            + f"; no progress for {self.timeout_s:g} s (--stall-timeout), so {'they were' if many else 'it was'} killed"
            + f"; stacks and logs: {report}"
        )
        self.note("\n".join([f"warning: {self.incident}", *_diagnosis(self.beats.values(), killed, dumps)]))

    def _write_report(self, stuck: list[dict], dumps: dict[int, str], now: float) -> Path:
        """Every rank's state, log files and full stacks, in ``logs/hang-*.txt``."""
        path = stacks.report_path(self.path.parent / "logs")
        lines = [f"imgtrain hang report, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
                 f"run: {self.path.parent}; no progress for {self.timeout_s:g} s (--stall-timeout)",
                 "Python stacks from faulthandler, innermost call first. For native (C++/CUDA) frames, run "
                 "`py-spy dump --native --pid PID` on the rank's node while it hangs.", ""]
        for b in sorted(self.beats.values(), key=lambda b: b["rank"]):
            state = "STUCK" if b in stuck else "waiting" if b["phase"] in COLLECTIVE_PHASES else "running"
            lines += [f"== {_describe(b, now)}: {state}",
                      f"   node {b['node_id']}; logs: {', '.join(b.get('log_files') or []) or 'unknown'}",
                      dumps.get(b["rank"]) or "   (no stacks: the process did not answer SIGUSR1)", ""]
        path.write_text("\n".join(lines))
        return path

    def _write(self) -> None:
        workers = [{k: b.get(k) for k in ("rank", "world_size", "pid", "node_ip", "node_id", "log_files")}
                   for _, b in sorted(self.beats.items())]
        atomic_write_text(self.path, json.dumps({"updated": time.time(), "workers": workers}, indent=2))


def read_workers(run_dir: Path) -> list[dict]:
    """The current worker group of a run (rank, pid, node) as the driver last saw it."""
    path = Path(run_dir) / WORKERS_FILE
    return json.loads(path.read_text())["workers"] if path.is_file() else []


def _diagnosis(beats, killed: list[dict], dumps: dict[int, str]) -> list[str]:
    """Terminal lines: each stuck rank's training stack and logs, where each other rank waits."""
    lines = []
    for b in sorted(beats, key=lambda b: b["rank"]):
        frames = stacks.training_frames(dumps.get(b["rank"]) or "")
        if b in killed:
            lines.append(f"  rank {b['rank']} (stuck) stack, innermost last:")
            lines += [f"    {frame}" for frame in frames] or ["    (no stack: the process did not answer SIGUSR1)"]
            lines.append(f"  rank {b['rank']} logs (on {b['node_ip']}): {', '.join(b.get('log_files') or []) or 'unknown'}")
        elif frames:
            lines.append(f"  rank {b['rank']} waits in: {frames[-1]}")
    return lines


def dump_stacks(beats: list[dict]) -> dict[int, str | None]:
    """rank -> its Python stacks, by a task on its node ('' no answer, None process gone)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    pending, found = {}, {}
    for b in beats:
        if not b.get("stack_file"):
            found[b["rank"]] = ""
            continue
        task = ray.remote(stacks.dump).options(
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(b["node_id"], soft=False))
        pending[b["rank"]] = task.remote(b["pid"], b["stack_file"])
    for rank, ref in pending.items():
        try:
            found[rank] = ray.get(ref, timeout=30)
        except Exception:  # node gone: so is the worker
            found[rank] = None
    return found


def _stuck(beat: dict, now: float, timeout_s: float) -> bool:
    if now - beat["time"] > timeout_s:  # no heartbeat at all: frozen (or gone)
        return True
    waits_for_others = beat["phase"] in COLLECTIVE_PHASES or beat["phase"] == "done"
    return not waits_for_others and now - beat["phase_since"] > _allowance(beat, timeout_s)


def _allowance(beat: dict, timeout_s: float) -> float:
    """How long ``beat``'s rank may stay in its phase."""
    return max(timeout_s, START_ALLOWANCE_S) if beat["phase"] == "start" else timeout_s


def _describe(beat: dict, now: float) -> str:
    silent = now - beat["time"]
    what = (f"no heartbeat for {silent:.0f} s" if silent > 5
            else f"in phase {beat['phase']!r} for {now - beat['phase_since']:.0f} s")
    return f"rank {beat['rank']} (pid {beat['pid']} on {beat['node_ip']}) at step {beat['step']}, {what}"


def kill_worker(beat: dict) -> bool:
    """SIGKILL a training worker on whichever node it runs; False if it no longer exists."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(_kill_if_ray_worker).options(
        num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(beat["node_id"], soft=False)
    )
    try:
        return ray.get(task.remote(beat["pid"]), timeout=60)
    except Exception:  # node gone: so is the worker
        return False


def _kill_if_ray_worker(pid: int) -> bool:
    import os
    import signal

    if not stacks.is_ray_worker(pid):  # never another process that got the pid since
        return False
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except OSError:
        return False
