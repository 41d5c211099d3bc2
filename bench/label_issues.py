"""Labels worth a second look, measured where it is hard (issue 37): the model is trained on the
planted mislabels themselves, as a user's would be.

The embedded digits with K training labels changed to another class (seeded), the default
recipe trained on them (``--backend local``, ``--epochs``), then ``find_label_issues`` over the
training split: how many of the K planted images are among the top 2K listed. Over ``--seeds``
(the planting and the training seed alike).

    .venv/bin/python bench/label_issues.py [--planted 40] [--epochs 12] [--seeds 0,1,2]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SAMPLE_DATA, ensure_data, environment, write_result  # noqa: E402


def planted_copy(out: Path, planted: int, seed: int) -> set[int]:
    """The sample with ``planted`` training labels moved to another class; their ids."""
    from imgtrain.data.format import read_split
    from imgtrain.data.raw import RawDataset, Split
    from imgtrain.data.writer import write_dataset

    ids, images, labels = read_split(SAMPLE_DATA, "train")
    test_ids, test_images, test_labels = read_split(SAMPLE_DATA, "test")
    test = Split(test_images, test_labels, test_ids)
    rng = np.random.default_rng(seed)
    chosen = rng.choice(len(labels), planted, replace=False)
    labels = labels.copy()
    labels[chosen] = (labels[chosen] + rng.integers(1, 10, planted)) % 10
    classes = [str(d) for d in range(10)]
    write_dataset(RawDataset(classes, Split(images, labels, ids), test), out, name="planted", source="mnist-sample")
    return set(ids[chosen].tolist())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--planted", type=int, default=40)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--seeds", default="0,1,2")
    args = parser.parse_args()
    ensure_data(SAMPLE_DATA)
    from imgtrain.inference.label_issues import find_label_issues
    from imgtrain.inference.predictor import load_checkpoint

    found_by_seed = {}
    with tempfile.TemporaryDirectory(prefix="imgtrain-label-issues-") as tmp:
        for seed in (int(s) for s in args.seeds.split(",")):
            data = Path(tmp, f"data-{seed}")
            planted = planted_copy(data, args.planted, seed)
            subprocess.run([sys.executable, "-m", "imgtrain.cli", "train", "--data", str(data), "--storage", tmp,
                            "--name", f"run-{seed}", "--backend", "local", "--epochs", str(args.epochs), "--seed",
                            str(seed), "--quiet"], check=True, stdout=subprocess.DEVNULL)
            found = find_label_issues(load_checkpoint(Path(tmp, f"run-{seed}")), data, top=2 * args.planted)
            listed = [x["id"] for x in found["issues"]]
            found_by_seed[seed] = {"in_top_2k": len(planted & set(listed)),
                                   "in_top_k": len(planted & set(listed[:args.planted])),
                                   "listed": len(listed)}
            print(seed, found_by_seed[seed], flush=True)
    hits = [f["in_top_2k"] for f in found_by_seed.values()]
    result = {"environment": environment(), "inputs": vars(args), "by_seed": found_by_seed}
    print(f"results: {write_result('label_issues', result)}")
    print(f"planted {args.planted}: in the top {2 * args.planted}: mean {statistics.mean(hits):.1f} "
          f"(range {min(hits)}-{max(hits)}) over seeds {args.seeds}")


if __name__ == "__main__":
    main()
