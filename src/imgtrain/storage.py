"""Runs in an object store (``--storage s3://bucket/prefix``; gs:// and other pyarrow URIs too).

The store holds the run: Ray Train's workers upload checkpoints there themselves (in the
background, ``ray.train.report``'s async mode), and the driver mirrors the files it writes
(config.json, metrics.jsonl, status.json, logs) up every few seconds, with a heartbeat that
tells other machines it is alive. Every command works on a local *working copy* of the runs it
touches, under ``IMGTRAIN_CACHE`` (``~/.cache/imgtrain/stores/<scheme>/<bucket>/<prefix>``): a
run named on the command line is brought down whole before it is used (only files whose size or
time changed are fetched), ``runs list`` fetches each run's small files and its checkpoints'
meta.json only. A run that a process on this machine trains (or deletes) is never brought down
over that process's files. So the rest of imgtrain keeps reading and writing plain files, and
any machine with the credentials can resume, evaluate or serve a run another machine trained.

Credentials come from the environment as the cloud's own tools read them (``AWS_ACCESS_KEY_ID``
..., an instance role, ``GOOGLE_APPLICATION_CREDENTIALS``); they never travel inside a
pickled filesystem object. pyarrow's S3 client ignores ``AWS_ENDPOINT_URL`` (apache/arrow#49643),
so an S3-compatible server (MinIO, moto) is named by ``IMGTRAIN_S3_ENDPOINT`` (or
``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``), e.g. ``http://127.0.0.1:9000``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import tempfile
import threading
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

from imgtrain.checkpoint_policy import POLICY, PREFIX, RAY_SNAPSHOT_FILE
from imgtrain.errors import ImgtrainError, ImgtrainWarning, one_line
from imgtrain.ops import ownership, process
from imgtrain.ops.files import atomic_write_text, sha256_file
from imgtrain.ops.ownership import LOCK_FILE, MARKER_FILE

log = logging.getLogger(__name__)

ENDPOINT_VARS = ("IMGTRAIN_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
CACHE_VAR = "IMGTRAIN_CACHE"
PUSH_INTERVAL_S = 2.0
# The driver of a run writes {"host", "pid", "time"} here every PUSH_INTERVAL_S; a "running"
# status from another host whose heartbeat is older than HEARTBEAT_STALE_S is a driver that is
# gone (runs.read_status). Generous: clocks of two machines differ a little, and a busy store answers late.
HEARTBEAT_FILE = "heartbeat.json"
HEARTBEAT_STALE_S = 60.0
# Never mirrored: the lock is about this machine's processes, logs/ray links to this machine's
# Ray session, and the checkpoints are uploaded by the workers that write them.
# In the working copy, never mirrored: the names of the run's checkpoints this machine has seen in
# the store (``_record_synced``). Inside the run's folder: it goes with the folder.
SYNCED_FILE = ".imgtrain-synced.json"
LOCAL_ONLY = (".lock", "logs/ray", SYNCED_FILE)
# Written straight to the store (by Ray Train; the heartbeat): a copy pulled here is older, never sent back.
STORE_ONLY = (RAY_SNAPSHOT_FILE, HEARTBEAT_FILE)
META_FILE = "meta.json"


def is_remote(storage: str | os.PathLike) -> bool:
    storage = str(storage)
    return "://" in storage and not storage.startswith("file://")


@dataclass(frozen=True)
class Store:
    """One ``--storage`` URI: its filesystem, the path of its root there, and the working copy."""

    uri: str  # as given, without a trailing slash
    root: str  # the path pyarrow's filesystem knows it by: "bucket/prefix" (abfs: "container/prefix")
    local: Path  # the working copy's root

    @property
    def fs(self):
        return _resolve(self.uri)[0]

    def run_uri(self, name: str) -> str:
        return f"{self.uri}/{name}"


def store(storage: str) -> Store:
    uri = storage.rstrip("/")
    scheme, _, rest = uri.partition("://")
    if not rest.strip("/"):
        raise ImgtrainError(f"--storage {storage}: name a bucket, e.g. {scheme}://my-bucket/runs")
    _plain_s3(uri)
    _, root = _resolve(uri)  # an unknown scheme or a missing client library: said now
    # the cache keeps the account of abfs://container@account/... (two accounts, two copies)
    return Store(uri=uri, root=root, local=_cache_dir("stores", uri, rest.partition("?")[0]))


def _cache() -> Path:
    return Path(os.environ.get(CACHE_VAR) or Path.home() / ".cache" / "imgtrain").expanduser()


def _cache_dir(kind: str, uri: str, path: str) -> Path:
    """This machine's copy of the store's location ``uri`` (``path``: bucket/prefix) under the
    cache. Its segments are plain names: ``s3://b/x/../../DIR`` would put the copy in DIR."""
    segments = path.strip("/").split("/")
    if any(s in ("", ".", "..") or any(ord(c) < 32 for c in s) for s in segments) or "\\" in path:
        raise ImgtrainError(f"{one_line(uri, 200)}: a location in an object store is a bucket and a prefix of plain "
                            "names, without '.', '..', '//' or control characters")
    return (_cache() / kind / uri.partition("://")[0]).resolve().joinpath(*segments)


