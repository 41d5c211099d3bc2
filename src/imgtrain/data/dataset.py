"""A small prepared data set (tensor storage, held in memory) -> ray.data.Dataset.

Ray Data 2.60's Parquet reader starts list and read tasks plus a pool of footer-reader actors
for every read; on a 2-core machine each new worker process costs seconds. A small data set
(the 5,000-digit sample is 4 MB) is therefore read once here with pyarrow and handed to Ray
as in-memory Arrow blocks: no read tasks at all, and every epoch reuses the same blocks.
Larger ones are streamed by each worker's own pipeline (``stream.py``).
"""

from __future__ import annotations

from pathlib import Path

from imgtrain.data.format import (
    load_manifest,
    read_split_file,
    split_files,
)


def ray_dataset(data_dir: str | Path, split: str):
    """A Ray Dataset of rows {id: int64, image: uint8 tensor [H, W, C], label: int64}."""
    import ray.data

    data_dir = Path(data_dir)
    files = split_files(data_dir, load_manifest(data_dir), split)
    import pyarrow as pa
    import ray.data.extensions  # noqa: F401  registers the tensor column type with pyarrow

    # One block, its metadata computed here: from_arrow would run one remote task per block
    # (a new worker process each on a cold cluster).
    table = pa.concat_tables(read_split_file(f) for f in files)
    return ray.data.from_blocks([table.combine_chunks()])
