"""Where each image of a prepared data set came from: ``sources.parquet`` beside the manifest,
one row per stored image (``id`` int64, ``name`` string: the image's path relative to
``--source``, "file.parquet row 17", a shard's member), written by ``data prepare`` chunk by chunk
for the sources of PNG/JPEG images. ``data inspect`` names the images it shows by it (a duplicate
is "cat/IMG_0042.jpg", not "id 4711"); a data set without it (MNIST, pixel tables, one prepared
before it existed, one staged from a bucket) names them by id.

The file is read as untrusted input, like the rest of a data set: its exact schema, a bounded
batch at a time, only the ids asked for kept, each name cut to MAX_NAME_CHARS.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from imgtrain.data.format import SOURCES_FILE

SCHEMA = pa.schema([("id", pa.int64()), ("name", pa.string())])
BUFFER_ROWS = 16_384  # rows per row group written: names of a hundred bytes or so, a few MB
BUFFER_BYTES = 4 << 20
READ_BATCH_ROWS = 8_192
MAX_NAME_CHARS = 1_000  # a name shown; a longer one is cut


class NamesWriter:
    """``sources.parquet``, written a row group at a time as prepare's chunks come."""

    def __init__(self, path: Path):
        self.path, self.writer = path, None
        self.ids: list[np.ndarray] = []
        self.names: list[str] = []
        self.rows = self.pending_bytes = 0

    def add(self, ids: np.ndarray, names: list[str]) -> None:
        self.ids.append(np.asarray(ids, np.int64))
        self.names += names
        self.pending_bytes += sum(len(n) for n in names)
        if len(self.names) >= BUFFER_ROWS or self.pending_bytes >= BUFFER_BYTES:
            self._flush()

    def close(self) -> int:
        """Write what is left; the number of rows written."""
        if self.names or self.writer is None:
            self._flush()
        self.writer.close()
        return self.rows

    def _flush(self) -> None:
        if self.writer is None:
            self.writer = pq.ParquetWriter(self.path, SCHEMA)
        ids = np.concatenate(self.ids) if self.ids else np.zeros(0, np.int64)
        self.writer.write_table(pa.table({"id": ids, "name": pa.array(self.names, pa.string())}, schema=SCHEMA))
        self.rows += len(ids)
        self.ids, self.names, self.pending_bytes = [], [], 0


def lookup(data_dir: Path, manifest: dict, ids) -> dict[int, str]:
    """{id: name} for the ``ids`` the data set's ``sources.parquet`` names; {} without one, or
    for one that is not as prepare writes it."""
    wanted = np.unique(np.asarray(list(ids), np.int64))
    path = Path(data_dir) / SOURCES_FILE
    if not manifest.get("source_names") or not len(wanted) or not path.is_file():
        return {}
    found: dict[int, str] = {}
    try:
        table = pq.ParquetFile(path)
        if not table.schema_arrow.equals(SCHEMA):
            return {}
        for batch in table.iter_batches(batch_size=READ_BATCH_ROWS, columns=["id", "name"]):
            ids_here = batch.column(0).to_numpy(zero_copy_only=False)
            hits = np.flatnonzero(np.isin(ids_here, wanted))
            names = batch.column(1).take(pa.array(hits)).to_pylist()
            found.update((int(ids_here[k]), str(name)[:MAX_NAME_CHARS]) for k, name in zip(hits, names) if name)
    except (OSError, pa.ArrowException):  # damaged: the images keep their ids
        return {}
    return found


def display_name(names: dict[int, str], row_id: int) -> str:
    """How a page names an image: where it came from, else its id."""
    return names.get(int(row_id)) or f"id {int(row_id)}"
