"""Ray Data ingest alone: the training split through ``iter_torch_batches``, no model.

Two sources, each read ``--passes`` times at the per-worker batch size:
  * ``blocks``: ``imgtrain.data.dataset.ray_dataset`` (what a small data set such as the
    embedded sample uses: in-memory Arrow blocks);
  * ``parquet``: ``ray.data.read_parquet`` of the same files (what larger data sets stream from).
Prints one JSON line per source: images/s after the first batch, and seconds to the first batch.
Usage: ``python bench/ingest_only.py --data D --address auto``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import ray
import ray.data

from imgtrain.data.dataset import ray_dataset
from imgtrain.data.format import load_manifest
from imgtrain.training.ingest import BATCH_DTYPES


def rate(dataset, passes: int, batch_size: int) -> dict:
    start = time.perf_counter()
    first, images = None, 0
    for _ in range(passes):
        for batch in dataset.iter_torch_batches(batch_size=batch_size, dtypes=BATCH_DTYPES):
            if first is None:
                first = time.perf_counter()
            else:
                images += len(batch["label"])
    end = time.perf_counter()
    return {"images_per_s": images / (end - first), "first_batch_s": first - start, "images": images}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--address", default="auto")
    parser.add_argument("--passes", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=128)
    opts = parser.parse_args()
    ray.init(address=opts.address, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    files = [str(Path(opts.data) / f) for f in load_manifest(opts.data)["splits"]["train"]["files"]]
    sources = {"blocks": ray_dataset(opts.data, "train"), "parquet": ray.data.read_parquet(files)}
    for name, dataset in sources.items():
        print(json.dumps({"source": name, **rate(dataset, opts.passes, opts.batch_size)}), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