def _resolve(uri: str):
    """(pyarrow's filesystem, the path in it) for ``uri``. S3 gets imgtrain's own client (the
    endpoint from the environment, no credentials inside); other schemes are pyarrow's, whose
    path may differ from the URI's text (abfs://container@account.dfs.core.windows.net/runs is
    "container/runs")."""
    import pyarrow.fs as pafs

    if uri.startswith("s3://"):
        return s3_filesystem(), uri.removeprefix("s3://").strip("/")
    try:
        fs, path = pafs.FileSystem.from_uri(uri)
    except (ValueError, OSError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise ImgtrainError(f"--storage {uri}: {one_line(e)}; use a local path or s3://, gs://, abfs:// "
                            "as pyarrow supports them") from None
    return fs, path.strip("/")


def _plain_s3(uri: str) -> None:
    """A user's s3:// location names a bucket and a prefix; pyarrow would read options (?region=)
    or credentials (key:secret@) from more, imgtrain's client takes them from the environment."""
    if uri.startswith("s3://") and ("?" in uri or "@" in uri):
        raise ImgtrainError(f"{uri}: write an S3 location as s3://bucket/prefix, nothing more; the region, "
                            f"endpoint and credentials come from the environment (AWS_REGION, "
                            f"{ENDPOINT_VARS[0]}, AWS_ACCESS_KEY_ID ...)")


def s3_filesystem():
    """An S3 client from the environment: the usual AWS variables, plus an endpoint for
    S3-compatible servers. No credentials are stored in it (it is pickled to Ray's workers,
    which read their own environment)."""
    import pyarrow.fs as pafs

    endpoint = next((os.environ[v] for v in ENDPOINT_VARS if os.environ.get(v)), None)
    options = {"region": os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
               or ("us-east-1" if endpoint else None)}
    if endpoint:
        scheme, _, host = endpoint.rpartition("://")
        options.update(endpoint_override=host.rstrip("/"), scheme=scheme or "https")
    return pafs.S3FileSystem(**{k: v for k, v in options.items() if v is not None})


def split(uri: str):
    """(filesystem, path in it) of a URI such as s3://bucket/prefix/run/checkpoint_..."""
    return _resolve(uri.rstrip("/"))


def where(error: BaseException, st: Store) -> ImgtrainError:
    """One line for an object store that cannot be reached or refuses us."""
    hint = ("check the bucket name, the credentials in the environment (AWS_ACCESS_KEY_ID, ...) and, for an "
            f"S3-compatible server, {ENDPOINT_VARS[0]}")
    return ImgtrainError(f"storage {st.uri}: {one_line(error, 300)}; {hint}")


# ---------------------------------------------------------------- keys and local paths


class UnsafeKey(ImgtrainError):
    """A key in the store that must not become a file here (it would leave the working copy)."""


def check_key(rel: str) -> str:
    """``rel`` (a key relative to a run or a data set) when it is a path of plain names; an
    error otherwise. A bucket is someone else's input: ``..``, an empty segment (``//``), a
    backslash or a control character never reaches a local path, nor pyarrow (which fails on
    ``//`` with ArrowInvalid)."""
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts) or "\\" in rel or any(ord(c) < 32 or ord(c) == 127 for c in rel):
        raise UnsafeKey(f"the store holds a key imgtrain will not copy here: {rel[:200]!r} (it is not a path of "
                        "plain names); delete it with the store's own tools")
    return rel


