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
from pathlib import Path

from common import environment, write_result
from data_pipeline import make_folder, ours

POLICIES = ("none", "randaugment", "trivialaugment", "autoaugment")


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
                    value = ours(data, 64, args.cpus, "ray-data", policy)
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
