"""The demo recipe over seeds: final test accuracy, mean and range (issue 18).

Runs what `make demo` runs (`imgtrain train --data data/mnist-sample --workers 2`, the default
recipe, each run starting its own Ray) once per seed, and reports the final epoch's accuracy on
the split training validates on (the validation split `data prepare` carves by default; the test
split in a data set without one), the best epoch's, images/s and the wall time; with a validation
split, also the test accuracy of the best checkpoint (`imgtrain evaluate`, ``test_best``): the
test figure of what training selected. The embedded test split has 1,000 images: one standard error is
about 0.4 points per seed, so only the mean over seeds says much. ``--extra`` passes more train
options (a candidate recipe) to every run.

    python bench/seeds.py [--seeds 0,1,2] [--extra "--epochs 12"]

``--data sklearn-digits``: scikit-learn's 1,797 8x8 digits (UCI's, another origin and size than
MNIST), prepared from a table of pixel arrays as a user's would be (1,438 train / 359 test).
``--data sklearn-digits-160``: a small data set as a user's first photos are: 16 of those digits
a class to train on (160), 40 a class to test on (400), 32x32 PNG files in class folders
(``train/`` and ``test/``), no validation split; the default batch against ``--extra "--batch-size
128"`` measures the batch a small data set gets (docs/training.md).
``--data lfw-faces``: scikit-image's ``lfw_subset`` (100 25x25 faces and 100 other crops of
photos, real images nobody here made) as a class folder, prepared with the defaults (a validation
split carved from training).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SAMPLE_DATA, ensure_data, environment, write_result  # noqa: E402


def run(seed: int, data: Path, storage: Path, extra: list[str]) -> dict:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "imgtrain.cli", "train", "--data", str(data), "--storage",
                    str(storage), "--name", f"seed{seed}", "--workers", "2", "--seed", str(seed), "--quiet", *extra],
                   check=True, capture_output=True)
    wall = time.perf_counter() - started
    records = [json.loads(line) for line in (storage / f"seed{seed}" / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in records if r.get("kind") == "epoch"]
    found = {"final": epochs[-1]["val_accuracy"], "best": max(e["val_accuracy"] for e in epochs),
             "images_per_s": statistics.median(e["images_per_s"] for e in epochs), "wall_s": wall}
    if epochs[-1].get("val_split") == "val":  # the test split, first seen now, by the checkpoint training chose
        done = subprocess.run([sys.executable, "-m", "imgtrain.cli", "evaluate", f"seed{seed}", "--storage",
                               str(storage), "--backend", "local", "--json"], check=True, capture_output=True, text=True)
        found["test_best"] = json.loads(done.stdout)["accuracy"]
    return found


def sklearn_digits(out: Path) -> Path:
    """scikit-learn's 8x8 digits as a prepared data set (``data prepare parquet``), made once."""
    if not (out / "manifest.json").is_file():
        import numpy as np
        import pandas as pd
        from sklearn.datasets import load_digits

        digits = load_digits()
        table = out.parent / "sklearn-digits.parquet"
        pixels = np.round(digits.images * 255 / 16).astype(np.uint8)  # [1797, 8, 8], 0-16 -> 0-255
        pd.DataFrame({"image": [p.tolist() for p in pixels], "label": digits.target}).to_parquet(table)
        subprocess.run([sys.executable, "-m", "imgtrain.cli", "data", "prepare", "parquet", str(out), "--source",
                        str(table), "--val-fraction", "0"],  # as BENCHMARKS.md measured it: no validation split
                       check=True, capture_output=True)
    return out


