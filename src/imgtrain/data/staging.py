"""A prepared data set in an object store (``--data s3://...``), copied to this node's cache.

Training, evaluation and prediction then read it as any local folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
from pathlib import Path

from imgtrain.errors import ImgtrainError
from imgtrain.ops.files import atomic_write_text, sha256_file
from imgtrain.ops.remote import (
    Store,
    UnsafeKey,
    cache_dir,
    check_plain_s3,
    copy_down,
    is_remote,
    local_file,
    split,
    where,
)

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
    check_plain_s3(uri)
    local = cache_dir("data", uri, uri.partition("://")[2])
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
    copy_down(fs, source, target, st, (info.size, info.mtime.timestamp() if info.mtime else None))
