"""What a rank is doing, as the driver sees it: phases, heartbeats, and which phases wait for
other ranks. Shared by the workers (which report) and the driver's watchdog (which judges),
so it imports neither torch nor the loop.
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


def start_heartbeat(monitor, rank: int, world: int, progress: Progress):
    """Send this rank's progress to the driver every HEARTBEAT_S seconds; returns a stop function."""
    if monitor is None:
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
                monitor.heartbeat.remote(dict(ids, **progress.snapshot(), time=time.time()))
            stop.wait(HEARTBEAT_S)

    threading.Thread(target=beat, name="imgtrain-heartbeat", daemon=True).start()
    return stop.set
