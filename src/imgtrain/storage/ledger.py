"""What of a run's working copy has been in the store: the ledger SYNCED_FILE.

It names the run's checkpoints that this machine has seen in the store (uploaded from here, or
listed there), and each of its other files with the size and time it had when it was last
uploaded or fetched. A pull deletes a local checkpoint the store no longer lists only when it is
named there: it was in the store, so Ray Train's (or the local backend's) retention deleted it.
One that never got there (written while the store could not be reached) is kept and uploaded
instead; so is a file written or changed here since the store last had it (a driver's record
after its last upload), whatever the store lists.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from imgtrain.checkpoint_policy import POLICY
from imgtrain.ops.files import atomic_write_text

# In the working copy, never mirrored (mirror.LOCAL_ONLY). Inside the run's folder: it goes with the folder.
SYNCED_FILE = ".imgtrain-synced.json"
META_FILE = "meta.json"
_ledger = threading.Lock()  # the driver's mirror thread and its own pulls write it


def _read(local: Path) -> tuple[set[str] | None, dict[str, tuple[int, int]]]:
    """(checkpoints, {file: (size, mtime in ns)}) as recorded; None: no record. A list alone is
    the record of an older imgtrain: checkpoints only."""
    try:
        record = json.loads((local / SYNCED_FILE).read_text())
    except (OSError, ValueError):
        return None, {}
    if isinstance(record, list):
        record = {"checkpoints": record}
    if not isinstance(record, dict) or not isinstance(record.get("checkpoints"), list):
        return None, {}
    files = record.get("files") if isinstance(record.get("files"), dict) else {}
    return ({n for n in record["checkpoints"] if isinstance(n, str)},
            {k: tuple(v) for k, v in files.items() if isinstance(v, list) and len(v) == 2
             and all(isinstance(x, int) for x in v)})


def synced(local: Path) -> set[str] | None:
    """The run's checkpoints known to have been in the store; None: no record (a working copy
    made before the record was kept)."""
    return _read(local)[0]


def record_synced(local: Path, add=(), drop=(), files: dict[str, tuple[int, int]] | None = None) -> None:
    """Checkpoints ``add`` were in the store, ``drop`` are no longer; the working copy's
    ``files`` ({path: (size, mtime in ns)}, not checkpoints') are as the store has them."""
    with _ledger:
        known, sent = _read(local)
        now, sent_now = ((known or set()) | set(add)) - set(drop), {**sent, **(files or {})}
        if (now, sent_now) != (known, sent) and local.is_dir() and not local.is_symlink():
            record = {"checkpoints": sorted(now), "files": {k: list(v) for k, v in sorted(sent_now.items())}}
            atomic_write_text(local / SYNCED_FILE, json.dumps(record))


def never_sent_files(local: Path, paths) -> list[str]:
    """Of the working copy's files ``paths`` (relative to it, not checkpoints'), those the store
    has never had as they are: written or changed here since their last upload or fetch."""
    sent = _read(local)[1]
    unsent = []
    for rel in paths:
        try:
            stat = os.stat(local / rel, follow_symlinks=False)
        except OSError:  # deleted meanwhile: nothing to keep
            continue
        if sent.get(rel) != (stat.st_size, stat.st_mtime_ns):
            unsent.append(rel)
    return unsent


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
