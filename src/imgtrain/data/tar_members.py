"""Reading tar shards without extracting them: the headers of their members in order (the data
in between is skipped by seeking, not read), and later one member's bytes by its offset.

A shard is untrusted input. Only regular members are listed (links, devices and sparse members
are not); nothing is ever written to disk or unpickled; a member is read only when asked for,
and at most ``MAX_FILE_BYTES`` of it. A damaged shard (cut short, a corrupt header) yields the
members before the damage and says where it is (``ShardScan.damage``).
"""

from __future__ import annotations

import os
import stat
import tarfile
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from imgtrain.data.images import MAX_FILE_BYTES, ImageRejected

MAX_SMALL_MEMBER = 1 << 20  # a label file (.cls, .txt, .json) read while listing: at most this
_BLOCK = tarfile.BLOCKSIZE
_COMPRESSED = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ": "xz", b"\x28\xb5\x2f\xfd": "zstd"}


class _BoundedHeaders(tarfile.TarInfo):
    """Headers whose extended parts (a pax header, a GNU long name) are read whole by tarfile:
    over MAX_SMALL_MEMBER they are refused unread (a hostile shard could declare gigabytes)."""

    def _proc_pax(self, tar):
        _check_extended(self)
        return super()._proc_pax(tar)

    def _proc_gnulong(self, tar):
        _check_extended(self)
        return super()._proc_gnulong(tar)


def _check_extended(header: tarfile.TarInfo) -> None:
    if header.size > MAX_SMALL_MEMBER:
        raise tarfile.ReadError(f"an extended header of {header.size:,} bytes")


@dataclass(frozen=True)
class Member:
    name: str
    offset: int  # of its data in the shard
    size: int
    data: bytes | None = None  # the bytes of a small member the scan was asked to read


class ShardScan:
    """The regular members of one shard, in order: ``for member in ShardScan(path, wanted)``.
    Members whose name ``wanted`` accepts and that are at most MAX_SMALL_MEMBER bytes come with
    their bytes. Afterwards ``damage`` says why the shard ended early, or is None."""

    def __init__(self, path, wanted: Callable[[str], bool] = lambda name: False):
        self.path, self.wanted = str(path), wanted
        self.damage: str | None = None

    def __iter__(self) -> Iterator[Member]:
        try:
            # O_NONBLOCK and fstat: a FIFO named like a shard is refused, never waited on
            with os.fdopen(os.open(self.path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
                info = os.fstat(f.fileno())
                if not stat.S_ISREG(info.st_mode):
                    self.damage = "not a regular file"
                    return
                yield from self._members(f, info.st_size)
        except OSError as e:
            self.damage = f"cannot be read ({e.strerror or type(e).__name__})"

    def _members(self, f, size: int) -> Iterator[Member]:
        try:
            tar = tarfile.open(fileobj=f, mode="r:", tarinfo=_BoundedHeaders)  # plain: read by offset later
        except tarfile.ReadError as e:
            f.seek(0)
            head = f.read(6)
            packed = next((name for magic, name in _COMPRESSED.items() if head.startswith(magic)), None)
            self.damage = (f"compressed ({packed}): only plain tar shards are read; decompress it" if packed
                           else f"not a tar archive ({e})")
            return
        while True:
            try:
                info = tar.next()
            except tarfile.ReadError as e:
                self.damage = f"damaged after byte {tar.offset:,} ({e})"
                return
            tar.members.clear()  # tarfile keeps every header it reads: a whole shard's worth, unused here
            if info is None:
                self.damage = _end_of(f, tar.offset)
                return
            if info.offset_data + info.size > size:
                self.damage = (f"cut short inside {info.name} (the file ends at byte {size:,}, the member "
                               f"at {info.offset_data + info.size:,})")
                return
            if info.isreg() and info.sparse is None:
                small = self.wanted(info.name) and info.size <= MAX_SMALL_MEMBER
                yield Member(info.name, info.offset_data, info.size, _read_at(f, info.offset_data, info.size)
                             if small else None)


def _read_at(f, offset: int, size: int) -> bytes:
    f.seek(offset)  # tarfile seeks back to where it was before it reads the next header
    return f.read(size)


def _end_of(f, offset: int) -> str | None:
    """Why the member headers stopped at ``offset``: None at the end-of-archive marker (a block
    of zeros), else what is there instead."""
    f.seek(offset)
    block = f.read(_BLOCK)
    if len(block) == _BLOCK and block == bytes(_BLOCK):
        return None
    if len(block) < _BLOCK:
        return f"cut short at byte {offset:,} (no end-of-archive marker)"
    return f"corrupt tar header at byte {offset:,}"


def read_members(paths: list[str], which: np.ndarray, offsets: np.ndarray, sizes: np.ndarray):
    """The bytes of members of shards (``paths[which[k]]`` at ``offsets[k]``, ``sizes[k]``
    bytes), or why there are none: a ``Chunk.read``. Each shard is opened once per chunk."""
    files: dict[int, object] = {}
    try:
        for w, offset, size in zip(which.tolist(), offsets.tolist(), sizes.tolist()):
            if size > MAX_FILE_BYTES:
                yield ImageRejected(f"{size:,} bytes is over the limit of {MAX_FILE_BYTES:,} bytes for an image file")
                continue
            try:
                if w not in files:
                    files[w] = open(paths[w], "rb")
                data = _read_at(files[w], offset, size)
            except OSError as e:
                yield ImageRejected(f"cannot be read ({e.strerror or type(e).__name__})")
                continue
            yield data if len(data) == size else ImageRejected("cut short: the shard is shorter than when listed")
    finally:
        for f in files.values():
            f.close()