def local_file(folder: Path, rel: str) -> Path:
    """The one way a key of the store becomes a local path: ``folder/rel`` when the key is a path
    of plain names and no link on the way (``logs/ray`` links to this machine's Ray session)
    leads out of ``folder``; an error otherwise."""
    path = folder.joinpath(*check_key(rel).split("/"))
    step = folder
    for part in rel.split("/"):
        step = step / part
        if step.is_symlink():
            raise UnsafeKey(f"the store's key {rel!r} leads through the link {step} here; it is not copied")
    return path


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
    (``_send_back``). ``checkpoints`` False: only each checkpoint's meta.json;
    ``only_checkpoints``: the checkpoints only (the driver of a run has the newer other files).
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
    known = _synced(local)
    if not listed and not only_checkpoints and known is not None and not _never_sent(local, set(), known):
        if local.is_dir() and not local.is_symlink():  # deleted from the store (`clean` elsewhere): here too
            shutil.rmtree(local, ignore_errors=True)
        return False
    wanted = listed
    if not checkpoints:
        wanted = {p: v for p, v in wanted.items() if not _in_checkpoint(p) or p.endswith("/" + META_FILE)}
    if only_checkpoints:
        wanted = {p: v for p, v in wanted.items() if _in_checkpoint(p)}
    changed_here = False
    for rel, (size, mtime) in wanted.items():
        try:
            target = local_file(local, rel)
        except UnsafeKey as e:
            warnings.warn(f"run {name!r} in {st.uri}: {e}", ImgtrainWarning, stacklevel=3)
            continue
        if _same(target, size, mtime):
            continue
        if _changed_here(target, mtime):
            changed_here = True
            continue
        _copy_down(st.fs, f"{st.root}/{name}/{rel}", target, st)
        os.utime(target, (mtime, mtime))
    if not local.is_dir():
        return False
    in_store = {rel.split("/", 1)[0] for rel in listed if _in_checkpoint(rel)}
    whole_there = {f for f in in_store if f"{f}/{META_FILE}" in listed}  # meta.json goes up last
    gone = _gone_from_store(local, in_store, known)
    for folder in gone:
        shutil.rmtree(local / folder, ignore_errors=True)
    _record_synced(local, add=whole_there, drop=gone)
    return changed_here or bool(_never_sent(local, whole_there, _synced(local) or set()))


# ---------------------------------------------------------------- which checkpoints reached the store

# SYNCED_FILE names the run's checkpoints that this machine has seen in the store (uploaded from
# here, or listed there). A pull deletes a local checkpoint the store no longer lists only when it
# is named there: it was in the store, so Ray Train's (or the local backend's) retention deleted
# it. One that never got there (written while the store could not be reached) is kept and
# uploaded instead.
_ledger = threading.Lock()  # the driver's mirror thread and its own pulls write it


def _synced(local: Path) -> set[str] | None:
    """The run's checkpoints known to have been in the store; None: no record (a working copy
    made before the record was kept)."""
    try:
        names = json.loads((local / SYNCED_FILE).read_text())
    except (OSError, ValueError):
        return None
    return {n for n in names if isinstance(n, str)} if isinstance(names, list) else None


