"""Small file helpers shared by the data set, checkpoint and run directory formats."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import tempfile
import uuid
from pathlib import Path

from imgtrain.errors import ImgtrainError


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def atomic_write_text(path: Path, text: str) -> None:
    """Readers see the old file or the new one, never half of one, even after a power cut:
    a temporary file of its own (two writers never share one), flushed to disk, renamed into
    place, and the directory entry flushed too."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def swap_in_folder(new: Path, target: Path) -> None:
    """Put the folder ``new`` at ``target``, replacing what is there, so that ``target`` is
    always one whole folder: the old one is renamed aside first, deleted last. Raises
    FileExistsError when another process put a folder at ``target`` in between (two writers of
    one folder at once): ``new`` is left where it was, for the caller to remove."""
    old = None
    if target.exists():
        old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(target, old)
    try:
        os.rename(new, target)  # onto nothing, or onto an empty folder
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise FileExistsError(errno.EEXIST, "written by another process at the same time", str(target)) from None
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def fsync_dir(folder: Path) -> None:
    """Flush a directory's entries (a rename into it) to disk; a no-op where not supported."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_problem(folder: Path) -> str | None:
    """Why ``folder`` cannot be created or written to (the OS's words), or None when it can."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        return e.strerror or str(e)
    return None


def check_writable(folder: Path, what: str = "storage", hint: str = "choose a writable --storage") -> None:
    """Create ``folder`` if needed and write a file there: one clear error when that fails."""
    problem = write_problem(folder)
    if problem:
        raise ImgtrainError(f"cannot write to {what} {folder}: {problem}; {hint}")


def disk_full(error: BaseException) -> bool:
    """Whether ``error`` (or one it wraps: a Ray task's cause, a worker failure) is a full disk."""
    seen = set()
    stack = [error, *(getattr(error, "worker_failures", None) or {}).values()]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in str(e):
            return True
        stack += [getattr(e, "cause", None), e.__cause__, e.__context__]
    return False


def link_dir(link: Path, target: Path | None) -> None:
    """Point ``link`` at the folder ``target`` (replacing an older link); a convenience only, so
    a file system without links is no error."""
    if target is None:
        return
    with contextlib.suppress(OSError):
        if link.is_symlink():
            link.unlink()
        link.symlink_to(target, target_is_directory=True)


MAX_NAME_BYTES = 255  # what one path component may hold on common filesystems


def name_problem(name: str) -> str | None:
    """What is wrong with ``name`` as a run's name (None: nothing). A run is one folder inside
    its storage, so its name is one plain path component (a rule of file names: the settings,
    below the run store, check it too; ``storage.ownership.check_name`` raises it). Checked
    before any file of the run is touched: ``./../../x`` would otherwise lead a pull, a clean or
    a train outside the storage."""
    if not name:
        return "is empty"
    if "/" in name or "\\" in name or name.startswith(".") or any(ord(c) < 32 or ord(c) == 127 for c in name):
        return "must be a plain name without '/', '\\', control characters or a leading '.'"
    if len(name.encode()) > MAX_NAME_BYTES:
        return f"must be at most {MAX_NAME_BYTES} bytes long"
    return None
