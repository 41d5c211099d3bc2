"""Calibration and out-of-distribution rejection, measured (issue 49).

Per seed: the embedded MNIST sample's digits 0-4 (its training images split 80/20 into train and
val, seeded; its test images of 0-4 as the test split), the default recipe trained on them
(``--backend local``, ``--epochs``; training fits the temperature and the thresholds on val at
its end). Then, on the test split:

* ECE and NLL before (T = 1) and after temperature scaling (``evaluate``'s ``temperature_scaling``);
* for each score (energy, max-logit, max-softmax, mahalanobis), AUROC and FPR at 95 % TPR (``evaluate --ood``)
  of the test split against a **near** out-of-distribution set, the sample's test images of the
  held-out digits 5-9, and a **far** one, other images: 64x64 crops of scikit-learn's two sample
  photos and scikit-image's 200 LFW faces (when installed), converted as predict converts them;
* the cost of the score per image: ``ood.scores`` over the test split's logits (and features),
  against the forward pass that made them (without and with the features kept for mahalanobis),
  repeats interleaved.

Over ``--seeds`` (the split and the training seed alike): mean and range.

    PYTHONPATH=src .venv/bin/python bench/calibration_ood.py [--epochs 8] [--seeds 0,1,2]
        [--train-images 300 --no-augment]   # small, no augmentation or weight decay: overconfident
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
from common import environment, write_result  # noqa: E402

KNOWN = 5  # digits 0-4 are the classes; 5-9 the near out-of-distribution set


def write_digit_sets(out: Path, seed: int, train_images: int = 0) -> tuple[Path, Path]:
    """(the data set of digits 0-4 with a val split, a folder of PNGs of the test digits 5-9);
    ``train_images``: at most that many training images (0: all)."""
    from PIL import Image

    from imgtrain.data.raw import RawDataset, gather
    from imgtrain.data.sources.mnist_sample import load_mnist_sample
    from imgtrain.data.writer import write_dataset

    raw = load_mnist_sample()
    train = np.flatnonzero(raw.train.labels < KNOWN)
    train = np.random.default_rng(seed).permutation(train)
    cut = int(0.8 * len(train))
    test = np.flatnonzero(raw.test.labels < KNOWN)
    split = lambda s, index: gather(s.images, s.labels, s.ids, index)  # noqa: E731
    data = out / "digits-0-4"
    kept = train[:cut][:train_images] if train_images else train[:cut]
    write_dataset(RawDataset([str(d) for d in range(KNOWN)], split(raw.train, kept),
                             split(raw.test, test), val=split(raw.train, train[cut:])),
                  data, name="digits-0-4", source="mnist-sample")
    near = out / "digits-5-9"
    near.mkdir()
    for i in np.flatnonzero(raw.test.labels >= KNOWN):
        Image.fromarray(raw.test.images[i][..., 0]).save(near / f"{i}.png")
    return data, near


def write_far_folder(out: Path, seed: int = 0, crops_per_photo: int = 100) -> Path:
    """64x64 crops of scikit-learn's sample photos, and scikit-image's LFW faces when installed."""
    from PIL import Image
    from sklearn.datasets import load_sample_images

    far = out / "other-images"
    far.mkdir()
    rng = np.random.default_rng(seed)
    for p, photo in enumerate(load_sample_images().images):
        for k in range(crops_per_photo):
            y, x = rng.integers(0, photo.shape[0] - 64), rng.integers(0, photo.shape[1] - 64)
            Image.fromarray(photo[y:y + 64, x:x + 64]).save(far / f"photo{p}-{k}.png")
    try:
        from skimage.data import lfw_subset
    except ImportError:
        return far
    for k, face in enumerate(lfw_subset()):  # float [25, 25] in [0, 1]
        Image.fromarray((face * 255).astype(np.uint8)).save(far / f"face-{k}.png")
    return far


def score_cost(run: Path, data: Path, repeats: int = 5) -> dict:
    """µs per image of each score over the test split's logits, and of the forward pass."""
    from imgtrain.data.format import read_split
    from imgtrain.inference import ood
    from imgtrain.inference.predictor import Predictor

    _, images, _ = read_split(data, "test")
    plain, featured = Predictor(run), Predictor(run, ood_score="mahalanobis")
    _, logits, features = featured._forward(images)
    times = {m: [] for m in (*ood.METHODS, "forward", "forward keeping the features")}
    for _ in range(repeats):  # interleaved: the machine's load falls on all alike
        for m in ood.METHODS:
            start = time.perf_counter()
            ood.scores(logits, m, featured.temperature, features, featured.fitted)
            times[m].append((time.perf_counter() - start) / len(images) * 1e6)
        for what, predictor in (("forward", plain), ("forward keeping the features", featured)):
            start = time.perf_counter()
            predictor._forward(images)
            times[what].append((time.perf_counter() - start) / len(images) * 1e6)
    return {k: statistics.median(v) for k, v in times.items()}