def _record_synced(local: Path, add=(), drop=()) -> None:
    with _ledger:
        known = _synced(local)
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


def _gone_from_store(local: Path, in_store: set[str], known: set[str] | None) -> list[str]:
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


def _never_sent(local: Path, whole_there: set[str], known: set[str]) -> list[str]:
    """Complete local checkpoints (a meta.json) that the store has never had whole."""
    return [d.name for d in _local_checkpoints(local)
            if d.name not in whole_there and d.name not in known and (d / META_FILE).is_file()]


def _send_back(st: Store, name: str, local: Path) -> None:
    """Upload what the working copy holds and the store lacks: checkpoints made while the store
    could not be reached, files changed here since their last upload. Not while a driver on
    another machine holds the run (its lease): the run has moved on there, and what is here
    stays here, with a warning."""
    holder = lease_holder(_read_json_file(local / HEARTBEAT_FILE))
    if holder:
        warnings.warn(f"run {name!r}: this machine has files of it that {st.uri} lacks ("
                      f"{', '.join(_never_sent(local, set(), _synced(local) or set())) or 'newer records'}); "
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
    uploaded = set()
    for rel in sorted(_mirrored_files(local), key=lambda r: (r.rsplit("/", 1)[-1] == META_FILE, r)):
        if _in_checkpoint(rel) and not everything or under and not rel.startswith(under + "/"):
            continue
        stamp = _upload(fs, local / rel, f"{st.root}/{name}/{rel}", sent.get(rel), st)
        if stamp:
            sent[rel] = stamp
            if _in_checkpoint(rel) and rel.endswith("/" + META_FILE):
                uploaded.add(rel.split("/", 1)[0])
    _record_synced(local, add=uploaded)
    if uploaded and prune:  # the local backend's retention may have deleted older ones
        gone = {rel.split("/", 1)[0] for rel in remote_files(st, name) if _in_checkpoint(rel)}
        gone -= {p.name for p in local.glob(PREFIX + "*") if POLICY.is_checkpoint(p.name)}
        for folder in sorted(gone):
            delete(st, name, folder)
            for rel in [r for r in sent if r.startswith(folder + "/")]:
                del sent[rel]
        _record_synced(local, drop=gone)


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
                with fs.open_output_stream(target) as dst:
                    while chunk := src.read(8 << 20):
                        dst.write(chunk)
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


# ---------------------------------------------------------------- the driver's heartbeat, its lease on the run

# The driver of a run writes {"host", "pid", "time", "token"} to HEARTBEAT_FILE every
# PUSH_INTERVAL_S, and {"released": true} with them when it ends. That object is the run's lease:
# while it is held (not released, and fresh: a driver on this host that still runs, another
# host's beat younger than HEARTBEAT_STALE_S) no other driver starts the run. pyarrow's
# filesystems offer no conditional put, so two drivers that start at the same moment settle it
# as leader elections on eventually quiet registers do: each writes its token, waits, and reads
# the lease back; the last writer's token is there for both, and only its driver goes on. This
# holds while either driver's read and write of the lease are less than LEASE_SETTLE_S apart.
LEASE_SETTLE_S = 3.0
_held: set[str] = set()  # the tokens of the leases this process holds


def lease_holder(record) -> str | None:
    """'process PID on HOST (its heartbeat N s ago)' while the heartbeat ``record`` holds the
    run; None when it is released, stale, or no heartbeat at all."""
    if not isinstance(record, dict) or record.get("released") or not isinstance(record.get("time"), (int, float)):
        return None
    host, pid = record.get("host"), record.get("pid")
    if host == socket.gethostname():
        # this process (a notebook, a test) holds a lease only inside ``leased``
        if not process.pid_alive(pid) or pid == os.getpid() and record.get("token") not in _held:
            return None
    elif time.time() - record["time"] > HEARTBEAT_STALE_S:
        return None
    return f"process {pid} on {host} (its heartbeat {max(0.0, time.time() - record['time']):.0f} s ago)"


def read_beat(st: Store, name: str):
    """The run's heartbeat in the store (None: none, or not JSON)."""
    try:
        with st.fs.open_input_stream(f"{st.root}/{ownership.check_name(name)}/{HEARTBEAT_FILE}") as f:
            return json.loads(f.read(1 << 16))
    except FileNotFoundError:
        return None
    except ValueError:
        return None
    except OSError as e:
        raise where(e, st) from None


def beat(st: Store, name: str, token: str | None = None, released: bool = False) -> None:
    """Write the run's heartbeat to the store: its driver (this process) is alive (or is done)."""
    record = {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time(), "token": token}
    if released:
        record["released"] = True
    try:
        with st.fs.open_output_stream(f"{st.root}/{ownership.check_name(name)}/{HEARTBEAT_FILE}") as f:
            f.write(json.dumps(record).encode())
    except OSError as e:
        raise where(e, st) from None


@contextlib.contextmanager
def leased(st: Store | None, name: str, hint: str = "wait for it or stop it"):
    """Hold the run's lease while the block runs (a driver); yields its token (None without a
    store). Refused, before anything of the run is written, while another driver holds it, or
    when another one took it at the same moment."""
    if st is None:
        yield None
        return
    holder = lease_holder(read_beat(st, name))
    if holder:
        raise ImgtrainError(f"run {name!r} is being trained right now by {holder}; {hint}")
    token = uuid.uuid4().hex
    started = time.monotonic()
    beat(st, name, token)
    time.sleep(max(LEASE_SETTLE_S, 4 * (time.monotonic() - started)))  # a slow store: a longer window
    now = read_beat(st, name)
    if not isinstance(now, dict) or now.get("token") != token:
        raise ImgtrainError(f"run {name!r} was started at the same moment by {lease_holder(now) or 'another driver'}; "
                            f"that one trains it, this one stopped before writing anything: {hint}")
    _held.add(token)
    try:
        yield token
    finally:
        _held.discard(token)
        with contextlib.suppress(Exception):  # a store gone now: the heartbeat goes stale instead
            if (read_beat(st, name) or {}).get("token") == token:
                beat(st, name, token, released=True)


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


def upload_staging(run_uri: str, rank: int) -> Path:
    """Where rank ``rank`` of the run at ``run_uri`` stages its checkpoints for Ray's upload, on
    its node. Ray deletes a staged checkpoint once uploaded; one whose upload failed (the store
    could not be reached: the attempt fails with it) stays until the rank's next attempt on this
    node or the driver's end clears the folder (``ray_backend``): 180 MB each for a ResNet-18.
    In the user's own cache, not a shared /tmp where another user could put a link in its way."""
    import hashlib

    return _cache() / "uploads" / hashlib.sha256(run_uri.encode()).hexdigest()[:16] / f"rank-{rank}"


def probe(st: Store) -> None:
    """Write, read back and delete a small object under the store's root: a bucket that is
    missing, unreachable or read-only fails here, in seconds, before any training."""
    import uuid

    path = f"{st.root}/.imgtrain-probe-{uuid.uuid4().hex}"
    try:
        with st.fs.open_output_stream(path) as f:
            f.write(b"imgtrain")
        with st.fs.open_input_stream(path) as f:
            if f.read() != b"imgtrain":
                raise OSError("an object written could not be read back")
        st.fs.delete_file(path)
    except OSError as e:
        raise where(e, st) from None


# ---------------------------------------------------------------- data sets in an object store


_staged: dict[str, str] = {}


def local_data(data: str) -> str:
    """``data`` itself, or for a prepared data set in an object store its copy on this node
    (made once per process)."""
    if not is_remote(data):
        return data
    if data not in _staged:
        _staged[data] = str(stage_dataset(data))
    return _staged[data]


def stage_dataset(uri: str) -> Path:
    """A prepared data set in an object store (``imgtrain data prepare`` output uploaded as it
    is), copied to this node's cache: its manifest.json and the Parquet files it lists, each
    checked against the manifest's sha256 (a file already there that fails is fetched again;
    one that passed is remembered with its size and time, so it is not read again). Several
    processes of one node copy it once: they take turns on a lock file. Each node holds one
    copy on disk; training then streams it as from any local folder."""
    from imgtrain.data.format import MANIFEST

    uri = uri.rstrip("/")
    _plain_s3(uri)
    local = _cache_dir("data", uri, uri.partition("://")[2])
    fs, root = split(uri)
    local.mkdir(parents=True, exist_ok=True)
    st = Store(uri=uri, root=root, local=local)
    checked_file = local.parent / f".{local.name}.checked.json"
    with open(local.parent / f".{local.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _download(fs, f"{root}/{MANIFEST}", local / MANIFEST, st, missing=(
            f"{uri} is not a prepared data set (no {MANIFEST}); prepare one locally with `imgtrain data prepare` "
            "and upload the folder as it is"))
        try:
            manifest = json.loads((local / MANIFEST).read_text())
            files = [rel for split_ in manifest["splits"].values() for rel in split_["files"]]
            hashes = dict(manifest.get("sha256") or {})  # a file without one fails its check below
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ImgtrainError(f"{uri}/{MANIFEST} is not a valid manifest; prepare the data set again") from None
        checked = _read_checked(checked_file)
        for rel in files:
            try:  # a manifest stays inside its folder
                target = local_file(local, rel if isinstance(rel, str) else "..")
            except UnsafeKey:
                raise ImgtrainError(f"{uri}/{MANIFEST} lists {str(rel)[:200]!r}, outside the data set; prepare it "
                                    "again") from None
            checked[rel] = _stage_file(fs, st, rel, target, hashes.get(rel), checked.get(rel))
        atomic_write_text(checked_file, json.dumps(checked))
    return local


