"""Images/s one decoding CPU delivers through the streamed path with each photo augmentation
policy (issue 36: the CPUs a GPU needs = the GPU's images/s / this). One rank, ``--cpus``
decoding tasks at once, generated 96x96 JPEGs, policies interleaved, the median of
``--repeats`` after one cold round.

    python bench/decode_policies.py [--images 12000] [--cpus 1] [--repeats 2]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import environment, write_result
from data_pipeline import make_folder

POLICIES = ("none", "randaugment", "trivialaugment", "autoaugment")


def rate(data: Path, policy: str, cpus: int, batch: int = 64) -> float:
    from imgtrain.data import format as fmt
    from imgtrain.data import stream
    from imgtrain.data.photo_augment import PhotoAugment
    from imgtrain.training.ingest import _batches

    manifest = fmt.load_manifest(data)
    steps = manifest["splits"]["train"]["num_samples"] // batch
    reader = stream.Reader.for_data(data, manifest, seed=0, epoch=0, global_batch=batch, positions_end=steps * batch,
                                    photo_augment=PhotoAugment(policy=policy))
    windows = stream.epoch_windows(stream.blocks(data, manifest, "train"), 0, 0, stream.window_blocks(manifest))
    start, seen = time.perf_counter(), 0
    for b in _batches(stream.train_tasks(windows, reader), reader, batch, "cpu", "ray-data", cpus, windows):
        seen += len(b["id"])
    return seen / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=12000)
    parser.add_argument("--cpus", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    import ray

    with tempfile.TemporaryDirectory(prefix="imgtrain-bench-") as tmp:
        src, data = Path(tmp) / "jpeg", Path(tmp) / "data"
        make_folder(src, args.images, 96)
        subprocess.run([sys.executable, "-m", "imgtrain.cli", "data", "prepare", "folder", str(data), "--source",
                        str(src)], check=True, capture_output=True)
        ray.init(address="local", num_cpus=args.cpus + 1, include_dashboard=False, log_to_driver=False)
        try:
            rates = {p: [] for p in POLICIES}
            for k in range(args.repeats + 1):  # the first round starts Ray's processes: not counted
                for policy in POLICIES:
                    value = rate(data, policy, args.cpus)
                    if k:
                        rates[policy].append(value)
        finally:
            ray.shutdown()
    for policy, values in rates.items():
        print(f"{policy:>15}: {statistics.median(values):6.0f} images/s on {args.cpus} decoding CPU(s) "
              f"({min(values):.0f}-{max(values):.0f})")
    print(f"results: {write_result('decode-policies', {'environment': environment(), 'inputs': vars(args), 'images_per_s': rates})}")


if __name__ == "__main__":
    main()
