"""IDX files (the format of yann.lecun.com's MNIST and torchvision's raw folder), checked and
read without holding them whole: labels at once (a byte per image), images row by row.
Every bad file raises :class:`~imgtrain.errors.ImgtrainError` with a one-line message.
"""

from __future__ import annotations

import gzip
import math
import os
import tempfile
import zlib
from pathlib import Path
from typing import Union

import numpy as np

from imgtrain.errors import ImgtrainError

# IDX magic: two zero bytes, a type code, then the number of dimensions.
_IDX_DTYPES = {
    0x08: np.dtype("u1"), 0x09: np.dtype("i1"), 0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8"),
}


# gzip cannot expand data more than about 1032-fold: a header declaring more than that is a lie
# (a decompression bomb or a corrupt file) and is refused before anything is decompressed.
_GZIP_MAX_RATIO = 1100
_IDX_INTEGER_TYPES = (0x08, 0x09, 0x0B, 0x0C)


def read_idx(path: Union[str, Path], integers: bool = False) -> np.ndarray:
    """One IDX file (optionally gzip-compressed) read into a numpy array of its stored shape, in
    the machine's byte order (labels; images are read row by row: ``IdxFile``, ``DiskRows``).
    ``integers``: refuse float element types (labels must be whole class ids)."""
    with IdxFile(path, integers) as idx:
        return idx.read_all()


class IdxFile:
    """An IDX file checked and opened for reading rows, never held whole in memory. A .gz file
    is first decompressed, a megabyte at a time, into an unnamed temporary file.

    The header is read first and the file must hold exactly the bytes it declares (a gzip
    stream is decompressed only that far), so a small file cannot claim gigabytes.
    """

    def __init__(self, path: Union[str, Path], integers: bool = False):
        self.path = path = Path(path)
        try:
            with (gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")) as f:
                self.dtype, self.shape = _idx_header(f, path, integers)
                size = math.prod(self.shape) * self.dtype.itemsize
                on_disk = path.stat().st_size
                if size > (on_disk * _GZIP_MAX_RATIO if path.suffix == ".gz" else on_disk):
                    raise ImgtrainError(
                        f"{path} declares {list(self.shape)} values ({size:,} bytes), more than the file can "
                        "hold (truncated or corrupt); download it again"
                    )
                if path.suffix == ".gz":
                    self.file, self.offset = _decompressed_copy(f, size), 0
                else:
                    self.offset = f.tell()
                    self.file = open(path, "rb") if on_disk - self.offset == size else None
        except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
            raise ImgtrainError(f"cannot read IDX file {path}: {e}; download it again") from None
        if self.file is None:
            raise ImgtrainError(f"{path} does not hold the {size:,} bytes its header {list(self.shape)} declares "
                                "(truncated or corrupt); download it again")
        self.row_bytes = math.prod(self.shape[1:]) * self.dtype.itemsize

    def __enter__(self) -> "IdxFile":
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()

    def read_all(self) -> np.ndarray:
        data = os.pread(self.file.fileno(), math.prod(self.shape) * self.dtype.itemsize, self.offset)
        return np.frombuffer(data, self.dtype).reshape(self.shape).astype(self.dtype.newbyteorder("="))

    def rows(self, index: np.ndarray) -> np.ndarray:
        """Rows ``index`` [n] -> [n, *row shape], in that order, each read on its own (a random
        order has no runs worth merging; about a microsecond per row)."""
        fd, size, out = self.file.fileno(), self.row_bytes, bytearray(len(index) * self.row_bytes)
        for k, i in enumerate(index):
            out[k * size:(k + 1) * size] = os.pread(fd, size, self.offset + int(i) * size)
        rows = np.frombuffer(out, self.dtype).reshape(len(index), *self.shape[1:])
        return rows.astype(self.dtype.newbyteorder("="))


def _idx_header(f, path: Path, integers: bool) -> tuple[np.dtype, tuple[int, ...]]:
    magic = f.read(4)
    if len(magic) < 4 or magic[0] != 0 or magic[1] != 0 or magic[2] not in _IDX_DTYPES:
        raise ImgtrainError(f"{path} is not an IDX file (bad magic number {magic.hex() or 'none'}); download it again")
    dtype, ndim = _IDX_DTYPES[magic[2]], magic[3]
    if integers and magic[2] not in _IDX_INTEGER_TYPES:
        raise ImgtrainError(f"{path} holds {dtype} values; labels must be integers; download it again")
    head = f.read(4 * ndim)
    if len(head) < 4 * ndim:
        raise ImgtrainError(f"{path} is truncated (header cut short); download it again")
    return dtype, tuple(int(d) for d in np.frombuffer(head, dtype=">u4"))


def _decompressed_copy(f, size: int):
    """The next ``size`` bytes of the stream ``f`` in an unnamed temporary file (deleted when it
    is closed), or None when the stream holds fewer or more bytes."""
    out = tempfile.TemporaryFile(prefix="imgtrain-idx-")
    left = size
    while left:
        block = f.read(min(left, 1 << 20))
        if not block:
            out.close()
            return None
        out.write(block)
        left -= len(block)
    if f.read(1):
        out.close()
        return None
    out.flush()
    return out


class DiskRows:
    """Rows ``index`` of an IDX image file, read only when a slice of them is asked for: an IDX
    source is written out a row group at a time, never held whole. uint8 [N, H, W, 1]."""

    def __init__(self, source: IdxFile, index: np.ndarray):
        self.source, self.index = source, np.asarray(index, dtype=np.int64)
        self.dtype, self.ndim = np.dtype(np.uint8), 4
        self.shape = (len(self.index), *source.shape[1:], 1)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, rows: slice) -> np.ndarray:
        return self.source.rows(self.index[rows])[..., None]

    def take(self, index: np.ndarray) -> "DiskRows":
        return DiskRows(self.source, self.index[index])
