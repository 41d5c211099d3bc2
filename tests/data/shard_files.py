"""WebDataset tar shards written with tarfile for the webdataset source's tests (local and in a
bucket), and what a prepared data set of one-gray-value images holds."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np

from tests.conftest_data_helpers import png_bytes, read_back


def gray_png(value: int) -> bytes:
    return png_bytes(np.full((8, 8), value, np.uint8))


def write_shard(path: Path, samples: list[tuple[str, dict[str, bytes]]]) -> Path:
    """A WebDataset shard: each sample's files ``key.ext`` written one after the other."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for key, files in samples:
            for ext, data in files.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


def all_rows(out: Path) -> dict[str, dict[int, int]]:
    """{split: {pixel value: label}} of a prepared data set (every image is one gray value)."""
    return {split: dict(zip(images[:, 0, 0, 0].tolist(), labels.tolist()))
            for split, (ids, labels, images) in read_back(out).items()}