def sklearn_digits_160(out: Path) -> Path:
    """160 training and 400 test digits of scikit-learn's as PNG class folders, prepared once."""
    if not (out / "manifest.json").is_file():
        import numpy as np
        from PIL import Image
        from sklearn.datasets import load_digits

        digits = load_digits()
        folders = out.parent / (out.name + "-png")
        for label in range(10):
            rows = np.flatnonzero(digits.target == label)
            for split, chosen in (("train", rows[:16]), ("test", rows[16:56])):
                (folders / split / str(label)).mkdir(parents=True, exist_ok=True)
                for i in chosen:
                    pixels = np.round(digits.images[i] * 255 / 16).astype(np.uint8)
                    Image.fromarray(pixels).resize((32, 32), Image.BILINEAR).save(folders / split / str(label) / f"{i}.png")
        subprocess.run([sys.executable, "-m", "imgtrain.cli", "data", "prepare", "folder", str(out), "--source",
                        str(folders), "--val-fraction", "0"], check=True, capture_output=True)
    return out


def lfw_faces(out: Path) -> Path:
    """scikit-image's 200 face / non-face crops as a class folder (``faces/``, ``other/``), prepared once."""
    if not (out / "manifest.json").is_file():
        import numpy as np
        from PIL import Image
        from skimage.data import lfw_subset  # pip install scikit-image

        crops = lfw_subset()  # the first 100 are faces
        folders = out.parent / (out.name + "-png")
        for i, crop in enumerate(crops):
            folder = folders / ("faces" if i < 100 else "other")
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.round(crop * 255).astype(np.uint8)).save(folder / f"{i:03d}.png")
        subprocess.run([sys.executable, "-m", "imgtrain.cli", "data", "prepare", "folder", str(out), "--source",
                        str(folders)], check=True, capture_output=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--extra", default="", help="more train options for every run")
    parser.add_argument("--data", type=Path, default=SAMPLE_DATA, help="another prepared data set: with a "
                        "validation split (--val-fraction), the accuracies are on it, for choosing a recipe "
                        "without looking at the test split; sklearn-digits: scikit-learn's 8x8 digits; "
                        "sklearn-digits-160: 160 of them to train on, as 32x32 PNG files; lfw-faces: "
                        "scikit-image's 200 face / non-face crops")
    args = parser.parse_args()
    if str(args.data) == "sklearn-digits":
        args.data = sklearn_digits(SAMPLE_DATA.parent / "sklearn-digits")
    elif str(args.data) == "lfw-faces":
        args.data = lfw_faces(SAMPLE_DATA.parent / "lfw-faces")
    elif str(args.data) == "sklearn-digits-160":
        args.data = sklearn_digits_160(SAMPLE_DATA.parent / "sklearn-digits-160")
    elif args.data == SAMPLE_DATA:
        ensure_data(SAMPLE_DATA)
    extra = shlex.split(args.extra)
    found = {}
    with tempfile.TemporaryDirectory(prefix="imgtrain-seeds-") as tmp:
        for seed in (int(s) for s in args.seeds.split(",")):
            found[seed] = run(seed, args.data, Path(tmp), extra)
            print(seed, {k: round(v, 4) for k, v in found[seed].items()}, flush=True)
    finals = [f["final"] for f in found.values()]
    summary = {"mean_final": statistics.mean(finals), "min_final": min(finals), "max_final": max(finals),
               "mean_wall_s": statistics.mean(f["wall_s"] for f in found.values())}
    tests = [f["test_best"] for f in found.values() if "test_best" in f]
    if tests:
        summary.update(mean_test_best=statistics.mean(tests), min_test_best=min(tests), max_test_best=max(tests))
    path = write_result("seeds", {"environment": environment(), "inputs": {**vars(args), "data": str(args.data)}, "runs": found, **summary})
    print(f"final accuracy: mean {summary['mean_final']:.2%}, range {summary['min_final']:.2%}-"
          f"{summary['max_final']:.2%}; {summary['mean_wall_s']:.0f} s per run; {path}")
    if tests:
        print(f"test accuracy of the best checkpoints: mean {statistics.mean(tests):.2%}, range {min(tests):.2%}-"
              f"{max(tests):.2%}")


if __name__ == "__main__":
    main()
