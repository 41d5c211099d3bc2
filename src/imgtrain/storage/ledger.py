"""Which checkpoints of a run's working copy have been in the store: the ledger SYNCED_FILE.

It names the run's checkpoints that this machine has seen in the store (uploaded from here, or
listed there). A pull deletes a local checkpoint the store no longer lists only when it is named
there: it was in the store, so Ray Train's (or the local backend's) retention deleted it. One
that never got there (written while the store could not be reached) is kept and uploaded instead.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from imgtrain.checkpoint_policy import POLICY
from imgtrain.ops.files import atomic_write_text

# In the working copy, never mirrored (mirror.LOCAL_ONLY). Inside the run's folder: it goes with the folder.
SYNCED_FILE = ".imgtrain-synced.json"
META_FILE = "meta.json"
_ledger = threading.Lock()  # the driver's mirror thread and its own pulls write it


def synced(local: Path) -> set[str] | None:
    """The run's checkpoints known to have been in the store; None: no record (a working copy
    made before the record was kept)."""
    try:
        names = json.loads((local / SYNCED_FILE).read_text())
    except (OSError, ValueError):
        return None
    return {n for n in names if isinstance(n, str)} if isinstance(names, list) else None


def record_synced(local: Path, add=(), drop=()) -> None:
    with _ledger:
        known = synced(local)
        now = ((known or set()) | set(add)) - set(drop)
        if now != known and local.is_dir() and not local.is_symlink():
            atomic_write_text(local / SYNCED_FILE, json.dumps(sorted(now)))


def _local_checkpoints(local: Path) -> list[Path]:
    if not local.is_dir():
        return []
    return [d for d in local.iterdir() if POLICY.is_checkpoint(d.name) and d.is_dir() and not d.is_symlink()]


def _step(folder: Path) -> int | None:
    try:
        step = json.loads((folder / META_FILE).read_text()).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def gone_from_store(local: Path, in_store: set[str], known: set[str] | None) -> list[str]:
    """The local checkpoints the store deleted: not listed there any more, and recorded as once
    there (without a record, the working copy of an older imgtrain: any not newer than the
    store's newest). One newer than every checkpoint the store lists is never among them."""
    newest = max((s for s in (_step(local / n) for n in in_store) if s is not None), default=None)
    gone = []
    for folder in _local_checkpoints(local):
        step = _step(folder)
        newer = step is not None and (newest is None or step > newest)
        if folder.name not in in_store and not newer and (known is None or folder.name in known):
            gone.append(folder.name)
    return gone


def never_sent(local: Path, whole_there: set[str], known: set[str]) -> list[str]:
    """Complete local checkpoints (a meta.json) that the store has never had whole."""
    return [d.name for d in _local_checkpoints(local)
            if d.name not in whole_there and d.name not in known and (d / META_FILE).is_file()]
