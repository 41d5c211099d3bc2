"""What imgtrain changes in its own process while a command runs, each change undone when it
ends: the library may run inside a notebook or another program, which must find its
environment, its loggers, its file descriptors and torch's settings as it left them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path


@contextlib.contextmanager
def environment(**values: str):
    """Set environment variables the user has not set, for the length of the block."""
    added = {k: v for k, v in values.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


@contextlib.contextmanager
def environment_restored():
    """Whatever the block (Ray's ``init``, torch's inductor) writes into the environment is
    undone at its end."""
    before = dict(os.environ)
    try:
        yield
    finally:
        for key in [k for k in os.environ if k not in before]:
            del os.environ[key]
        os.environ.update({k: v for k, v in before.items() if os.environ.get(k) != v})


@contextlib.contextmanager
def signal_handlers_restored():
    """SIGINT's and SIGTERM's handlers put back after the block (ray.init installs its own)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():  # only the main thread may set them
        yield
        return
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in saved.items():
            if handler is not None:
                signal.signal(s, handler)


@contextlib.contextmanager
def hangup_blocked():
    """SIGHUP blocked in this thread for the block, and so in every process started from it
    meanwhile (a process inherits its signal mask, through exec too): a terminal's hangup, sent
    to its whole process group, then reaches only this process, which stops the others in order.
    One that came meanwhile is delivered at the end of the block."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():  # signals go to the main thread's handlers
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


class Stop:
    """Which signal stopped the block (``signum``; None for Ctrl-C): Ray's ``ray.get`` raises a
    KeyboardInterrupt of its own for whatever interrupt its wait saw, so the exception cannot
    tell SIGHUP or SIGTERM from SIGINT."""

    signum: int | None = None


@contextlib.contextmanager
def stops_interrupt():
    """SIGHUP (the terminal closed, the SSH connection dropped) and SIGTERM (a scheduler, k8s or
    ``kill`` stopping the job) raise KeyboardInterrupt in the block, as Ctrl-C does, so a command
    stops the same way: its records truthful, the processes it started stopped. Python's default
    for either ends the process on the spot, with no cleanup at all. Yields a ``Stop``. A signal
    ignored already (``nohup``: the command is to outlive its terminal) stays ignored; a block
    off the main thread changes nothing."""
    import signal
    import threading

    stop = Stop()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def interrupt(signum, frame):
        stop.signum = signum
        raise KeyboardInterrupt

    saved = {s: signal.getsignal(s) for s in (signal.SIGHUP, signal.SIGTERM)}
    for s, handler in saved.items():
        if handler != signal.SIG_IGN:
            signal.signal(s, interrupt)
    try:
        yield stop
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)


@contextlib.contextmanager
def loggers_to(path: Path | None, names, level: int = logging.INFO):
    """Send the loggers ``names`` (Ray's, MLflow's) to ``path`` instead of the terminal; their
    handlers, level and propagation are put back afterwards."""
    if path is None:
        yield
        return
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    saved = []
    for name in names:
        logger = logging.getLogger(name)
        saved.append((logger, list(logger.handlers), logger.propagate, logger.level))
        for h in list(logger.handlers):
            logger.removeHandler(h)
        logger.addHandler(handler)
        logger.propagate = False
        if logger.level == logging.NOTSET or logger.level > level:
            logger.setLevel(level)
    try:
        yield
    finally:
        for logger, handlers, propagate, old_level in saved:
            logger.removeHandler(handler)
            for h in handlers:
                logger.addHandler(h)
            logger.propagate, logger.level = propagate, old_level
        handler.close()


@contextlib.contextmanager
def output_to(logs: Path):
    """Keep what Ray writes itself out of the terminal: file descriptor 2 goes to
    ``driver.err`` (the C++ core and raylet write there directly) and ``sys.stdout`` to
    ``driver.out`` (Ray's driver prints cluster warnings to it from a background thread).
    Whoever needs the real terminal meanwhile holds on to it before entering (the progress
    display does)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(logs / "driver.err", "ab") as err, open(logs / "driver.out", "a") as out:
        os.dup2(err.fileno(), 2)
        try:
            with contextlib.redirect_stdout(out):
                yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


@contextlib.contextmanager
def stderr_silenced():
    """File descriptor 2 to /dev/null for the block (a C++ client logging each retry)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


@contextlib.contextmanager
def torch_threads(count: int):
    """torch's intra-op threads set to ``count`` for the block, then put back (0: not touched)."""
    if count <= 0:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def attribute(obj, name: str, value):
    """``obj.name = value`` for the block (a library's process-wide setting, such as Ray Data's
    progress bars)."""
    before = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, before)


def pid_alive(pid) -> bool:
    """Whether process ``pid`` runs on this machine. A pid read from a file is checked first:
    0 or a negative number would ask about a whole process group."""
    if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid < 2**31:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def started(pid) -> str | None:
    """When process ``pid`` of this machine started, as its kernel says (the boot, and the clock
    tick since it), hashed: a pid is reused, a pid with its start names one process. None where
    that is not told (no /proc) or there is no such process."""
    import hashlib

    if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid < 2**31:
        return None
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    if len(fields) < 20:
        return None
    return hashlib.sha256(f"{boot}:{fields[19]}".encode()).hexdigest()[:16]  # field 22, starttime: 20th after the name
