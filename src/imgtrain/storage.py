"""Runs in an object store (``--storage s3://bucket/prefix``; gs:// and other pyarrow URIs too).

The store holds the run: Ray Train's workers upload checkpoints there themselves (in the
background, ``ray.train.report``'s async mode), and the driver mirrors the files it writes
(config.json, metrics.jsonl, status.json, logs) up every few seconds. Every command works on
a local *working copy* of the runs it touches, under ``IMGTRAIN_CACHE``
(``~/.cache/imgtrain/stores/<scheme>/<bucket>/<prefix>``): a run named on the command line is
brought down whole before it is used (only files whose size or time changed are fetched),
``runs list`` fetches each run's small files and its checkpoints' meta.json only. So the rest
of imgtrain keeps reading and writing plain files, and any machine with the credentials can
resume, evaluate or serve a run another machine trained.

Credentials come from the environment as the cloud's own tools read them (``AWS_ACCESS_KEY_ID``
..., an instance role, ``GOOGLE_APPLICATION_CREDENTIALS``); they never travel inside a
pickled filesystem object. pyarrow's S3 client ignores ``AWS_ENDPOINT_URL`` (apache/arrow#49643),
so an S3-compatible server (MinIO, moto) is named by ``IMGTRAIN_S3_ENDPOINT`` (or
``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``), e.g. ``http://127.0.0.1:9000``.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from imgtrain.errors import ImgtrainError, one_line

ENDPOINT_VARS = ("IMGTRAIN_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
CACHE_VAR = "IMGTRAIN_CACHE"
PUSH_INTERVAL_S = 2.0
# Never mirrored: the lock is about this machine's processes, logs/ray links to this machine's
# Ray session, and the checkpoints are uploaded by the workers that write them.
LOCAL_ONLY = (".lock", "logs/ray")
CHECKPOINT_PREFIX = "checkpoint_"
META_FILE = "meta.json"


def is_remote(storage: str | os.PathLike) -> bool:
    storage = str(storage)
    return "://" in storage and not storage.startswith("file://")


@dataclass(frozen=True)
class Store:
    """One ``--storage`` URI: its filesystem, the path of its root there, and the working copy."""

    uri: str  # as given, without a trailing slash
    root: str  # "bucket/prefix" for pyarrow
    local: Path  # the working copy's root

    @property
    def fs(self):
        return _filesystem(self.uri)

    def run_uri(self, name: str) -> str:
        return f"{self.uri}/{name}"


def store(storage: str) -> Store:
    uri = storage.rstrip("/")
    scheme, _, rest = uri.partition("://")
    if not rest.strip("/"):
        raise ImgtrainError(f"--storage {storage}: name a bucket, e.g. {scheme}://my-bucket/runs")
    _filesystem(uri)  # an unknown scheme or a missing client library: said now
    return Store(uri=uri, root=rest.strip("/"), local=(_cache() / "stores" / scheme / rest.strip("/")).resolve())


def _cache() -> Path:
    return Path(os.environ.get(CACHE_VAR) or Path.home() / ".cache" / "imgtrain").expanduser()


def _filesystem(uri: str):
    """pyarrow's filesystem for ``uri``; S3 with the endpoint from the environment."""
    import pyarrow.fs as pafs

    if uri.startswith("s3://"):
        return s3_filesystem()
    try:
        return pafs.FileSystem.from_uri(uri)[0]
    except (ValueError, OSError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise ImgtrainError(f"--storage {uri}: {one_line(e)}; use a local path or s3://, gs://, abfs:// "
                            "as pyarrow supports them") from None


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
    return _filesystem(uri), uri.partition("://")[2]


def where(error: BaseException, st: Store) -> ImgtrainError:
    """One line for an object store that cannot be reached or refuses us."""
    hint = ("check the bucket name, the credentials in the environment (AWS_ACCESS_KEY_ID, ...) and, for an "
            f"S3-compatible server, {ENDPOINT_VARS[0]}")
    return ImgtrainError(f"storage {st.uri}: {one_line(error, 300)}; {hint}")


# ---------------------------------------------------------------- the working copy


def remote_files(st: Store, name: str) -> dict[str, tuple[int, float]]:
    """{path relative to the run: (size, mtime)} of every file of the run in the store."""
    import pyarrow.fs as pafs

    base = f"{st.root}/{name}"
    try:
        infos = st.fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
    except OSError as e:
        raise where(e, st) from None
    return {i.path[len(base) + 1:]: (i.size, i.mtime.timestamp() if i.mtime else 0.0)
            for i in infos if i.type == pafs.FileType.File}


def run_names(st: Store) -> list[str]:
    """The names of the folders directly under the store's root that hold a run marker."""
    import pyarrow.fs as pafs

    from imgtrain.ops.ownership import MARKER_FILE

    try:
        infos = st.fs.get_file_info(pafs.FileSelector(st.root, allow_not_found=True))
        folders = [i.base_name for i in infos if i.type == pafs.FileType.Directory]
        markers = st.fs.get_file_info([f"{st.root}/{n}/{MARKER_FILE}" for n in folders])
    except OSError as e:
        raise where(e, st) from None
    return sorted(n for n, m in zip(folders, markers) if m.type == pafs.FileType.File)


def pull(st: Store, name: str, checkpoints: bool = True, only_checkpoints: bool = False) -> Path:
    """Bring the run ``name`` into the working copy and return its local folder. Files whose
    size and time match are not fetched again; local checkpoints the store no longer has (Ray
    Train's retention deleted them) go. ``checkpoints`` False: only each checkpoint's meta.json;
    ``only_checkpoints``: the checkpoints only (the driver of a run has the newer other files)."""
    import shutil

    local = st.local / name
    wanted = remote_files(st, name)
    if not wanted and not only_checkpoints:  # no such run in the store (any more): nor its working copy
        if local.is_dir() and not local.is_symlink():
            shutil.rmtree(local, ignore_errors=True)
        return local
    if not checkpoints:
        wanted = {p: v for p, v in wanted.items() if not _in_checkpoint(p) or p.endswith("/" + META_FILE)}
    if only_checkpoints:
        wanted = {p: v for p, v in wanted.items() if _in_checkpoint(p)}
    fs = st.fs
    for rel, (size, mtime) in wanted.items():
        target = local / rel
        if _same(target, size, mtime):
            continue
        _copy_down(fs, f"{st.root}/{name}/{rel}", target, st)
        os.utime(target, (mtime, mtime))
    _drop_local_extras(local, set(wanted))
    return local


def _in_checkpoint(rel: str) -> bool:
    return rel.startswith(CHECKPOINT_PREFIX) and "/" in rel


def _same(path: Path, size: int, mtime: float) -> bool:
    try:
        stat = path.stat()
    except OSError:
        return False
    return stat.st_size == size and abs(stat.st_mtime - mtime) < 1e-3


def _drop_local_extras(local: Path, wanted: set[str]) -> None:
    """Checkpoint folders the store no longer has: Ray Train deleted them (retention)."""
    import shutil

    if not local.is_dir():
        return
    kept = {rel.split("/", 1)[0] for rel in wanted}
    for folder in local.iterdir():
        if folder.name.startswith(CHECKPOINT_PREFIX) and folder.name not in kept and folder.is_dir() \
                and not folder.is_symlink():
            shutil.rmtree(folder, ignore_errors=True)


def push(st: Store, name: str, sent: dict[str, tuple[int, int]] | None = None, everything: bool = False,
         under: str | None = None) -> None:
    """Upload the run's files from the working copy that changed since ``sent`` (updated in
    place), or only those ``under`` one folder (a report). Checkpoints only with ``everything``
    (the local backend writes them here, and
    deletes old ones: so does the store then); a checkpoint's meta.json goes last, so the store
    never lists a checkpoint whose files are not all there."""
    sent = {} if sent is None else sent
    local = st.local / name
    fs = st.fs
    new_checkpoint = False
    for path in sorted(local.rglob("*"), key=lambda p: (p.name == META_FILE, str(p))):
        rel = path.relative_to(local).as_posix()
        if path.is_symlink() or not path.is_file() or rel.endswith((".part", ".tmp")) or ".tmp/" in rel or any(
                rel == x or rel.startswith(x + "/") for x in LOCAL_ONLY):
            continue
        if _in_checkpoint(rel) and not everything or under and not rel.startswith(under + "/"):
            continue
        stat = path.stat()
        if sent.get(rel) == (stat.st_size, stat.st_mtime_ns):
            continue
        try:
            with open(path, "rb") as src, fs.open_output_stream(f"{st.root}/{name}/{rel}") as dst:
                while chunk := src.read(8 << 20):
                    dst.write(chunk)
        except OSError as e:
            raise where(e, st) from None
        sent[rel] = (stat.st_size, stat.st_mtime_ns)
        new_checkpoint = new_checkpoint or _in_checkpoint(rel)
    if new_checkpoint:  # the local backend's retention may have deleted older ones
        gone = {rel.split("/", 1)[0] for rel in remote_files(st, name) if _in_checkpoint(rel)}
        for folder in sorted(gone - {p.name for p in local.glob(CHECKPOINT_PREFIX + "*")}):
            delete(st, name, folder)
            for rel in [r for r in sent if r.startswith(folder + "/")]:
                del sent[rel]


def delete(st: Store, name: str, rel: str = "") -> None:
    """Delete a run (or one folder of it, e.g. a damaged checkpoint) from the store."""
    try:
        st.fs.delete_dir(f"{st.root}/{name}" + (f"/{rel}" if rel else ""))
    except FileNotFoundError:
        pass
    except OSError as e:
        raise where(e, st) from None


@contextlib.contextmanager
def mirrored(st: Store | None, name: str, interval_s: float = PUSH_INTERVAL_S, everything: bool = False):
    """While the block runs, upload the driver's files of the run every ``interval_s``; once
    more when it ends, however it ends. A failing upload is retried on the next round; the last
    one's failure is raised unless the block itself failed."""
    if st is None:
        yield
        return
    sent: dict[str, tuple[int, int]] = {}
    stop, lock = threading.Event(), threading.Lock()
    failure: list[BaseException] = []

    def round_():
        with lock:
            try:
                push(st, name, sent, everything)
                failure.clear()
            except ImgtrainError as e:
                failure[:] = [e]

    def loop():
        round_()  # at once: a run that fails in its first seconds is in the store too
        while not stop.wait(interval_s):
            round_()

    thread = threading.Thread(target=loop, name="imgtrain-mirror", daemon=True)
    thread.start()
    ok = False
    try:
        yield
        ok = True
    finally:
        stop.set()
        thread.join()
        round_()
        if ok and failure:
            raise failure[0]


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
    is), copied to this node's cache: its manifest.json and the Parquet files it lists. A file
    already there with the store's size is kept (readers check every file's sha256 against the
    manifest). Several processes of one node copy it once: they take turns on a lock file.
    Each node holds one copy on disk; training then streams it as from any local folder."""
    import fcntl
    import json

    from imgtrain.data.format import MANIFEST

    uri = uri.rstrip("/")
    fs, root = split(uri)
    scheme = uri.partition("://")[0]
    local = (_cache() / "data" / scheme / root).resolve()
    local.mkdir(parents=True, exist_ok=True)
    st = Store(uri=uri, root=root, local=local)
    with open(local.parent / f".{local.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _download(fs, f"{root}/{MANIFEST}", local / MANIFEST, st, missing=(
            f"{uri} is not a prepared data set (no {MANIFEST}); prepare one locally with `imgtrain data prepare` "
            "and upload the folder as it is"))
        try:
            manifest = json.loads((local / MANIFEST).read_text())
            files = [rel for split_ in manifest["splits"].values() for rel in split_["files"]]
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ImgtrainError(f"{uri}/{MANIFEST} is not a valid manifest; prepare the data set again") from None
        for rel in files:
            if rel.startswith("/") or ".." in rel.split("/"):  # a manifest stays inside its folder
                raise ImgtrainError(f"{uri}/{MANIFEST} lists {rel!r}, outside the data set; prepare it again")
            _download(fs, f"{root}/{rel}", local / rel, st, missing=f"{uri}/{rel} is missing; upload the data set again")
    return local


def _download(fs, source: str, target: Path, st: Store, missing: str) -> None:
    import pyarrow.fs as pafs

    try:
        info = fs.get_file_info(source)
    except OSError as e:
        raise where(e, st) from None
    if info.type != pafs.FileType.File:
        raise ImgtrainError(missing)
    if target.is_file() and target.stat().st_size == info.size and target.name != "manifest.json":
        return
    _copy_down(fs, source, target, st)


def _copy_down(fs, source: str, target: Path, st: Store) -> None:
    """One object to a local file, complete or not at all."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".part")
    try:
        with fs.open_input_stream(source) as src, open(partial, "wb") as dst:
            while chunk := src.read(8 << 20):
                dst.write(chunk)
    except OSError as e:
        partial.unlink(missing_ok=True)
        raise where(e, st) from None
    os.replace(partial, target)
