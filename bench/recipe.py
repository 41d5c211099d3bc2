"""The recipe table (issue 36): each part of the recipe against the default, over seeds, on four
data sets, measured on their validation splits (the test splits stay untouched until a default
is chosen).

Data sets (made once under data/recipe-bench/):

* ``digits``: the embedded 5,000 MNIST digits, 10 % of training carved out for validation;
* ``sklearn``: scikit-learn's 1,797 8x8 digits written as a folder of PNGs, then prepared;
* ``photos``: 2,000 generated 64x64 RGB photos of shapes (bench/models.py), from scratch;
* ``finetune``: the same photos, ResNet-18 started from the weights of a run trained on another
  2,000 generated photos (another seed: a "pretrained" weights file, as a user's would be).

Each run is ``imgtrain train --backend local`` (one process: the recipe's effect, not Ray's
overhead) with the variant's options; a variant that does not apply to a data set (photo
augmentation on digits) is skipped. Printed and written to bench/results/recipe-*.json: the
validation accuracy of the model the run hands over (the last epoch's; the average checkpoint's
with --average-last), mean and range over the seeds, its difference from the baseline's
mean, and the wall time as a ratio to the baseline's (this machine's speed drifts: the variants
of one seed run one after the other, interleaved).

    python bench/recipe.py [--sets digits,sklearn,photos,finetune] [--seeds 0,1,2] [--epochs 12]
                           [--variants baseline,mixup,...]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SAMPLE_DATA, ensure_data, environment, write_result  # noqa: E402
from models import make_shapes  # noqa: E402

ROOT = SAMPLE_DATA.parent / "recipe-bench"
PHOTO_ONLY = {"randaugment", "trivialaugment", "autoaugment", "jitter-erasing"}
VARIANTS = {
    "baseline": [],
    "randaugment": ["--augment-policy", "randaugment"],
    "trivialaugment": ["--augment-policy", "trivialaugment"],
    "jitter-erasing": ["--color-jitter", "0.4", "--random-erasing", "0.25"],
    "mixup": ["--mixup", "0.2"],
    "cutmix": ["--cutmix", "1.0"],
    "label-smoothing": ["--label-smoothing", "0.1"],
    "cosine": ["--schedule", "cosine", "--warmup-epochs", "1"],
    "average-last": ["--average-last", "3"],
}


def cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "imgtrain.cli", *args], check=True, capture_output=True)


def digits() -> Path:
    out = ROOT / "digits"
    if not (out / "manifest.json").is_file():
        ensure_data(SAMPLE_DATA)
        cli("data", "prepare", "mnist-sample", str(out), "--val-fraction", "0.1")
    return out


def sklearn_folder() -> Path:
    out = ROOT / "sklearn"
    if not (out / "manifest.json").is_file():
        from PIL import Image
        from sklearn.datasets import load_digits

        d = load_digits()
        src = ROOT / "sklearn-src"
        for i, (pixels, label) in enumerate(zip(d.images, d.target)):
            path = src / str(label) / f"{i:04d}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.round(pixels * 255 / 16).astype(np.uint8)).save(path)
        cli("data", "prepare", "folder", str(out), "--source", str(src), "--val-fraction", "0.1")
    return out


def photos(seed: int = 0) -> Path:
    out = ROOT / f"photos-{seed}"
    if not (out / "manifest.json").is_file():
        src = ROOT / f"photos-{seed}-src"
        shutil.rmtree(src, ignore_errors=True)
        make_shapes(src, 2000, 64, seed)
        cli("data", "prepare", "folder", str(out), "--source", str(src), "--size", "64", "--val-fraction", "0.1")
    return out


def pretrained(epochs: int) -> Path:
    """A ResNet-18 state dict trained on other generated photos: what fine-tuning starts from."""
    weights = ROOT / "pretrained-resnet18.pt"
    if not weights.is_file():
        with tempfile.TemporaryDirectory(prefix="imgtrain-recipe-") as tmp:
            cli("train", "--data", str(photos(seed=99)), "--storage", tmp, "--name", "pre", "--backend", "local",
                "--epochs", str(epochs), "--quiet")
            latest = sorted(Path(tmp, "pre").glob("checkpoint_*"))[-1]
            shutil.copy(latest / "model.pt", weights)
    return weights


def train(data: Path, storage: Path, name: str, seed: int, epochs: int, options: list[str]) -> dict:
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "imgtrain.cli", "train", "--data", str(data), "--storage",
                           str(storage), "--name", name, "--backend", "local", "--epochs", str(epochs), "--seed",
                           str(seed), "--quiet", *options], capture_output=True, text=True)
    if proc.returncode:
        return {"error": (proc.stderr.strip().splitlines() or [str(proc.returncode)])[-1]}
    records = [json.loads(line) for line in (storage / name / "metrics.jsonl").read_text().splitlines()]
    # the model the run hands over: the average checkpoint's with --average-last, else the last epoch's
    final = [r for r in records if r.get("kind") == "average"] or [r for r in records if r.get("kind") == "epoch"]
    return {"val_accuracy": final[-1]["val_accuracy"], "val_f1_macro": final[-1].get("val_f1_macro"),
            "wall_s": time.perf_counter() - started}


def table(results: dict) -> str:
    lines = ["| data set | variant | val accuracy, mean (range) | vs baseline | wall time vs baseline |",
             "|---|---|---:|---:|---:|"]
    for data_set, by_variant in results.items():
        base = by_variant.get("baseline", {})
        base_acc = [r["val_accuracy"] for r in base.values() if "val_accuracy" in r]
        base_wall = [r["wall_s"] for r in base.values() if "wall_s" in r]
        for variant, runs in by_variant.items():
            acc = [r["val_accuracy"] for r in runs.values() if "val_accuracy" in r]
            wall = [r["wall_s"] for r in runs.values() if "wall_s" in r]
            if not acc:
                errors = {r.get("error") for r in runs.values()}
                lines.append(f"| {data_set} | {variant} | failed: {'; '.join(map(str, errors))[:80]} | | |")
                continue
            mean = statistics.mean(acc)
            delta = f"{(mean - statistics.mean(base_acc)) * 100:+.2f} pt" if base_acc and variant != "baseline" else ""
            ratio = f"{statistics.mean(wall) / statistics.mean(base_wall):.2f}x" if base_wall else ""
            lines.append(f"| {data_set} | {variant} | {mean:.2%} ({min(acc):.2%}-{max(acc):.2%}) | {delta} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sets", default="digits,sklearn,photos,finetune")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    sets = args.sets.split(",")
    makers = {"digits": lambda: (digits(), []), "sklearn": lambda: (sklearn_folder(), []),
              "photos": lambda: (photos(), []),
              "finetune": lambda: (photos(), ["--init-from", str(pretrained(args.epochs))])}
    prepared = {s: makers[s]() for s in sets}
    results: dict = {s: {v: {} for v in args.variants.split(",")} for s in sets}
    with tempfile.TemporaryDirectory(prefix="imgtrain-recipe-") as tmp:
        for seed in (int(s) for s in args.seeds.split(",")):
            for data_set, (data, base_options) in prepared.items():
                preset_photos = data_set in ("photos", "finetune")
                for variant in results[data_set]:
                    if variant in PHOTO_ONLY and not preset_photos:
                        continue
                    name = f"{data_set}-{variant}-{seed}"
                    found = train(data, Path(tmp), name, seed, args.epochs, base_options + VARIANTS[variant])
                    results[data_set][variant][seed] = found
                    print(name, found, flush=True)
    results = {s: {v: runs for v, runs in by.items() if runs} for s, by in results.items()}
    path = write_result("recipe", {"environment": environment(), "inputs": vars(args), "results": results})
    print(table(results))
    print(path)


if __name__ == "__main__":
    main()
