"""A location in an object store (``--storage``, ``--data``, a webdataset ``--source``): its
filesystem, the path of its root there, and this machine's copy of it under ``IMGTRAIN_CACHE``.

Every check that keeps a bucket's content inside this machine's copy is here, in one place
(issue 33): a location is a bucket and a prefix of plain names (``cache_dir``, ``check_plain_s3``),
and a key of the store becomes a local path only through ``local_file``.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from imgtrain.errors import ImgtrainError, one_line

ENDPOINT_VARS = ("IMGTRAIN_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
CACHE_VAR = "IMGTRAIN_CACHE"


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
    check_plain_s3(uri)
    _, root = _resolve(uri)  # an unknown scheme or a missing client library: said now
    # the cache keeps the account of abfs://container@account/... (two accounts, two copies)
    return Store(uri=uri, root=root, local=cache_dir("stores", uri, rest.partition("?")[0]))


def _cache() -> Path:
    return Path(os.environ.get(CACHE_VAR) or Path.home() / ".cache" / "imgtrain").expanduser()


def cache_dir(kind: str, uri: str, path: str) -> Path:
    """This machine's copy of the store's location ``uri`` (``path``: bucket/prefix) under the
    cache. Its segments are plain names: ``s3://b/x/../../DIR`` would put the copy in DIR."""
    segments = path.strip("/").split("/")
    if any(s in ("", ".", "..") or any(ord(c) < 32 for c in s) for s in segments) or "\\" in path:
        raise ImgtrainError(f"{one_line(uri, 200)}: a location in an object store is a bucket and a prefix of plain "
                            "names, without '.', '..', '//' or control characters")
    return (_cache() / kind / uri.partition("://")[0]).resolve().joinpath(*segments)


def checkpoint_staging(run_location: str, rank: int) -> Path:
    """Where rank ``rank`` of the run at ``run_location`` writes its checkpoints before they go
    into the run, on its node: save()'s folder, and for an object store the files waiting for
    Ray's upload (Ray deletes one once uploaded; one whose upload failed, the store out of
    reach, fails the attempt with it). What a rank leaves when it dies (SIGKILLed by a fault or
    by Ray stopping its worker group in the middle of a save: 180 MB each for a ResNet-18) is
    cleared by the rank's next attempt on this node and by the driver's end. In the user's own
    cache, not a shared /tmp where another user could put a link in its way."""
    import hashlib

    return _cache() / "staging" / hashlib.sha256(run_location.encode()).hexdigest()[:16] / f"rank-{rank}"


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


def check_plain_s3(uri: str) -> None:
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


def where(error: BaseException, st: Store, what: str = "storage") -> ImgtrainError:
    """One line for an object store that cannot be reached or refuses us (``what``: the
    option that named it, as the message calls it)."""
    hint = ("check the bucket name, the credentials in the environment (AWS_ACCESS_KEY_ID, ...) and, for an "
            f"S3-compatible server, {ENDPOINT_VARS[0]}")
    return ImgtrainError(f"{what} {st.uri}: {one_line(error, 300)}; {hint}")


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


def copy_down(fs, source: str, target: Path, st: Store, what: str = "storage") -> None:
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
        raise where(e, st, what) from None
