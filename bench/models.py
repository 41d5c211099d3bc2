"""Each listed model on this machine: training images/s and the accuracy it reaches on a
generated RGB photo folder (issue 18).

The folder: 10 classes of coloured shapes (disc, square, triangle, cross, ring, diamond,
horizontal and vertical bars, two dots, an L) at random positions, sizes and colours on noisy
backgrounds, JPEGs of ``--size`` px; prepared once (`data prepare folder --val-fraction 0.2`,
the photos preset: random resized crop and flip). Every model trains from scratch with the
default recipe (plus ``--extra`` options), one process (`--backend local`, all cores), for
``--epochs`` epochs, once per seed; images/s is the last epoch's training rate, accuracy the
final epoch's on the validation split (the test split stays unseen, so recipes can be compared
here without choosing on it).

    python bench/models.py [--images 2000] [--size 64] [--epochs 12] [--seeds 0,1] [--models resnet18,...]
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

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, write_result  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
from imgtrain.models.zoo import LISTED_MODELS  # noqa: E402

SHAPES = ("disc", "square", "triangle", "cross", "ring", "diamond", "hbar", "vbar", "dots", "ell")


def draw_shape(kind: str, size: int, rng: np.random.Generator):
    """One RGB image: a shape of class ``kind`` on a noisy background."""
    from PIL import Image, ImageDraw, ImageFilter

    bg = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
    im = Image.fromarray(bg).resize((size, size), Image.Resampling.BICUBIC)
    noise = rng.normal(0, 18, (size, size, 3))
    im = Image.fromarray(np.clip(np.asarray(im) + noise, 0, 255).astype(np.uint8))
    d = ImageDraw.Draw(im)
    colour = tuple(int(v) for v in rng.integers(0, 256, 3))
    r = rng.uniform(0.18, 0.32) * size
    cx, cy = rng.uniform(r + 2, size - r - 2, 2)
    w = max(2, r / 3)
    box = (cx - r, cy - r, cx + r, cy + r)
    if kind == "disc":
        d.ellipse(box, fill=colour)
    elif kind == "square":
        d.rectangle(box, fill=colour)
    elif kind == "triangle":
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=colour)
    elif kind == "cross":
        d.rectangle((cx - r, cy - w / 2, cx + r, cy + w / 2), fill=colour)
        d.rectangle((cx - w / 2, cy - r, cx + w / 2, cy + r), fill=colour)
    elif kind == "ring":
        d.ellipse(box, outline=colour, width=int(w))
    elif kind == "diamond":
        d.polygon([(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)], fill=colour)
    elif kind == "hbar":
        d.rectangle((cx - r, cy - w, cx + r, cy + w), fill=colour)
    elif kind == "vbar":
        d.rectangle((cx - w, cy - r, cx + w, cy + r), fill=colour)
    elif kind == "dots":
        for dx in (-r / 2, r / 2):
            d.ellipse((cx + dx - w, cy - w, cx + dx + w, cy + w), fill=colour)
    else:  # ell
        d.rectangle((cx - r, cy - r, cx - r + w, cy + r), fill=colour)
        d.rectangle((cx - r, cy + r - w, cx + r, cy + r), fill=colour)
    return im.filter(ImageFilter.GaussianBlur(0.6))


def make_shapes(root: Path, count: int, size: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for i in range(count):
        kind = SHAPES[i % len(SHAPES)]
        path = root / kind / f"{i:06d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        draw_shape(kind, size, rng).save(path, quality=90)


def train(data: Path, storage: Path, model: str, epochs: int, batch: int, seed: int, extra: list[str]) -> dict:
    name = f"{model.replace(':', '-')}-{seed}"
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "imgtrain.cli", "train", "--data", str(data), "--storage",
                           str(storage), "--name", name, "--model", model, "--backend", "local", "--epochs",
                           str(epochs), "--batch-size", str(batch), "--seed", str(seed), "--quiet", "--json", *extra],
                          capture_output=True, text=True)
    if proc.returncode:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}
    metrics = [json.loads(line) for line in (storage / name / "metrics.jsonl").read_text().splitlines()]
    epochs_done = [m for m in metrics if m.get("kind") == "epoch"]
    return {"images_per_s": epochs_done[-1]["images_per_s"], "val_accuracy": epochs_done[-1]["val_accuracy"],
            "wall_s": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--extra", default="", help="more train options for every run (a candidate recipe)")
    parser.add_argument("--models", default=",".join(LISTED_MODELS))
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    result = {"environment": environment(), "inputs": vars(args), "models": {}}
    with tempfile.TemporaryDirectory(prefix="imgtrain-models-") as tmp:
        work = Path(tmp)
        make_shapes(work / "shapes", args.images, args.size)
        subprocess.run([sys.executable, "-m", "imgtrain.cli", "data", "prepare", "folder", str(work / "data"),
                        "--source", str(work / "shapes"), "--val-fraction", "0.2"], check=True, capture_output=True)
        for model in args.models.split(","):
            runs = [train(work / "data", work / "runs", model, args.epochs, args.batch, seed, shlex.split(args.extra))
                    for seed in seeds]
            result["models"][model] = found = dict(zip(map(str, seeds), runs))
            print(model, found, flush=True)
    print(f"results: {write_result('models', result)}")
    print(f"\n| model | images/s | validation accuracy after {args.epochs} epochs, seeds {args.seeds} |\n|---|---|---|")
    for model, found in result["models"].items():
        failed = [r["error"] for r in found.values() if "error" in r]
        if failed:
            print(f"| {model} | failed: {failed[0]} | |")
            continue
        accuracies = [r["val_accuracy"] for r in found.values()]
        rate = statistics.median(r["images_per_s"] for r in found.values())
        spread = f" ({min(accuracies):.1%}-{max(accuracies):.1%})" if len(accuracies) > 1 else ""
        print(f"| {model} | {rate:.0f} | {statistics.mean(accuracies):.1%}{spread} |")


if __name__ == "__main__":
    main()