def _read_checked(path: Path) -> dict:
    try:
        checked = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return checked if isinstance(checked, dict) else {}


def _stage_file(fs, st: Store, rel: str, target: Path, sha256: str | None, checked) -> list:
    """One file of a data set on this node (``target``), matching ``sha256``; returns what to
    remember of it: [size, mtime in ns, sha256]."""
    with contextlib.suppress(OSError):
        stat = target.stat()
        if checked == [stat.st_size, stat.st_mtime_ns, sha256] or sha256_file(target) == sha256:
            return [stat.st_size, stat.st_mtime_ns, sha256]
    _download(fs, f"{st.root}/{rel}", target, st, missing=f"{st.uri}/{rel} is missing; upload the data set again")
    if sha256_file(target) != sha256:
        raise ImgtrainError(f"{st.uri}/{rel} does not match its sha256 in the manifest (modified or corrupt); "
                            "upload the data set again, as `imgtrain data prepare` made it")
    stat = target.stat()
    return [stat.st_size, stat.st_mtime_ns, sha256]


def _download(fs, source: str, target: Path, st: Store, missing: str) -> None:
    import pyarrow.fs as pafs

    try:
        info = fs.get_file_info(source)
    except OSError as e:
        raise where(e, st) from None
    if info.type != pafs.FileType.File:
        raise ImgtrainError(missing)
    _copy_down(fs, source, target, st)


def _copy_down(fs, source: str, target: Path, st: Store) -> None:
    """One object to a local file, complete or not at all: written under a name of its own
    (two processes fetching the same file never share one), then renamed into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    try:
        with fs.open_input_stream(source) as src, os.fdopen(fd, "wb") as dst:
            while chunk := src.read(8 << 20):
                dst.write(chunk)
        os.replace(partial, target)
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise where(e, st) from None
