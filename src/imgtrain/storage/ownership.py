"""Which directories are imgtrain runs, and who is using one right now.

A run directory carries a marker file, ``.imgtrain-run``, that only imgtrain writes, when it
creates the directory. Only marked directories are deleted (``clean runs``, ``train
--overwrite``); a new run refuses a non-empty directory that is not a run, so ``--storage ~
--name Documents`` never writes into, or later deletes, a user's folder (a ``config.json``
alone proves nothing: a Hugging Face model folder has one too).

Runs made before the marker existed are recognised by imgtrain's own ``config.json``, which
names the run (the folder's own name), its data set, backend and epochs: a folder that merely
has some ``config.json`` does not qualify. Training such a run again (resume or
``--overwrite``) adds the marker.

While a process trains or deletes a run it holds an exclusive ``flock`` on the run's
``.lock`` file (which records its pid and host, for the message others get). The kernel
releases it when the process dies, however it dies.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
import uuid
from pathlib import Path

from imgtrain.errors import ImgtrainError
from imgtrain.ops.files import name_problem

MARKER_FILE = ".imgtrain-run"
LOCK_FILE = ".lock"
CONFIG_FILE = "config.json"  # the run's resolved config (runs.py writes it)
_LEGACY_KEYS = ("name", "data", "backend", "epochs")


def check_name(name: str) -> str:
    """``name`` itself, or one line saying why it is not a run name."""
    problem = name_problem(name)
    if problem:
        raise ImgtrainError(f"{name[:80]!r} is not a run name: it {problem}" if name else "the run name is empty")
    return name


def is_marked(path: Path) -> bool:
    marker = path / MARKER_FILE
    return marker.is_file() and not marker.is_symlink()


def is_legacy_run(path: Path) -> bool:
    """A run directory made before markers: imgtrain's own config.json, naming this run."""
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and all(k in config for k in _LEGACY_KEYS) and config["name"] == path.name


def is_run(path: Path) -> bool:
    """A real directory (not a link) that imgtrain made as a run."""
    return path.is_dir() and not path.is_symlink() and (is_marked(path) or is_legacy_run(path))


def claim(run_dir: Path) -> str:
    """Create ``run_dir`` as a new run (or take an empty directory) and mark it; returns the
    run id. Refuses a directory with anything in it, and loses cleanly to a concurrent claim."""
    try:
        run_dir.mkdir(parents=True)
    except FileExistsError:
        if run_dir.is_symlink() or not run_dir.is_dir() or any(run_dir.iterdir()):
            raise ImgtrainError(
                f"{run_dir} already exists and is not an imgtrain run (no {MARKER_FILE}); imgtrain "
                "does not write into other folders: choose another --name or --storage"
            ) from None
    except OSError as e:
        raise ImgtrainError(f"cannot write to storage {run_dir.parent}: {e.strerror or e}; "
                            "choose a writable --storage") from None
    return mark(run_dir, exclusive=True)


def mark(run_dir: Path, exclusive: bool = False) -> str:
    """Write the marker (a pre-marker run adopted on resume, or a new run); returns the run id."""
    run_id = uuid.uuid4().hex
    record = {"run_id": run_id, "created": time.time(), "host": socket.gethostname(), "pid": os.getpid()}
    try:
        with open(run_dir / MARKER_FILE, "x" if exclusive else "w") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
    except FileExistsError:  # another process claimed the same new run a moment ago
        raise ImgtrainError(f"another process just created the run {run_dir}; choose another --name") from None
    except OSError as e:
        raise ImgtrainError(f"cannot write to storage {run_dir}: {e.strerror or e}; "
                            "choose a writable --storage") from None
    return run_id


@contextlib.contextmanager
def locked(run_dir: Path, doing: str):
    """Hold the run's exclusive lock while ``doing`` ("training", "deleting"); raises at once,
    naming the holder, when another process holds it."""
    path = run_dir / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        raise ImgtrainError(f"cannot lock the run {run_dir}: {e.strerror or e}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            raise ImgtrainError(
                f"run {run_dir.name!r} is being {holder.get('doing', 'used')} right now by process "
                f"{holder.get('pid', '?')} on {holder.get('host', '?')}; wait for it or stop it"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "doing": doing}).encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def lock_held(run_dir: Path) -> bool | None:
    """Whether a process of this machine holds the run's lock now, as the kernel's lock table
    (/proc/locks) says, without taking it (taking it, even shared, would refuse a driver starting
    that moment); None where that table cannot be read."""
    try:
        stat = os.stat(run_dir / LOCK_FILE, follow_symlinks=False)
    except FileNotFoundError:
        return False
    except OSError:
        return None
    try:
        table = Path("/proc/locks").read_text()
    except OSError:
        return None
    # "1: FLOCK  ADVISORY  WRITE 4242 08:01:1573 0 EOF": the holder's pid, then MAJOR:MINOR:INODE (hex, hex, decimal)
    ours = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}:{stat.st_ino}"
    return any(fields[1] == "FLOCK" and ours in fields for fields in map(str.split, table.splitlines())
               if len(fields) > 5)


def _read_holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}


class Replacement:
    """``train --overwrite``: the old run is moved aside (``.NAME.replaced-ID``, hidden from
    ``runs list``) rather than deleted, and deleted only once the new run has a checkpoint
    (``commit``). A new run that fails before its first checkpoint (no GPU after all, a
    tracker that refuses it, a crash in the first step) gives the old run back (``rollback``)."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.aside = run_dir.parent / f".{run_dir.name}.replaced-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(run_dir, self.aside)
        except OSError as e:
            raise ImgtrainError(f"cannot move the previous run {run_dir} aside: {e.strerror or e}") from None
        self.done = False

    def commit(self) -> None:
        """Delete the old run, and any left by an earlier --overwrite whose driver was killed."""
        import shutil

        if self.done:
            return
        self.done = True
        for leftover in leftovers(self.run_dir):
            shutil.rmtree(leftover, ignore_errors=True)

    def rollback(self) -> None:
        """Put the old run back in place of the new one, which has nothing worth keeping."""
        import shutil

        if self.done or not self.aside.is_dir():
            return
        self.done = True
        if is_marked(self.run_dir):
            shutil.rmtree(self.run_dir, ignore_errors=True)
        os.rename(self.aside, self.run_dir)


def leftovers(run_dir: Path) -> list[Path]:
    """Old runs moved aside by ``--overwrite`` for ``run_dir`` and not yet deleted."""
    return sorted(p for p in run_dir.parent.glob(f".{run_dir.name}.replaced-*")
                  if p.is_dir() and not p.is_symlink() and is_marked(p))
