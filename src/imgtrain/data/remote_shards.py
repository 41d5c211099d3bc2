"""The tar shards a webdataset ``--source`` in an object store names (``s3://bucket/shards/``,
``s3://bucket/shards/*.tar``, ``s3://bucket/shards/train-{000..099}.tar``), listed there and
copied whole into this machine's cache: one sequential read per shard, as WebDataset readers do
(a ranged read per image would be one request per image), several shards at once. The listing and the image reads then
work on the local copies as on local shards; names stay relative to the store's root
(``train-000.tar:key.jpg``), and missing, compressed and unsafe names are skipped with a reason.

A shard already in the cache with the object's size and a time not older than the object's is
not copied again, so a prepare that stopped half-way resumes. The disk must hold what is still
to copy (checked before the first byte); each copy is complete or absent, and is the shard as
listed, no longer (``remote.copy_down``): one that changed since is refused.
A key is the store owner's input: one that is not a path of plain names never becomes a path.
"""

from __future__ import annotations

import contextlib
import fnmatch
import glob
import os
import posixpath
import shutil
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import pyarrow.fs as pafs

from imgtrain.console import err_console
from imgtrain.data.shard_patterns import COMPRESSED, COMPRESSED_SKIPPED, MISSING, expand_braces, no_shards
from imgtrain.errors import ImgtrainError, one_line
from imgtrain.ops import remote

SPARE_BYTES = 512 << 20  # kept free beyond the shards: the data set being prepared may share the disk
COPY_STREAMS = 8  # shards copied at once: S3 scales with parallel requests, one stream gets a fraction
_SPECIAL = "{*?["  # where a pattern starts; everything before it is a literal prefix
_WHAT = "--source"  # how messages name the location


def find_remote_shards(source: str) -> tuple[list[Path], Path, list[tuple[str, str]]]:
    """``shard_patterns.find_shards`` for a ``--source`` in an object store: this machine's
    copies of its .tar shards (sorted), the folder their names are relative to, and (name, why)
    for each shard named and not read. Copies what the cache lacks first."""
    uri = source.rstrip("/")
    remote.check_plain_s3(uri)
    fs, path = remote.split(uri)
    bucket = path.split("/")[0]
    if any(c in bucket for c in _SPECIAL):
        raise ImgtrainError(f"--source {source}: name the bucket as it is; a pattern goes in the key after it")
    scheme = uri.partition("://")[0]
    st = remote.Store(uri=uri, root=bucket, local=remote.cache_dir("sources", f"{scheme}://{bucket}", bucket))
    found, missing, prefix = _named(fs, path, st)
    shards = {k: info for k, info in found.items() if k.lower().endswith(".tar")}
    compressed = sorted(k for k in found if k.lower().endswith(COMPRESSED))
    if not shards:
        if not found and _info(fs, bucket, st).type == pafs.FileType.NotFound:
            raise remote.where(FileNotFoundError(f"no bucket {bucket!r} here"), st, _WHAT)
        raise no_shards(source, posixpath.basename(compressed[0]) if compressed else None)
    copies, unsafe = {}, []
    for key, info in sorted(shards.items()):
        try:
            copies[key] = (remote.local_file(st.local, key.partition("/")[2]), info)
        except remote.UnsafeKey as e:
            unsafe.append((key, str(e)))
    if not copies:
        raise ImgtrainError(f"no .tar shards at {source} can be copied here: {one_line(unsafe[0][1])}")
    # from the keys that passed check_key (and so does a prefix they are under): plain names
    root = prefix or posixpath.commonpath([posixpath.dirname(k) for k in copies])

    def name(key: str) -> str:  # as messages and split names see it: under the root, as for local shards
        return key[len(root) + 1:] if key.startswith(root + "/") else f"{scheme}://{key}"

    skipped = [(name(m), MISSING) for m in missing] + [(name(k), COMPRESSED_SKIPPED) for k in compressed]
    skipped += [(name(k), why) for k, why in unsafe]
    _copy_missing(fs, st, copies)
    return sorted(target for target, _ in copies.values()), st.local.joinpath(*root.split("/")[1:]), skipped


def _named(fs, path: str, st: remote.Store) -> tuple[dict, list[str], str | None]:
    """({key: FileInfo} of the files ``path`` names, the names a brace pattern gives that match
    nothing, and ``path`` itself when it is a prefix: its shards are named relative to it)."""
    patterns = expand_braces(path)
    if patterns == [path] and not glob.has_magic(path):  # one object or one prefix
        info = _info(fs, path, st)
        if info.type == pafs.FileType.File:
            return {path: info}, [], None
        if info.type == pafs.FileType.Directory:
            return {k: i for k, i in _listing(fs, path, st).items() if _visible(k, path)}, [], path
        return {}, [], None
    literal = path[:min(path.find(c) for c in _SPECIAL if c in path)]
    listing = _listing(fs, literal.rpartition("/")[0], st)  # one listing for every name of the pattern
    found, missing = {}, []
    for pattern in patterns:
        if glob.has_magic(pattern):
            found.update((k, i) for k, i in listing.items() if _glob_match(k.split("/"), pattern.split("/")))
        elif pattern in listing:
            found[pattern] = listing[pattern]
        else:  # a prefix, as a local pattern may name a folder; else a name that is not there
            folder = pattern.rstrip("/") + "/"
            under = {k: i for k, i in listing.items() if k.startswith(folder) and _visible(k, pattern)}
            if not under:
                missing.append(pattern)
            found.update(under)
    return found, missing, None


