"""The teacher's logits table of ``--distill-mode cached`` (``teacher_cache.py`` computes it): two
plain ``.npy`` files, the training rows' ids sorted (int64 [N]) and row i the logits of the i-th
id (float32 [N, K]), about 5 GB for ImageNet-1k. No process holds it: ``write`` puts each batch into
its rows as it comes, ``Table.rows_of`` reads a step's rows by id (a binary search of the
memory-mapped ids, then the rows read from the file), so a lookup costs a batch's memory whatever N,
and the same ids give the same rows at any world size, rank or resume. Nothing in them is
unpickled: the headers are parsed as ``np.load`` parses them, ``allow_pickle=False``.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from imgtrain.errors import ImgtrainError

ROWS_AT_ONCE = 4096  # rows read or written per system call at most: a batch's runs of neighbouring rows


@dataclass(frozen=True)
class Ref:
    """Where a table is and its shape: what the train loop's config carries to every worker."""

    ids: str
    logits: str
    rows: int
    classes: int
    uri: str | None = None  # a data set in an object store: the folder beside it the table was uploaded to

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def on_this_node(self) -> Ref:
        """A published table's copy in this node's cache (``fetch`` makes it); else the table itself."""
        if not self.uri:
            return self
        from imgtrain.ops import remote

        folder = remote.cache_root() / "teacher-logits"
        return dataclasses.replace(self, ids=str(folder / Path(self.ids).name), logits=str(folder / Path(self.logits).name))


