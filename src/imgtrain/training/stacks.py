"""Python stacks of training workers, on whichever node they run, for hang diagnosis.

Each worker registers ``faulthandler`` on SIGUSR1 at start (``enable_stack_dumps``): the
handler is C code that writes every thread's Python stack to a file next to the worker's Ray
log, even while the worker is stuck in C (a collective, a kernel) and never returns to the
interpreter. No ptrace permission is needed, unlike py-spy, so it works in containers too.
The driver asks for a dump with a Ray task pinned to the worker's node (``dump``).
"""

from __future__ import annotations

import faulthandler
import os
import re
import signal
import tempfile
import time
from pathlib import Path

DUMP_SIGNAL = signal.SIGUSR1  # unused by Ray's workers (Ray Tune uses it in its driver only)
LOOP_FUNCTION = "run_loop"  # the frame that marks the training thread among the worker's threads
_dump_file = None  # kept open for the process's life: faulthandler writes to its descriptor


def worker_log_files() -> list[str]:
    """The files this Ray worker's stdout and stderr go to (Ray redirects both)."""
    found = []
    for fd in (1, 2):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/") and target not in found and os.path.isfile(target):
            found.append(target)
    return found


def enable_stack_dumps() -> str:
    """Make SIGUSR1 write all thread stacks of this process to a file; returns its path."""
    global _dump_file
    logs = worker_log_files()
    directory = os.path.dirname(logs[-1]) if logs else tempfile.gettempdir()
    path = os.path.join(directory, f"imgtrain-stacks-{os.getpid()}.txt")
    if _dump_file is None:
        _dump_file = open(path, "a")
        faulthandler.register(DUMP_SIGNAL, file=_dump_file, all_threads=True)
    return path


def is_ray_worker(pid: int) -> bool:
    """Whether ``pid`` is a Ray worker process (a pid may have been reused since it was seen)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().startswith(b"ray::")
    except OSError:
        return False


def dump(pid: int, path: str, wait_s: float = 5.0) -> str | None:
    """Runs on the worker's node: signal the worker and return the stacks it wrote; '' when
    it did not answer (a stopped process), None when it is no longer a Ray worker."""
    if not is_ray_worker(pid):
        return None
    try:
        before = os.path.getsize(path) if os.path.exists(path) else 0
        os.kill(pid, DUMP_SIGNAL)
    except OSError:
        return None
    deadline, size = time.monotonic() + wait_s, before
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = os.path.getsize(path) if os.path.exists(path) else 0
        if now > before and now == size:  # written, and no longer growing
            break
        size = now
    with open(path) as f:
        f.seek(before)
        return f.read()


def training_frames(text: str, limit: int = 12) -> list[str]:
    """The training thread's frames from ``run_loop`` inward, innermost last (as in a Python
    traceback), from a faulthandler dump of every thread (innermost first)."""
    for block in re.split(r"\n\s*\n", text):
        frames = [line.strip() for line in block.splitlines() if line.strip().startswith("File ")]
        names = [line.rsplit(" in ", 1)[-1] for line in frames]
        if LOOP_FUNCTION in names:
            inner_first = frames[: names.index(LOOP_FUNCTION) + 1]
            return list(reversed(inner_first))[-limit:]
    return []


def report_path(logs: Path) -> Path:
    return logs / f"hang-{time.strftime('%Y%m%d-%H%M%S')}.txt"
