"""Do the maps point at the object? Real MNIST digits (the embedded sample) each pasted at a random
spot of a larger blank canvas, so that where the digit lies is known and changes from image to
image; a small model trained on them; the share of test images whose map of the predicted class
peaks on the digit's box (the 28x28 square it was pasted into: a fifth of the canvas, so a map that
ignored the digit would land on it about 1 time in 5).

Used by tests/inference/test_explain.py (one seed, asserted) and bench/explain.py (seeds 0-2)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

CANVAS = 64  # px a side
SIDE = 28  # an MNIST digit's square
# timm's smallest ResNet (0.4 M parameters): on 64 px its last stage is 2x2, so Grad-CAM reads
# layer3's 4x4 (explain.MIN_MAP_SIDE); quick to train on 2 cores.
MODEL = "timm:test_resnet"
TRAIN, TEST = 1500, 200


def placed(images: np.ndarray, canvas: int, rng) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """uint8 [N, 28, 28, 1] digits -> ([N, canvas, canvas, 1] with each at a random spot, the box
    [N, 4] it was pasted into, and the box of its ink: top, left, bottom, right, the last two
    exclusive)."""
    n, side = len(images), images.shape[1]
    out = np.zeros((n, canvas, canvas, 1), np.uint8)
    boxes, ink = np.zeros((n, 4), np.int64), np.zeros((n, 4), np.int64)
    for i, (y, x) in enumerate(rng.integers(0, canvas - side + 1, (n, 2))):
        out[i, y:y + side, x:x + side] = images[i]
        rows, cols = np.flatnonzero(images[i, :, :, 0].any(1)), np.flatnonzero(images[i, :, :, 0].any(0))
        boxes[i] = (y, x, y + side, x + side)
        ink[i] = (y + rows[0], x + cols[0], y + rows[-1] + 1, x + cols[-1] + 1)
    return out, boxes, ink


def write_placed(raw, folder: Path, seed: int, train: int = TRAIN, test: int = TEST,
                 canvas: int = CANVAS) -> tuple[Path, np.ndarray, np.ndarray]:
    """The prepared data set of ``train`` / ``test`` placed digits (from ``raw``, the embedded
    sample's RawDataset), and the test images' digit boxes and ink boxes, in the stored order."""
    from imgtrain.data.raw import RawDataset, Split
    from imgtrain.data.writer import write_dataset

    rng = np.random.default_rng(seed)
    train_images, _, _ = placed(raw.train.images[:train], canvas, rng)
    test_images, boxes, ink = placed(raw.test.images[:test], canvas, rng)
    data = RawDataset(classes=raw.classes,
                      train=Split(images=train_images, labels=raw.train.labels[:train], ids=raw.train.ids[:train]),
                      test=Split(images=test_images, labels=raw.test.labels[:test], ids=raw.test.ids[:test]))
    write_dataset(data, folder, name="placed", source="mnist-sample")
    return folder, boxes, ink


def train_config(data: Path, storage: Path, seed: int, **overrides):
    """A short run on the local backend. No augmentation: the digits preset's random affine moves
    the digit, which the canvas does already, and 3 epochs learn more without it."""
    from imgtrain.config import TrainConfig

    base = dict(data=str(data), storage=str(storage), name=f"placed-{seed}", backend="local", workers=1,
                model=MODEL, epochs=3, batch_size=64, eval_batch_size=200, augment=False, seed=seed,
                log_every_steps=50)
    return TrainConfig(**{**base, **overrides})


def peaks(maps: np.ndarray) -> np.ndarray:
    """[N, 2] (row, column): where each map peaks, the centre of its largest values. A map upsampled
    from a few positions is flat from its outer cells' centres to the edge: the first of a plateau
    (``argmax``) would be its corner, wherever the evidence was."""
    top = maps >= maps.max(axis=(1, 2), keepdims=True) - 1e-6
    rows, cols = np.indices(maps.shape[1:])
    count = top.sum(axis=(1, 2))
    return np.stack([(top * rows).sum(axis=(1, 2)) / count, (top * cols).sum(axis=(1, 2)) / count], axis=1)


def on_the_digit(maps: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    """bool [N]: whether each map's peak lies within its box."""
    at = np.floor(peaks(maps)).astype(np.int64)
    return (at[:, 0] >= boxes[:, 0]) & (at[:, 0] < boxes[:, 2]) & (at[:, 1] >= boxes[:, 1]) & (at[:, 1] < boxes[:, 3])


def pointing_score(run_dir: Path, data: Path, boxes: np.ndarray, ink: np.ndarray) -> dict:
    """The shares of test images whose map of the predicted class peaks on the digit's box and on
    its ink's box, and the test accuracy."""
    from imgtrain.data.format import read_split
    from imgtrain.inference.explain import Explainer
    from imgtrain.inference.predictor import Predictor

    _, images, labels = read_split(data, "test")
    predictor = Predictor(run_dir)
    predicted = predictor.predict_proba(images).argmax(1)
    maps = Explainer(predictor.loaded).maps(images, predicted)
    return {"pointing": float(on_the_digit(maps, boxes).mean()), "pointing_ink": float(on_the_digit(maps, ink).mean()),
            "accuracy": float((predicted == labels).mean())}