def _info(fs, path: str, st: remote.Store):
    try:
        return fs.get_file_info(path)
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise remote.where(e, st, _WHAT) from None


def _listing(fs, folder: str, st: remote.Store) -> dict:
    """{key: FileInfo} of every object under ``folder``, subfolders included."""
    try:
        infos = fs.get_file_info(pafs.FileSelector(folder, recursive=True, allow_not_found=True))
    except (OSError, ValueError) as e:
        raise remote.where(e, st, _WHAT) from None
    return {i.path: i for i in infos if i.type == pafs.FileType.File}


def _visible(key: str, folder: str) -> bool:
    """Not hidden under ``folder`` (as local folders are walked: ``.cache/x.tar`` is left out)."""
    return not any(part.startswith(".") for part in key[len(folder.rstrip("/")) + 1:].split("/"))


def _glob_match(parts: list[str], pattern: list[str]) -> bool:
    """A key's segments against a glob's, as ``glob.glob(recursive=True)`` matches paths: ``*``
    stays within a segment, ``**`` spans any number, hidden names need a pattern starting with '.'."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(_glob_match(parts[i:], pattern[1:]) for i in range(len(parts) + 1)
                   if not any(p.startswith(".") for p in parts[:i]))
    return (bool(parts) and (pattern[0].startswith(".") or not parts[0].startswith("."))
            and fnmatch.fnmatchcase(parts[0], pattern[0]) and _glob_match(parts[1:], pattern[1:]))


def _copy_missing(fs, st: remote.Store, copies: dict) -> None:
    """Copy every shard the cache lacks (or holds in an older or different version), after
    checking that its disk has room for them."""
    todo = [(key, target, info) for key, (target, info) in copies.items() if not _fresh(target, info)]
    need = sum(info.size for _, _, info in todo)
    st.local.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(st.local).free
    if todo and free < need + SPARE_BYTES:
        raise ImgtrainError(f"--source {st.uri}: copying its {len(todo)} shard(s) needs {_size(need + SPARE_BYTES)} "
                            f"free on the disk of {st.local} ({_size(need)} of shards, {_size(SPARE_BYTES)} to spare) "
                            f"and it has {_size(free)}; set {remote.CACHE_VAR} to a folder on a larger disk")
    kept = len(copies) - len(todo)
    err_console.print(  # one line, above prepare's bar
        f"copying {len(todo)} shard(s), {_size(need)}, from {st.uri} into {st.local}"
        + (f" ({kept} already there)" if kept else "") if todo
        else f"the {kept} shard(s) of {st.uri} are already in {st.local}")

    def copy(key: str, target: Path, info) -> int:
        # no more than the disk check counted; a shard replaced since its listing is refused
        remote.copy_down(fs, key, target, st, (info.size, info.mtime.timestamp() if info.mtime else None), _WHAT)
        if info.mtime_ns:  # the object's time: a later upload of the shard is newer, whatever this clock says
            os.utime(target, ns=(time.time_ns(), info.mtime_ns))
        return info.size

    with ThreadPoolExecutor(COPY_STREAMS) as pool, _bytes_bar(need) as advance:
        copying = [pool.submit(copy, *shard) for shard in todo]
        try:
            for done in as_completed(copying):
                advance(done.result())
        finally:  # the first failure (or Ctrl-C) ends the copying: what is not started never starts
            for future in copying:
                future.cancel()


@contextlib.contextmanager
def _bytes_bar(total: int):
    """A transient bar of bytes copied on stderr, under prepare's (none off a terminal)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    bar = Progress(TextColumn("copy shards"), BarColumn(), DownloadColumn(binary_units=True), TransferSpeedColumn(),
                   TimeRemainingColumn(), console=err_console, transient=True, disable=not err_console.is_terminal)
    with bar:
        task = bar.add_task("copy", total=total)
        yield lambda size: bar.advance(task, size)


def _fresh(target: Path, info) -> bool:
    """Whether the cache's copy is the object as listed: same size, not older."""
    try:
        stat = target.stat()
    except OSError:
        return False
    return stat.st_size == info.size and stat.st_mtime_ns >= (info.mtime_ns or 0)


def _size(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"
