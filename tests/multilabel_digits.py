"""A real multi-label image set for tests: 2x2 grids of scikit-learn's handwritten digits (8x8
scans, 1,797 of them), each grid's labels the distinct digits it shows. Written as PNG files
and a CSV (``path``, ``labels`` space-separated, ``split``), for ``imgtrain data prepare list
labels.csv --multi-label --split-column split``.

Cells left blank (1 in 8 on average) make images with fewer labels, and a few grids are blank
altogether: images without a label (every class negative)."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
from PIL import Image

SPLITS = (("train", 0.7), ("val", 0.15), ("test", 0.15))


def write_digit_grids(folder, count: int = 300, size: int = 32, seed: int = 0, blank_cell: float = 0.125,
                      blank_image: float = 0.02) -> Path:
    """``count`` PNG grids of ``size`` x ``size`` px (grayscale) in ``folder``/images and
    ``folder``/labels.csv; returns the CSV's path. Deterministic in ``seed``."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    pictures = (digits.images * (255.0 / 16.0)).astype(np.uint8)  # 8x8, values 0..16
    rng = np.random.default_rng(seed)
    folder = Path(folder)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    cuts = np.cumsum([int(round(count * share)) for _, share in SPLITS])
    rows = []
    for i in range(count):
        grid = np.zeros((16, 16), np.uint8)
        shown = set()
        blank = rng.random() < blank_image
        for cell in range(4):
            if blank or rng.random() < blank_cell:
                continue
            k = int(rng.integers(len(pictures)))
            r, c = divmod(cell, 2)
            grid[r * 8:(r + 1) * 8, c * 8:(c + 1) * 8] = pictures[k]
            shown.add(int(digits.target[k]))
        name = f"images/grid-{i:05d}.png"
        Image.fromarray(grid).resize((size, size), Image.BILINEAR).save(folder / name)
        split = next(s for (s, _), cut in zip(SPLITS, cuts) if i < cut) if i < cuts[-1] else "train"
        rows.append((name, " ".join(str(d) for d in sorted(shown)), split))
    path = folder / "labels.csv"
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["path", "labels", "split"])
        writer.writerows(rows)
    return path
