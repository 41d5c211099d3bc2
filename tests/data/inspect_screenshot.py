"""The docs' screenshot of the `data inspect` page (docs/images/inspect.png), of a small folder of
real photos with planted problems: crops of three photos (scikit-learn's and matplotlib's sample
images) as three classes, one of them 12x smaller; test photos copied, resized or turned into
train; a few grayscale ones; an unreadable file.

    python -m tests.data.inspect_screenshot docs/images/inspect.png
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image


def sources() -> dict[str, Image.Image]:
    import matplotlib.cbook
    import sklearn.datasets

    china, flower = sklearn.datasets.load_sample_images().images
    hopper = Image.open(matplotlib.cbook.get_sample_data("grace_hopper.jpg")).convert("RGB")
    return {"temple": Image.fromarray(china), "flower": Image.fromarray(flower), "portrait": hopper}


def crop(im: Image.Image, rng) -> Image.Image:
    w, h = im.size
    cw, ch = int(w * rng.uniform(0.25, 0.5)), int(h * rng.uniform(0.3, 0.6))
    x, y = int(rng.integers(0, w - cw)), int(rng.integers(0, h - ch))
    out = im.crop((x, y, x + cw, y + ch))
    return out.resize((int(cw * 0.6), int(ch * 0.6)))


def make_folder(root: Path, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    counts = {"train": {"temple": 48, "flower": 48, "portrait": 4}, "test": {"temple": 10, "flower": 10, "portrait": 3}}
    photos = sources()
    for split, per_class in counts.items():
        for name, n in per_class.items():
            (root / split / name).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                picture = crop(photos[name], rng)
                if rng.random() < 0.1:
                    picture = picture.convert("L")
                picture.save(root / split / name / f"{name}_{split}_{i:03d}.jpg", quality=90)
    test, train = root / "test", root / "train"
    shutil.copy(test / "temple/temple_test_002.jpg", train / "temple/IMG_0412.jpg")  # a leaked test photo
    Image.open(test / "flower/flower_test_004.jpg").resize((100, 80)).save(train / "flower/IMG_0413.jpg")  # resized
    Image.open(test / "portrait/portrait_test_001.jpg").transpose(Image.Transpose.ROTATE_270).save(
        train / "portrait/IMG_0414.jpg")  # turned
    Image.open(train / "flower/flower_train_007.jpg").transpose(Image.Transpose.FLIP_LEFT_RIGHT).save(
        train / "flower/IMG_0415.jpg")  # mirrored, within train
    (train / "temple/notes.txt").write_text("not an image")
    data = (train / "flower/flower_train_010.jpg").read_bytes()
    (train / "flower/broken.jpg").write_bytes(data[: len(data) // 3])


def main(out: Path) -> None:
    from imgtrain.data.inspection import inspect_dataset
    from imgtrain.data.options import PrepareOptions
    from imgtrain.data.prepare import prepare
    from tests.browser import BrowserPage

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_folder(root / "photos")
        prepare("folder", root / "photos-small", root / "photos", PrepareOptions())
        found = inspect_dataset(root / "photos-small", root / "page.html")
        page = BrowserPage(Path(found["page"]).as_uri(), root / "profile", size=(1100, 2300))
        try:
            page.wait_loaded()
            page.screenshot(root / "shot.png")
        finally:
            page.close()
        shot = Image.open(root / "shot.png").convert("RGB")
        shot.quantize(colors=128, method=Image.Quantize.MEDIANCUT).save(out, optimize=True)  # < 300 KB
    print(f"{out}: {out.stat().st_size:,} bytes")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
