"""Folders of photos with planted problems, for the tests of `data inspect` and `--dedupe` (and
the docs' screenshot: `python -m tests.data.inspect_screenshot`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

# train/ and test/ images per class: "big" has 10.5x the training images of "small" once the
# two planted copies are added to it.
COUNTS = {"train": {"big": 40, "small": 4}, "test": {"big": 6, "small": 3}}


def photo(rng: np.random.Generator, side: int = 48) -> Image.Image:
    """A smooth random colour field with grain: unrelated ones are ~30 bits apart in pHash."""
    coarse = Image.fromarray((rng.random((6, 6, 3)) * 255).astype(np.uint8))
    smooth = np.asarray(coarse.resize((side, side), Image.Resampling.BICUBIC)).astype(np.int16)
    return Image.fromarray(np.clip(smooth + rng.integers(-20, 20, (side, side, 3)), 0, 255).astype(np.uint8))


def planted_photos(root: Path, seed: int = 0) -> dict[str, str]:
    """``root``/train|test/big|small/NNN.png, plus two planted copies in train/big: ``leak.png``
    (the bytes of test/big/000.png) and ``turned.png`` (train/big/001.png turned 90 degrees).
    Returns {what: relative path}."""
    rng = np.random.default_rng(seed)
    for split, per_class in COUNTS.items():
        for name, n in per_class.items():
            (root / split / name).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                photo(rng).save(root / split / name / f"{i:03d}.png")
    (root / "train/big/leak.png").write_bytes((root / "test/big/000.png").read_bytes())
    Image.open(root / "train/big/001.png").transpose(Image.Transpose.ROTATE_90).save(root / "train/big/turned.png")
    return {"leaked": "test/big/000.png", "leak": "train/big/leak.png", "original": "train/big/001.png",
            "turned": "train/big/turned.png"}
