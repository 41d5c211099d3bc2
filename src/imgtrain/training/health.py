"""What a rank is doing, as the driver sees it: phases, heartbeats, and which phases wait for
other ranks, and the outbox its records leave by. Shared by the workers (which report) and the
driver's watchdog (which judges), so it imports neither torch nor the loop.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

HEARTBEAT_S = 1.0  # how often every rank reports its phase and step

# Phases in which a rank may wait for the others (with DDP the forward pass broadcasts rank 0's
# BatchNorm buffers, the backward pass all-reduces gradients): a rank stuck there is more
# likely a victim than the cause.
COLLECTIVE_PHASES = frozenset({"forward", "backward", "sync", "report"})


class Progress:
    """What this rank is doing right now; a heartbeat thread reports it to the driver."""

    def __init__(self):
        self.phase, self.step, self.since = "start", 0, time.time()

    def enter(self, phase: str, step: int | None = None) -> None:
        if step is not None:
            self.step = step
        if phase != self.phase:
            self.phase, self.since = phase, time.time()

    def snapshot(self) -> dict:
        return {"phase": self.phase, "step": self.step, "phase_since": self.since}


# Records a rank sends every few steps: they wait in the outbox for the next heartbeat.
BATCHED_KINDS = frozenset({"step", "rank"})


class Outbox:
    """A rank's records to the driver (``Monitor``), fire and forget, in the order sent.

    An actor call costs the calling thread the GIL for a while (0.1-0.5 ms here, issue 51), so
    the frequent records (``BATCHED_KINDS``) are not sent from the training step: they go with
    the heartbeat, once a second, in the heartbeat thread. Any other record (a phase, the start,
    an epoch) goes at once, together with those waiting before it; so does whatever waits when
    the rank stops (``flush``)."""

    def __init__(self, monitor):
        self.monitor = monitor
        self.waiting: list[dict] = []
        self.lock = threading.Lock()  # one sender at a time: the calls leave in the records' order

    def send(self, record: dict) -> None:
        if self.monitor is None:
            return
        with self.lock:
            self.waiting.append(record)
        if record.get("kind") not in BATCHED_KINDS:
            self.flush()

    def flush(self, beat: dict | None = None) -> None:
        """Send what waits, with ``beat`` (this rank's heartbeat) if given: one actor call."""
        with self.lock:
            records, self.waiting = self.waiting, []
            if beat is not None:
                self.monitor.heartbeat.remote(beat, records)
            elif records:
                self.monitor.push.remote(*records)


def start_heartbeat(outbox: Outbox, rank: int, world: int, progress: Progress):
    """Send this rank's progress (and the records waiting in ``outbox``) to the driver every
    HEARTBEAT_S seconds; returns a stop function, which sends what still waits."""
    if outbox.monitor is None:
        return lambda: None
    import ray

    from imgtrain.training import stacks

    stop = threading.Event()
    ids = {"rank": rank, "world_size": world, "pid": os.getpid(), "node_ip": ray.util.get_node_ip_address(),
           "node_id": ray.get_runtime_context().get_node_id(),
           # for hang diagnosis: where this rank writes its stacks on SIGUSR1, and its logs
           "stack_file": stacks.enable_stack_dumps(), "log_files": stacks.worker_log_files()}

    def beat():
        while not stop.is_set():
            with contextlib.suppress(Exception):  # a lost heartbeat must never fail training
                outbox.flush(dict(ids, **progress.snapshot(), time=time.time()))
            stop.wait(HEARTBEAT_S)

    def stopped():
        stop.set()
        with contextlib.suppress(Exception):
            outbox.flush()

    threading.Thread(target=beat, name="imgtrain-heartbeat", daemon=True).start()
    return stopped
