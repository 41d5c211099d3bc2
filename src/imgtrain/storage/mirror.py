"""The working copy of a run in an object store: pull it down, push it up, delete it; and the
driver's background mirror, which pushes its files and writes its heartbeat every few seconds.

A pull fetches only the files whose size or time changed, keeps what the store lacks (and, as a
reader, sends it back), and drops a checkpoint, or the working copy of a run the store no longer
has, only when the ledger says the store had it as it is here. This machine's processes take
turns on a run's working copy (``turn``), and a run that another process here trains or deletes
is never pulled over (``in_use_here``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import threading
import warnings
from pathlib import Path

from imgtrain.checkpoint_policy import POLICY, PREFIX, RAY_SNAPSHOT_FILE
from imgtrain.errors import ImgtrainError, ImgtrainWarning, one_line
from imgtrain.ops.remote import ObjectChanged, Store, UnsafeKey, check_key, copy_down, copy_up, local_file, where
from imgtrain.storage import ledger, ownership
from imgtrain.storage.lease import HEARTBEAT_FILE, beat, lease_holder
from imgtrain.storage.ledger import META_FILE, SYNCED_FILE
from imgtrain.storage.ownership import LOCK_FILE, MARKER_FILE

log = logging.getLogger(__name__)

PUSH_INTERVAL_S = 2.0  # also the heartbeat's (lease.py)
# Never mirrored: the lock is about this machine's processes, logs/ray links to this machine's
# Ray session, and the checkpoints are uploaded by the workers that write them; the ledger is
# this machine's own record (ledger.py).
LOCAL_ONLY = (".lock", "logs/ray", SYNCED_FILE)
# Written straight to the store (by Ray Train; the heartbeat): a copy pulled here is older, never sent back.
STORE_ONLY = (RAY_SNAPSHOT_FILE, HEARTBEAT_FILE)


def _local_only(rel: str) -> bool:
    return any(rel == x or rel.startswith(x + "/") for x in LOCAL_ONLY)


# ---------------------------------------------------------------- the working copy


def remote_files(st: Store, name: str) -> dict[str, tuple[int, float]]:
    """{path relative to the run: (size, mtime)} of every file of the run in the store. A key
    that could not be a file of the working copy is left out, with a warning."""
    import pyarrow.fs as pafs

    base = f"{st.root}/{ownership.check_name(name)}"
    try:
        infos = st.fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise where(e, st) from None
    files = {}
    for info in infos:
        rel = info.path[len(base) + 1:]
        if info.type != pafs.FileType.File or _local_only(rel):
            continue
        try:
            files[check_key(rel)] = (info.size, info.mtime.timestamp() if info.mtime else 0.0)
        except UnsafeKey as e:
            warnings.warn(f"run {name!r} in {st.uri}: {e}", ImgtrainWarning, stacklevel=2)
    return files


def run_names(st: Store) -> list[str]:
    """The names of the folders directly under the store's root that hold a run marker (and
    could name a run: a folder called ``..`` or ``\\x1b[2J`` is not listed)."""
    import pyarrow.fs as pafs

    try:
        infos = st.fs.get_file_info(pafs.FileSelector(st.root, allow_not_found=True))
        folders = [i.base_name for i in infos
                   if i.type == pafs.FileType.Directory and not ownership.name_problem(i.base_name)]
        markers = st.fs.get_file_info([f"{st.root}/{n}/{MARKER_FILE}" for n in folders])
    except (OSError, ValueError) as e:
        raise where(e, st) from None
    return sorted(n for n, m in zip(folders, markers) if m.type == pafs.FileType.File)


@contextlib.contextmanager
def turn(st: Store, name: str):
    """This machine's processes take turns on the working copy of run ``name``: each pull of
    it, and each taking of its lock (``ownership.locked``: a driver, ``clean``). So a pull that
    finds the lock free writes before any driver here starts, and its look at the lock never
    makes a driver's attempt to take it fail. The lock file lies beside the run's folder."""
    st.local.mkdir(parents=True, exist_ok=True)
    with open(st.local / f".{ownership.check_name(name)}.pull-lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def in_use_here(local: Path) -> bool:
    """Whether a process on this machine holds the run's lock (it trains or deletes the run).
    Asked for a shared lock, given back at once; only in the run's turn."""
    try:
        fd = os.open(local / LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:  # no lock file (or no folder): nobody has trained it here
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def pull(st: Store, name: str, checkpoints: bool = True, only_checkpoints: bool = False,
         owner: bool = False) -> Path:
    """Bring the run ``name`` into the working copy and return its local folder. Files whose
    size and time match are not fetched again, nor those changed here since the store's copy
    (a driver that lost the store before its last upload). A local checkpoint the store no
    longer lists goes only when it had been there (Ray Train's retention deleted it); one that
    never got there is kept and, by a reader, uploaded with the files changed here
    (``_send_back``); so is the whole working copy of a run the store no longer has (deleted
    elsewhere, or by anyone who may write to the bucket) when anything in it never got there.
    ``checkpoints`` False: only each checkpoint's meta.json; ``only_checkpoints``: the
    checkpoints only (the driver of a run has the newer other files).
    A run that another process on this machine trains or deletes is left as that process has
    it; ``owner``: the caller is that process (it holds the run's lock or turn, and its mirror
    uploads)."""
    local = st.local / ownership.check_name(name)
    if owner:
        _pull(st, name, local, checkpoints, only_checkpoints)
        return local
    with turn(st, name):
        if not in_use_here(local):
            if _pull(st, name, local, checkpoints, only_checkpoints):
                _send_back(st, name, local)
    return local


def _pull(st: Store, name: str, local: Path, checkpoints: bool, only_checkpoints: bool) -> bool:
    """The pull itself; True when the working copy holds what the store lacks (checkpoints that
    never got there, files changed here since their upload)."""
    import shutil

    listed = remote_files(st, name)
    if set(listed) <= {HEARTBEAT_FILE}:  # not a run yet: a driver has just taken its lease
        listed = {}
    known = ledger.synced(local)
    if not listed and not only_checkpoints and known is not None and not ledger.never_sent(local, set(), known) \
            and not _never_sent_files(local):
        if local.is_dir() and not local.is_symlink():  # deleted from the store (`clean` elsewhere): here too
            shutil.rmtree(local, ignore_errors=True)
        return False
    wanted = listed
    if not checkpoints:
        wanted = {p: v for p, v in wanted.items() if not _in_checkpoint(p) or p.endswith("/" + META_FILE)}
    if only_checkpoints:
        wanted = {p: v for p, v in wanted.items() if _in_checkpoint(p)}
    as_in_store = {}  # the files (not checkpoints') that are here as the store has them
    for rel, (size, mtime) in wanted.items():
        try:
            target = local_file(local, rel)
        except UnsafeKey as e:
            warnings.warn(f"run {name!r} in {st.uri}: {e}", ImgtrainWarning, stacklevel=3)
            continue
        if not _same(target, size, mtime):
            if _changed_here(target, mtime) or not _fetch(st, name, rel, target, size, mtime):
                continue  # written here since its upload (kept, and sent back), or deleted there since
        with contextlib.suppress(OSError):
            stat = target.stat()
            as_in_store[rel] = (stat.st_size, stat.st_mtime_ns)
    if not local.is_dir():
        return False
    in_store = {rel.split("/", 1)[0] for rel in listed if _in_checkpoint(rel)}
    whole_there = {f for f in in_store if f"{f}/{META_FILE}" in listed}  # meta.json goes up last
    gone = ledger.gone_from_store(local, in_store, known)
    for folder in gone:
        shutil.rmtree(local / folder, ignore_errors=True)
    ledger.record_synced(local, add=whole_there, drop=gone,
                         files={rel: stamp for rel, stamp in as_in_store.items() if not _in_checkpoint(rel)})
    return bool(_never_sent_files(local) or ledger.never_sent(local, whole_there, ledger.synced(local) or set()))


def pull_checkpoint(st: Store, name: str, folder: str) -> list[str]:
    """Bring every file of the run's checkpoint ``folder`` into the working copy, where a Ray
    run's driver has only its meta.json (the workers uploaded the rest); returns the paths
    fetched. For a process holding the run's lock."""
    local = st.local / ownership.check_name(name)
    fetched = []
    for rel, (size, mtime) in remote_files(st, name).items():
        if rel.split("/", 1)[0] != folder or "/" not in rel:
            continue
        target = local_file(local, rel)
        if not _same(target, size, mtime) and not _changed_here(target, mtime) \
                and _fetch(st, name, rel, target, size, mtime):
            fetched.append(rel)
    return fetched


def push_checkpoint(st: Store, name: str, folder: str) -> None:
    """Upload the files of the checkpoint ``folder`` that the working copy holds and the store
    lacks (one added to a finished checkpoint, calibrated.pt, and its meta.json, last): never the
    weights the store has already. For a process holding the run's lock."""
    push(st, name, in_store(st, name), everything=True, under=folder, prune=False)


def _fetch(st: Store, name: str, rel: str, target: Path, size: int, mtime: float) -> bool:
    """One file of the run from the store, with the object's time; False: deleted there since
    the listing. A driver elsewhere replaces its records every few seconds: one replaced since
    the listing is fetched as it is now."""
    import pyarrow.fs as pafs

    path = f"{st.root}/{name}/{rel}"
    for attempt in range(3):
        try:
            copy_down(st.fs, path, target, st, (size, mtime))
            break
        except ObjectChanged:
            if attempt == 2:
                raise
        try:
            info = st.fs.get_file_info(path)
        except (OSError, ValueError) as e:
            raise where(e, st) from None
        if info.type != pafs.FileType.File:
            return False
        size, mtime = info.size, info.mtime.timestamp() if info.mtime else 0.0
    os.utime(target, (mtime, mtime))
    return True


def _never_sent_files(local: Path) -> list[str]:
    """The working copy's files, not checkpoints', that the store has never had as they are."""
    return ledger.never_sent_files(local, [rel for rel in _mirrored_files(local) if not _in_checkpoint(rel)])


def _send_back(st: Store, name: str, local: Path) -> None:
    """Upload what the working copy holds and the store lacks: checkpoints made while the store
    could not be reached, files changed here since their last upload. Not while a driver on
    another machine holds the run (its lease): the run has moved on there, and what is here
    stays here, with a warning."""
    holder = lease_holder(_read_json_file(local / HEARTBEAT_FILE))
    if holder:
        unsent = ledger.never_sent(local, set(), ledger.synced(local) or set()) + _never_sent_files(local)
        warnings.warn(f"run {name!r}: this machine has files of it that {st.uri} lacks ("
                      f"{', '.join(unsent) or 'newer records'}); "
                      f"they stay in {local} while {holder} trains the run", ImgtrainWarning, stacklevel=3)
        return
    push(st, name, _sent_record(local, remote_files(st, name)), everything=True, prune=False)


def _read_json_file(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _in_checkpoint(rel: str) -> bool:
    return "/" in rel and POLICY.is_checkpoint(rel.split("/", 1)[0])


def _same(path: Path, size: int, mtime: float) -> bool:
    try:
        stat = path.stat()
    except OSError:
        return False
    return stat.st_size == size and abs(stat.st_mtime - mtime) < 1e-3


def _changed_here(path: Path, mtime: float) -> bool:
    """The local file is newer than the store's copy: written here after its last upload (a
    sent or fetched file carries the store's time, push and pull set it)."""
    try:
        return path.stat().st_mtime > mtime + 1e-3
    except OSError:
        return False


def push(st: Store, name: str, sent: dict[str, tuple[int, int]] | None = None, everything: bool = False,
         under: str | None = None, prune: bool = True) -> None:
    """Upload the run's files from the working copy that changed since ``sent`` (updated in
    place), or only those ``under`` one folder (a report). Checkpoints only with ``everything``
    (the local backend writes them here, and deletes old ones: with ``prune``, so does the
    store then); a checkpoint's meta.json goes last, so the store never lists a checkpoint
    whose files are not all there. A file deleted meanwhile is skipped."""
    sent = {} if sent is None else sent
    local = st.local / ownership.check_name(name)
    fs = st.fs
    uploaded, files = set(), {}
    for rel in sorted(_mirrored_files(local), key=lambda r: (r.rsplit("/", 1)[-1] == META_FILE, r)):
        if _in_checkpoint(rel) and not everything or under and not rel.startswith(under + "/"):
            continue
        stamp = _upload(fs, local / rel, f"{st.root}/{name}/{rel}", sent.get(rel), st)
        if stamp:
            sent[rel] = stamp
            if not _in_checkpoint(rel):
                files[rel] = stamp
            elif rel.endswith("/" + META_FILE):
                uploaded.add(rel.split("/", 1)[0])
    ledger.record_synced(local, add=uploaded, files=files)
    if uploaded and prune:  # the local backend's retention may have deleted older ones
        gone = {rel.split("/", 1)[0] for rel in remote_files(st, name) if _in_checkpoint(rel)}
        gone -= {p.name for p in local.glob(PREFIX + "*") if POLICY.is_checkpoint(p.name)}
        for folder in sorted(gone):
            delete(st, name, folder)
            for rel in [r for r in sent if r.startswith(folder + "/")]:
                del sent[rel]
        ledger.record_synced(local, drop=gone)


def _mirrored_files(local: Path):
    """The paths (relative to the run) of the working copy's files that belong in the store:
    not links, not files being written, not this machine's own, not those written straight there."""
    for folder, _, files in os.walk(local):  # a folder deleted meanwhile is skipped, links not followed
        for file in files:
            path = os.path.join(folder, file)
            rel = Path(path).relative_to(local).as_posix()
            if os.path.islink(path) or rel.endswith((".part", ".tmp")) or ".tmp/" in rel or rel in STORE_ONLY \
                    or _local_only(rel):
                continue
            yield rel


def _upload(fs, path: Path, target: str, sent: tuple[int, int] | None, st: Store) -> tuple[int, int] | None:
    """One file to the store unless it is as ``sent``; returns what was sent (size, mtime in ns),
    None for nothing. The local file then takes the object's time, so that a pull on this
    machine does not fetch it back."""
    try:
        with open(path, "rb") as src:
            before = os.fstat(src.fileno())
            if (before.st_size, before.st_mtime_ns) == sent:
                return None
            try:
                copy_up(src, fs, target)
                stored = fs.get_file_info(target).mtime
            except OSError as e:  # the store's
                raise where(e, st) from None
        now = os.stat(path)
    except FileNotFoundError:  # deleted since it was listed (the local backend's retention)
        return None
    if stored is None or (now.st_ino, now.st_size, now.st_mtime_ns) != (before.st_ino, before.st_size,
                                                                         before.st_mtime_ns):
        return before.st_size, before.st_mtime_ns  # changed while it went up: sent again next round
    ns = round(stored.timestamp() * 1e9)
    os.utime(path, ns=(ns, ns))
    return before.st_size, ns


def in_store(st: Store, name: str) -> dict[str, tuple[int, int]]:
    """``push``'s record for the working copy's files that are the same as the store's (a
    pull brought them down): the mirror does not send them again."""
    return _sent_record(st.local / name, remote_files(st, name))


def _sent_record(local: Path, listed: dict[str, tuple[int, float]]) -> dict[str, tuple[int, int]]:
    sent = {}
    for rel, (size, mtime) in listed.items():
        path = local / rel  # listed keys are plain paths (remote_files)
        if _same(path, size, mtime):
            stat = path.stat()
            sent[rel] = (stat.st_size, stat.st_mtime_ns)
    return sent


def delete(st: Store, name: str, rel: str = "") -> None:
    """Delete a run (or one folder of it, e.g. a damaged checkpoint) from the store."""
    try:
        st.fs.delete_dir(f"{st.root}/{ownership.check_name(name)}" + (f"/{check_key(rel)}" if rel else ""))
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as e:
        raise where(e, st) from None


# ---------------------------------------------------------------- the driver's mirror


@contextlib.contextmanager
def mirrored(st: Store | None, name: str, interval_s: float = PUSH_INTERVAL_S, everything: bool = False,
             token: str | None = None):
    """While the block runs, upload the driver's files of the run every ``interval_s`` and
    write its heartbeat with the lease's ``token`` (in a thread of its own: a long upload does
    not delay it); upload once more when the block ends, however it ends. A failing round is
    logged and retried on the next one; the last one's failure is raised unless the block
    itself failed."""
    if st is None:
        yield
        return
    try:
        sent = in_store(st, name)  # what the pull brought down is there already
    except ImgtrainError:
        sent = {}
    stop, lock = threading.Event(), threading.Lock()
    failure: list[BaseException] = []

    def round_():
        with lock:
            try:
                push(st, name, sent, everything)
                failure.clear()
            except Exception as e:  # whatever it is, the mirror goes on: the next round retries
                if not failure or str(failure[0]) != str(e):  # once, not every 2 s
                    log.warning("uploading run %s to %s failed: %s", name, st.uri, one_line(e),
                                exc_info=not isinstance(e, ImgtrainError))
                failure[:] = [e]

    def heartbeat():
        try:
            beat(st, name, token)
        except Exception as e:  # noqa: BLE001 - retried; one older than HEARTBEAT_STALE_S says "gone"
            log.warning("the heartbeat of run %s failed: %s", name, one_line(e))

    threads = [_every(interval_s, stop, round_, "imgtrain-mirror"),
               _every(interval_s, stop, heartbeat, "imgtrain-heartbeat")]
    ok = False
    try:
        yield
        ok = True
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        round_()  # never raises: a failure of the block stays the one told
        if ok and failure:
            error = failure[0]
            if isinstance(error, ImgtrainError):
                raise error
            raise ImgtrainError(f"storage {st.uri}: the last upload failed: {one_line(error)}") from error


def _every(interval_s: float, stop: threading.Event, work, name: str) -> threading.Thread:
    """``work()`` at once, then every ``interval_s`` until ``stop`` is set, in a thread."""
    def loop():
        work()  # at once: a run that fails in its first seconds is in the store too
        while not stop.wait(interval_s):
            work()

    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()
    return thread