def one_seed(tmp: Path, seed: int, args, far: Path) -> dict:
    import imgtrain
    from imgtrain.config import TrainConfig
    from imgtrain.inference import ood
    from imgtrain.inference.options import InferenceOptions
    from imgtrain.training.progress import TrainingDisplay

    data, near = write_digit_sets(tmp / f"seed-{seed}", seed, args.train_images)
    storage = tmp / "runs"
    recipe = {} if args.augment else {"augment": False, "weight_decay": 0.0}  # the overconfident one
    imgtrain.train(TrainConfig(data=str(data), storage=str(storage), name=f"run-{seed}", backend="local", workers=1,
                               epochs=args.epochs, seed=seed, **recipe), display=TrainingDisplay(quiet=True))
    run = storage / f"run-{seed}"
    out = {"scores": {}}
    for method in ood.METHODS:
        options = InferenceOptions(backend="local", ood_score=method)
        for name, folder in (("near", near), ("far", far)):
            ev = imgtrain.evaluate(str(run), options=options, ood=str(folder))
            out["scores"].setdefault(method, {})[name] = {"auroc": ev.ood["auroc"],
                                                          "fpr95": ev.ood["fpr_at_95_tpr"],
                                                          "images": ev.ood["out_of_distribution"]["images"]}
    out["temperature_scaling"] = ev.temperature_scaling
    out["accuracy"] = ev.accuracy
    out["test_images"] = ev.num_samples
    out["cost_us_per_image"] = score_cost(run, data)
    return out


def spread(values) -> str:
    return f"{statistics.mean(values):.4f} ({min(values):.4f}-{max(values):.4f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--train-images", type=int, default=0, help="at most this many training images (0: all)")
    parser.add_argument("--no-augment", dest="augment", action="store_false",
                        help="no augmentation and no weight decay: a model that ends overconfident")
    args = parser.parse_args()
    by_seed = {}
    with tempfile.TemporaryDirectory(prefix="imgtrain-calibration-ood-") as tmp:
        far = write_far_folder(Path(tmp))
        for seed in (int(s) for s in args.seeds.split(",")):
            by_seed[seed] = one_seed(Path(tmp), seed, args, far)
            print(seed, by_seed[seed], flush=True)
    result = {"environment": environment(), "inputs": vars(args), "by_seed": by_seed}
    print(f"results: {write_result('calibration_ood', result)}")
    runs = list(by_seed.values())
    ts = [r["temperature_scaling"] for r in runs]
    print(f"seeds {args.seeds}, {args.epochs} epochs, digits 0-4 ({runs[0]['test_images']} test images); "
          f"mean (range)")
    print(f"test accuracy {spread([r['accuracy'] for r in runs])}; T {spread([t['temperature'] for t in ts])}")
    for what in ("ece", "nll"):
        print(f"{what.upper()} before {spread([t[what]['before'] for t in ts])} -> after "
              f"{spread([t[what]['after'] for t in ts])}")
    for method in runs[0]["scores"]:
        for name in ("near", "far"):
            rows = [r["scores"][method][name] for r in runs]
            print(f"{method:11} {name} ({rows[0]['images']} images): AUROC {spread([x['auroc'] for x in rows])}, "
                  f"FPR95 {spread([x['fpr95'] for x in rows])}")
    for what in runs[0]["cost_us_per_image"]:
        print(f"cost {what}: {spread([r['cost_us_per_image'][what] for r in runs])} µs/image")


if __name__ == "__main__":
    main()
