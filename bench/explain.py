"""Explanations (issue 49): do the maps point at the object, and what does ``--explain`` cost?

Pointing: real MNIST digits (the embedded sample) each pasted at a random spot of a 64x64 blank
canvas (``tests/placed_digits.py``, the test suite's own data and score), timm's smallest ResNet
trained on them in this process (the local backend, 3 epochs of 1,500 images), then the share of
test images whose Grad-CAM map of the predicted class peaks inside the digit's box (the 28x28 square
it was pasted into), and inside its ink's box; per seed (the placing and the training seed
alike), with the test accuracy beside it.

Cost: ``imgtrain predict`` of the same images (PNG files) into a CSV, plain and with
``--explain DIR``, on the local backend, the two interleaved ``--rounds`` times; the ratio of the
two wall times in each round, and the milliseconds per image. For the placed-digits model
(64x64) and for the default model, imgtrain's ResNet-18 on 28x28 digits (its weights do not
change the cost: a few training steps).

    .venv/bin/python bench/explain.py [--seeds 0,1,2] [--rounds 3] [--images 500]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/placed_digits.py: the test's data and score
from common import environment, write_result  # noqa: E402


def pointing(raw, tmp: Path, seed: int) -> dict:
    import imgtrain
    from imgtrain.training.progress import TrainingDisplay
    from tests.placed_digits import pointing_score, train_config, write_placed

    data, boxes, ink = write_placed(raw, tmp / f"placed-{seed}", seed)
    started = time.perf_counter()
    result = imgtrain.train(train_config(data, tmp / "runs", seed), display=TrainingDisplay(quiet=True))
    train_s = time.perf_counter() - started
    score = pointing_score(result.path, data, boxes, ink)
    print(f"seed {seed}: pointing {score['pointing']:.1%} (ink box {score['pointing_ink']:.1%}), test accuracy "
          f"{score['accuracy']:.1%} (trained in {train_s:.0f} s)", flush=True)
    return {"seed": seed, **score, "train_s": train_s, "run": str(result.path)}


def cost(run: Path, images: np.ndarray, tmp: Path, rounds: int) -> dict:
    """Wall time of predict with and without --explain over the same PNG files, interleaved."""
    from PIL import Image

    from imgtrain.inference.batch import predict
    from imgtrain.inference.options import InferenceOptions

    folder = tmp / f"pngs-{run.name}"
    folder.mkdir()
    for i, image in enumerate(images):
        Image.fromarray(image[..., 0]).save(folder / f"{i:05d}.png")
    options = InferenceOptions(backend="local")
    times = {"plain": [], "explain": []}
    for r in range(rounds + 1):  # round 0 warms the caches up and is not counted
        for kind in ("plain", "explain"):
            started = time.perf_counter()
            predict(str(run), str(folder), tmp / f"{run.name}-{kind}-{r}.csv", options=options,
                    explain=str(tmp / f"maps-{run.name}-{r}") if kind == "explain" else None)
            if r:
                times[kind].append(time.perf_counter() - started)
    ratios = [e / p for e, p in zip(times["explain"], times["plain"])]
    n = len(images)
    out = {"images": n, "ratio": ratios,
           "ms_per_image": {k: [1000 * t / n for t in v] for k, v in times.items()}}
    print(f"{run.name}: --explain costs {statistics.median(ratios):.1f}x plain predict "
          f"(rounds {min(ratios):.1f}-{max(ratios):.1f}); {statistics.median(out['ms_per_image']['explain']):.1f} "
          f"against {statistics.median(out['ms_per_image']['plain']):.1f} ms per image", flush=True)
    return out


def default_model_run(raw, tmp: Path) -> Path:
    """imgtrain's ResNet-18 on 28x28 digits, a few steps (the cost does not depend on the weights)."""
    import imgtrain
    from imgtrain.config import TrainConfig
    from imgtrain.data.writer import write_dataset
    from imgtrain.training.progress import TrainingDisplay

    data = tmp / "digits"
    write_dataset(raw, data, name="digits", source="mnist-sample")
    result = imgtrain.train(TrainConfig(data=str(data), storage=str(tmp / "runs"), name="resnet18-digits",
                                        backend="local", workers=1, epochs=1, limit_train_batches=4),
                            display=TrainingDisplay(quiet=True))
    return result.path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--images", type=int, default=500)
    args = parser.parse_args()
    from imgtrain.data.sources.mnist_sample import load_mnist_sample
    from tests.placed_digits import placed

    raw = load_mnist_sample()
    with tempfile.TemporaryDirectory(prefix="imgtrain-explain-") as tmp:
        tmp = Path(tmp)
        runs = [pointing(raw, tmp, int(s)) for s in args.seeds.split(",")]
        summary = {}
        for key in ("pointing", "pointing_ink", "accuracy"):
            values = [r[key] for r in runs]
            summary[key] = {"mean": statistics.mean(values), "min": min(values), "max": max(values)}
            print(f"{key} over seeds {args.seeds}: mean {summary[key]['mean']:.1%} "
                  f"({summary[key]['min']:.1%}-{summary[key]['max']:.1%})", flush=True)
        canvases, _, _ = placed(raw.test.images[:args.images], 64, np.random.default_rng(99))
        costs = {"placed-test_resnet-64px": cost(Path(runs[0]["run"]), canvases, tmp, args.rounds),
                 "resnet18-28px": cost(default_model_run(raw, tmp), raw.test.images[:args.images], tmp, args.rounds)}
    path = write_result("explain", {"environment": environment(), "args": vars(args), "pointing": runs,
                                    "summary": summary, "cost": costs})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
