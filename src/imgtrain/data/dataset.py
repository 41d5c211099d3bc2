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
    is_multi_label,
    load_manifest,
    multi_hot,
    read_split_file,
    split_files,
)


def ray_dataset(data_dir: str | Path, split: str):
    """A Ray Dataset of rows {id: int64, image: uint8 tensor [H, W, C], label: int64} (a
    multi-label data set's label: uint8 multi-hot tensor [num_classes])."""
    import ray.data

    data_dir = Path(data_dir)
    manifest = load_manifest(data_dir)
    multi = is_multi_label(manifest)
    files = split_files(data_dir, manifest, split)
    import pyarrow as pa
    import ray.data.extensions  # noqa: F401  registers the tensor column type with pyarrow

    # One block, its metadata computed here: from_arrow would run one remote task per block
    # (a new worker process each on a cold cluster).
    table = pa.concat_tables(read_split_file(f, multi_label=multi) for f in files)
    if multi:
        from ray.data.extensions.tensor_extension import ArrowTensorArray

        hot = multi_hot(table.column("labels"), manifest["num_classes"])
        table = table.drop_columns(["labels"]).append_column("label", ArrowTensorArray.from_numpy(hot))
    return ray.data.from_blocks([table.combine_chunks()])
