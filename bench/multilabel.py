"""Multi-label classification over seeds (issue 48): mAP, F1 and time of the default recipe.

The data: 2x2 grids of scikit-learn's handwritten digits (1,797 8x8 scans), 32x32 px, each
grid's labels the distinct digits it shows (a cell left blank 1 time in 8, a grid blank 1 in
50). Unlike the test suite's grids (``tests/multilabel_digits.py``), each split draws its cells
from its own digits (70 / 15 / 15 % of the scans, seeded), so a test grid never shows a scan
training saw. Written as PNG files and a CSV with a split column, prepared as a user's would be
(``data prepare list ... --multi-label --split-column split``), once.

Each seed trains what a user gets by default (`imgtrain train --data ... --workers 2 --seed S`,
its own Ray; binary cross-entropy, thresholds chosen on the val split) and is evaluated on the
test split (`imgtrain evaluate --json`: mAP, micro/macro F1 at the stored thresholds, exact
match, Hamming loss).

    python bench/multilabel.py [--seeds 0,1,2] [--grids 2000] [--extra "--epochs 20"]
"""

from __future__ import annotations

import argparse
import csv
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SAMPLE_DATA, environment, write_result  # noqa: E402

SPLITS = (("train", 0.7), ("val", 0.15), ("test", 0.15))
FIGURES = ("map", "f1_micro", "f1_macro", "exact_match", "hamming_loss")


def write_grids(folder: Path, count: int, seed: int = 0) -> Path:
    """``count`` grids as PNG files and ``labels.csv`` (path, labels, split); the CSV's path."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    pictures = np.round(digits.images * 255 / 16).astype(np.uint8)
    rng = np.random.default_rng(seed)
    scans = rng.permutation(len(pictures))
    cuts = np.cumsum([0] + [int(round(len(scans) * share)) for _, share in SPLITS])
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for (split, share), lo, hi in zip(SPLITS, cuts[:-1], cuts[1:]):
        pool = scans[lo:hi]
        for i in range(int(round(count * share))):
            grid, shown = np.zeros((16, 16), np.uint8), set()
            blank = rng.random() < 0.02
            for cell in range(4):
                if blank or rng.random() < 0.125:
                    continue
                k = int(pool[rng.integers(len(pool))])
                r, c = divmod(cell, 2)
                grid[r * 8:(r + 1) * 8, c * 8:(c + 1) * 8] = pictures[k]
                shown.add(int(digits.target[k]))
            name = f"images/{split}-{i:05d}.png"
            Image.fromarray(grid).resize((32, 32), Image.BILINEAR).save(folder / name)
            rows.append((name, " ".join(str(d) for d in sorted(shown)), split))
    path = folder / "labels.csv"
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([("path", "labels", "split"), *rows])
    return path


def prepared(count: int) -> Path:
    out = SAMPLE_DATA.parent / f"digit-grids-{count}"
    if not (out / "manifest.json").is_file():
        table = write_grids(out.parent / f"digit-grids-{count}-png", count)
        subprocess.run([sys.executable, "-m", "imgtrain.cli", "data", "prepare", "list", str(out), "--source",
                        str(table), "--label-column", "labels", "--multi-label", "--split-column", "split"],
                       check=True, capture_output=True)
    return out


def run(seed: int, data: Path, storage: Path, extra: list[str]) -> dict:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "imgtrain.cli", "train", "--data", str(data), "--storage", str(storage),
                    "--name", f"seed{seed}", "--workers", "2", "--seed", str(seed), "--quiet", *extra],
                   check=True, capture_output=True)
    wall = time.perf_counter() - started
    done = subprocess.run([sys.executable, "-m", "imgtrain.cli", "evaluate", f"seed{seed}", "--storage", str(storage),
                           "--json"], check=True, capture_output=True, text=True)
    figures = json.loads(done.stdout)
    return {**{k: figures[k] for k in FIGURES}, "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--grids", type=int, default=2000, help="images in all, 70/15/15 %% train/val/test")
    parser.add_argument("--extra", default="", help="more train options for every run")
    args = parser.parse_args()
    data = prepared(args.grids)
    found = {}
    with tempfile.TemporaryDirectory(prefix="imgtrain-multilabel-") as tmp:
        for seed in (int(s) for s in args.seeds.split(",")):
            found[seed] = run(seed, data, Path(tmp), shlex.split(args.extra))
            print(seed, {k: round(v, 4) for k, v in found[seed].items()}, flush=True)
    summary = {k: {"mean": statistics.mean(f[k] for f in found.values()), "min": min(f[k] for f in found.values()),
                   "max": max(f[k] for f in found.values())} for k in (*FIGURES, "wall_s")}
    for k, s in summary.items():
        print(f"{k:13s} mean {s['mean']:.4f}  range {s['min']:.4f}-{s['max']:.4f}")
    write_result("multilabel", {"grids": args.grids, "extra": args.extra, "runs": found, "summary": summary,
                                "environment": environment()})


if __name__ == "__main__":
    main()
