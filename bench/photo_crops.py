"""A small real photo set built from what scikit-image ships (no download): 32x32 crops of ten
of its photographs, each crop labelled by the photograph it came from.

Every photograph is cut into three vertical bands, train (the left 60 %), val (the next 20 %) and
test (the last 20 %); a crop lies wholly inside one band, so no test pixel was ever seen in
training or used to choose anything: the model must recognise unseen parts of a scene (its
colours, textures, objects) from other parts. Crops are squares of 24 to 96 source pixels
(random position and size, seeded), resized to 32x32 with antialiasing: the scale varies as
photos' does. The ten sources: seven colour photographs (astronaut, coffee, chelsea, rocket,
immunohistochemistry, hubble_deep_field, retina) and three grey textures as RGB (grass, gravel,
brick), which only their texture tells apart.

    python bench/photo_crops.py OUT_DIR   # writes OUT_DIR/images/, OUT_DIR/list.csv, OUT_DIR/data/
"""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

SOURCES = ("astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry", "hubble_deep_field", "retina",
           "grass", "gravel", "brick")
BANDS = {"train": (0.0, 0.6), "val": (0.6, 0.8), "test": (0.8, 1.0)}
PER_SPLIT = {"train": 200, "val": 50, "test": 100}  # crops of each photograph


def prepare(root: Path, seed: int = 0) -> Path:
    """The prepared data set under ``root`` (made once)."""
    import numpy as np
    import skimage.data
    from PIL import Image

    out = root / "photo-crops"
    if (out / "manifest.json").is_file():
        return out
    images, rows = root / "photo-crops-images", []
    rng = np.random.default_rng(seed)
    for label in SOURCES:
        photo = getattr(skimage.data, label)()
        if photo.ndim == 2:
            photo = np.stack([photo] * 3, axis=-1)
        photo = photo[..., :3]
        h, w, _ = photo.shape
        scale = 512 / max(h, w)  # retina and hubble are large: every source at about 512 px
        photo = np.asarray(Image.fromarray(photo).resize((round(w * scale), round(h * scale)), Image.LANCZOS))
        h, w, _ = photo.shape
        (images / label).mkdir(parents=True, exist_ok=True)
        for split, (lo, hi) in BANDS.items():
            left, right = int(lo * w), int(hi * w)
            for i in range(PER_SPLIT[split]):
                side = int(rng.integers(24, min(96, right - left, h) + 1))
                x, y = int(rng.integers(left, right - side + 1)), int(rng.integers(0, h - side + 1))
                crop = Image.fromarray(photo[y:y + side, x:x + side]).resize((32, 32), Image.LANCZOS)
                path = images / label / f"{split}-{i}.png"
                crop.save(path)
                rows.append({"path": str(path), "label": label, "split": split})
    listing = root / "photo-crops.csv"
    with listing.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["path", "label", "split"])
        writer.writeheader()
        writer.writerows(rows)
    subprocess.run([sys.executable, "-m", "imgtrain.cli", "data", "prepare", "list", str(out), "--source", str(listing),
                    "--split-column", "split"], check=True, capture_output=True)
    return out


if __name__ == "__main__":
    print(prepare(Path(sys.argv[1])))