def _header(f, path: str) -> tuple[tuple, np.dtype, int]:
    """(shape, dtype, offset of the first byte of data) of an open ``.npy`` file: its header
    parsed as ``np.load`` parses it, nothing evaluated, no pickle allowed."""
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
    elif version == (2, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
    else:
        raise ValueError(f"{path}: .npy version {version}")
    if fortran or dtype.hasobject:
        raise ValueError(f"{path}: not a plain C-ordered array")
    return shape, dtype, f.tell()


class Table:
    """A table opened for lookups: the ids memory-mapped (a binary search touches a few of their
    pages), the logits read row by row from the file, so a process holds only its batches' rows."""

    def __init__(self, ref: Ref):
        self.ref = ref
        self.ids = np.load(ref.ids, mmap_mode="r", allow_pickle=False)
        if self.ids.shape != (ref.rows,) or self.ids.dtype != np.int64:
            raise ValueError(f"{ref.ids}: {self.ids.dtype} {self.ids.shape}, not int64 ({ref.rows},)")
        self.fd = os.open(ref.logits, os.O_RDONLY)
        self.close = weakref.finalize(self, os.close, self.fd)  # closed with the table, or at once by close()
        try:
            with open(self.fd, "rb", closefd=False) as f:  # the file opened, whatever is renamed onto its name since
                shape, dtype, self.offset = _header(f, ref.logits)
            self.row_bytes = 4 * ref.classes
            size = os.fstat(self.fd).st_size
            if shape != (ref.rows, ref.classes) or dtype != np.float32 or size != self.offset + ref.rows * self.row_bytes:
                raise ValueError(f"{ref.logits}: {dtype} {shape} in {size} bytes, not float32 ({ref.rows}, {ref.classes})")
        except BaseException:
            self.close()
            raise

    def positions(self, ids: np.ndarray) -> np.ndarray:
        """The rows of ``ids`` in the table; a ValueError for an id it does not have."""
        at = _found(self.ids, ids)
        if at is None:
            raise ValueError(f"{self.ref.ids}: no row for one of the ids {np.asarray(ids)[:8].tolist()}...")
        return at

    def rows_of(self, ids: np.ndarray) -> np.ndarray:
        """float32 logits [B, K] of the rows with these ids, in their order."""
        at = self.positions(ids)
        out = np.empty((len(at), self.ref.classes), np.float32)
        for first, count, where in _runs(at):
            data = os.pread(self.fd, count * self.row_bytes, self.offset + first * self.row_bytes)
            if len(data) != count * self.row_bytes:
                raise ValueError(f"{self.ref.logits}: cut short")
            out[where] = np.frombuffer(data, np.float32).reshape(count, -1)[at[where] - first]
        return out


def _found(ids: np.ndarray, wanted: np.ndarray) -> np.ndarray | None:
    """The positions of ``wanted`` in the sorted ``ids`` (a binary search, touching a few of their
    pages when they are memory-mapped); None if one is not there."""
    wanted = np.asarray(wanted, np.int64)
    at = np.searchsorted(ids, wanted).clip(max=max(len(ids) - 1, 0))
    return at if len(ids) and np.array_equal(np.asarray(ids[at]), wanted) else None


def _runs(at: np.ndarray):
    """(first row, row count, indices of ``at`` in that span) for the spans of neighbouring rows
    that ``at`` touches: one system call per span, not per row."""
    order = np.argsort(at, kind="stable")
    ranked = at[order]
    breaks = np.flatnonzero((np.diff(ranked) > 1) | (np.arange(1, len(ranked)) % ROWS_AT_ONCE == 0)) + 1
    for part in np.split(np.arange(len(ranked)), breaks):
        if len(part):
            first = int(ranked[part[0]])
            yield first, int(ranked[part[-1]]) - first + 1, order[part]


def read(ref: Ref) -> Table | None:
    """The table found whole and of this data set's shape; None otherwise (absent, cut short,
    of another shape: computed again)."""
    try:
        return Table(ref)
    except (OSError, ValueError, EOFError):
        return None


def write(ref: Ref, ids: np.ndarray, batches: Iterable[tuple[np.ndarray, np.ndarray]]) -> None:
    """The table of ``ids`` (sorted) from ``batches`` of (ids, logits [B, K]) in any order, each
    written into its rows as it comes: the memory of one batch (and a flag per row), whatever N."""
    folder = Path(ref.logits).parent
    folder.mkdir(parents=True, exist_ok=True)
    temporaries = []

    def temporary(path: str) -> str:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{Path(path).name}.", suffix=".tmp")
        os.close(fd)
        temporaries.append(tmp)
        return tmp

    try:
        ids_tmp, logits_tmp = temporary(ref.ids), temporary(ref.logits)
        with open(ids_tmp, "wb") as f:
            np.save(f, ids, allow_pickle=False)
            os.fsync(f.fileno())
        with open(logits_tmp, "r+b") as f:
            np.lib.format.write_array_header_2_0(f, {"descr": np.lib.format.dtype_to_descr(np.dtype(np.float32)),
                                                     "fortran_order": False, "shape": (ref.rows, ref.classes)})
            offset, row_bytes = f.tell(), 4 * ref.classes
            f.truncate(offset + ref.rows * row_bytes)  # sparse until written
            written = np.zeros(ref.rows, bool)
            for batch_ids, logits in batches:
                at = _found(ids, batch_ids)
                if at is None:
                    raise ImgtrainError("--teacher: the teacher's pass returned a row the training split does not have")
                if written[at].any() or len(np.unique(at)) != len(at):
                    raise ImgtrainError("--teacher: the teacher's pass returned a training row twice")
                logits = np.ascontiguousarray(logits, np.float32).reshape(len(at), ref.classes)
                for first, count, where in _runs(at):
                    rows = np.empty((count, ref.classes), np.float32)
                    rows[at[where] - first] = logits[where]
                    os.pwrite(f.fileno(), rows.tobytes(), offset + first * row_bytes)
                written[at] = True
            if not written.all():
                raise ImgtrainError(f"--teacher: {int(written.sum())} of the training split's {ref.rows} images "
                                    "could be read for it")
            os.fsync(f.fileno())
        os.replace(logits_tmp, ref.logits)  # complete or absent: a run at the same time renames its own copy
        os.replace(ids_tmp, ref.ids)  # last: a table is there once its ids are (and any run's ids are these)
    finally:
        for tmp in temporaries:
            Path(tmp).unlink(missing_ok=True)


# ---------------------------------------------------------------- a data set in an object store


def publish(ref: Ref, folder_uri: str) -> Ref:
    """The table uploaded to ``folder_uri`` (beside a data set in an object store) unless it is
    there at its size, the ids last; the Ref every node fetches it from. The store refusing (a
    read-only bucket) raises ImgtrainError."""
    import pyarrow.fs as pafs

    from imgtrain.ops import remote

    fs, root = remote.split(folder_uri)
    st = remote.Store(uri=folder_uri, root=root, local=Path(ref.logits).parent)
    try:
        for path in (ref.logits, ref.ids):
            target = f"{root}/{Path(path).name}"
            info = fs.get_file_info(target)
            if info.type == pafs.FileType.File and info.size == os.path.getsize(path):
                continue  # the same key: the same data set and teacher, uploaded by an earlier run
            with open(path, "rb") as src:
                remote.copy_up(src, fs, target)
    except OSError as e:
        raise remote.where(e, st, "--data") from None
    return dataclasses.replace(ref, uri=folder_uri)


def fetch(ref: Ref) -> Table:
    """A published table opened on this node: its copy in this node's cache, fetched once (the
    node's processes take turns on a lock; a whole copy found is kept), as a data set's shards are."""
    import fcntl

    import pyarrow.fs as pafs

    from imgtrain.ops import remote

    here = ref.on_this_node()
    folder = Path(here.logits).parent
    folder.mkdir(parents=True, exist_ok=True)
    fs, root = remote.split(ref.uri)
    st = remote.Store(uri=ref.uri, root=root, local=folder)
    with open(folder / f".{Path(here.logits).name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = read(here)
        if found is not None:
            return found
        for path in (here.logits, here.ids):
            name = remote.check_key(Path(path).name)
            try:
                info = fs.get_file_info(f"{root}/{name}")
            except OSError as e:
                raise remote.where(e, st, "--data") from None
            if info.type != pafs.FileType.File:
                raise ImgtrainError(f"{ref.uri}/{name} is missing: the teacher's logits were deleted from the bucket "
                                    "since this run began; run it again")
            remote.copy_down(fs, f"{root}/{name}", Path(path), st, (info.size, info.mtime.timestamp() if info.mtime
                                                                    else None), what="--data")
    found = read(here)
    if found is None:
        raise ImgtrainError(f"{ref.uri}: the teacher's logits there are not whole; delete that folder and run again")
    return found
