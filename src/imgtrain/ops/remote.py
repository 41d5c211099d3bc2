"""A location in an object store (``--storage``, ``--data``, a webdataset ``--source``): its
filesystem, the path of its root there, and this machine's copy of it under ``IMGTRAIN_CACHE``.

Every check that keeps a bucket's content inside this machine's copy is here, in one place
(issue 33): a location is a bucket and a prefix of plain names (``cache_dir``, ``check_plain_s3``),
and a key of the store becomes a local path only through ``local_file``.
"""

from __future__ import annotations

import contextlib
import os
import re
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


def cache_root() -> Path:
    """imgtrain's cache on this machine: ``IMGTRAIN_CACHE``, else ~/.cache/imgtrain."""
    return Path(os.environ.get(CACHE_VAR) or Path.home() / ".cache" / "imgtrain").expanduser()


def cache_dir(kind: str, uri: str, path: str) -> Path:
    """This machine's copy of the store's location ``uri`` (``path``: bucket/prefix) under the
    cache. Its segments are plain names: ``s3://b/x/../../DIR`` would put the copy in DIR."""
    segments = path.strip("/").split("/")
    if any(s in ("", ".", "..") or any(ord(c) < 32 for c in s) for s in segments) or "\\" in path:
        raise ImgtrainError(f"{one_line(uri, 200)}: a location in an object store is a bucket and a prefix of plain "
                            "names, without '.', '..', '//' or control characters")
    return (cache_root() / kind / uri.partition("://")[0]).resolve().joinpath(*segments)


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
        shown = re.sub(r"^s3://[^/?#]*@", "s3://", uri).partition("?")[0]  # never the key and secret it may hold
        raise ImgtrainError(f"{one_line(shown, 200)}: write an S3 location as s3://bucket/prefix, nothing more; the region, "
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


class ObjectChanged(ImgtrainError):
    """An object that is not as it was listed any more: replaced, grown or cut short since."""


def copy_up(src, fs, target: str) -> None:
    """An open local file's bytes, from where it stands, to the object ``target``, 8 MiB at a time."""
    with fs.open_output_stream(target) as dst:
        while chunk := src.read(8 << 20):
            dst.write(chunk)


def copy_down(fs, source: str, target: Path, st: Store, listed: tuple[int, float | None],
              what: str = "storage") -> None:
    """One object to a local file, complete or not at all: written under a name of its own
    (two processes fetching the same file never share one), then renamed into place.
    ``listed``: the object's (size, mtime in seconds or None) as its listing gave them, which a
    disk check counted: no more than that is copied, and an object that is not so any more
    (replaced, grown or cut short since) is refused with ObjectChanged, nothing of it kept."""
    size = listed[0]
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as dst, fs.open_input_stream(source) as src:
            _check_unchanged(_opened_as(src), listed, source, st, what)  # before the first byte
            left, reads = size, 0
            while left and (chunk := src.read(min(left, 8 << 20))):
                dst.write(chunk)
                left, reads = left - len(chunk), reads + 1
            if left or src.read(1):
                raise _changed(source, st, what, listed, "cut short" if left else "longer than listed")
        if reads > 1:  # several ranged reads: the object may have been replaced between two of them
            info = fs.get_file_info(source)
            _check_unchanged((info.size, info.mtime.timestamp() if info.mtime else None), listed, source, st, what)
        os.replace(partial, target)
    except BaseException as e:  # Ctrl-C included: no partial file stays behind
        with contextlib.suppress(OSError):
            os.unlink(partial)
        if isinstance(e, (OSError, ValueError)):  # pyarrow's ArrowInvalid is a ValueError
            raise where(e, st, what) from None
        raise


def _opened_as(stream) -> tuple[int | None, float | None]:
    """(size, mtime in seconds) of the object a stream was opened on, where its store says
    (S3's reply to the HEAD request that opened it); None for what it does not say."""
    from datetime import datetime

    try:
        meta = stream.metadata() or {}
        size = int(meta["Content-Length"]) if "Content-Length" in meta else None
        mtime = datetime.fromisoformat(meta["Last-Modified"].decode()).timestamp() if "Last-Modified" in meta else None
    except (ValueError, TypeError, AttributeError, OSError):
        return None, None
    return size, mtime


def _check_unchanged(found: tuple[int | None, float | None], listed: tuple[int, float | None], source: str,
                     st: Store, what: str) -> None:
    (size, mtime), (listed_size, listed_mtime) = found, listed
    if size is not None and size != listed_size:
        raise _changed(source, st, what, listed, f"{size} bytes now")
    # listings and HEAD replies give whole seconds (S3) or finer: within a second is the same time
    if None not in (mtime, listed_mtime) and abs(mtime - listed_mtime) >= 1:
        raise _changed(source, st, what, listed, "replaced since")


def _changed(source: str, st: Store, what: str, listed: tuple[int, float | None], how: str) -> ObjectChanged:
    scheme = st.uri.partition("://")[0]
    return ObjectChanged(f"{what} {st.uri}: {one_line(f'{scheme}://{source}', 200)} changed while it was being copied "
                         f"(listed with {listed[0]} bytes, {how}); nothing of it was kept: run the command again "
                         "once it is no longer being written")
