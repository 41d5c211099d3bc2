"""How ``data prepare`` reads a source and writes the data set: ``PrepareOptions``, and the
checks of the options every source shares. Which of the others a source takes, its spec says
(``sources/registry.py``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from imgtrain.data.duplicates import check_threshold
from imgtrain.data.limits import MAX_IMAGE_PIXELS, MAX_IMAGE_SIDE
from imgtrain.errors import ImgtrainError

ON_ERROR = ("skip", "fail")
DEDUPE = ("off", "cross-split", "all")


@dataclass(frozen=True)
class PrepareOptions:
    download: bool = False
    """Fetch the source first (mnist: the IDX files, with torchvision; needs the internet)."""
    image_column: str = "image"
    """The table's column of images: PNG/JPEG bytes or pixel arrays."""
    label_column: str = "label"
    """The table's column of labels: class ids or class names."""
    path_column: str = "path"
    """The table's column of image paths (relative to the table's folder, or absolute)."""
    channels: int | None = None
    """1 (grayscale) or 3 (RGB); None: 1 when every image is grayscale."""
    size: tuple[int, int] | None = None
    """Resize (and re-encode) every image to (H, W); None: keep them, train at their size."""
    test_fraction: float = 0.2
    """Share held out for testing when the source has no split of its own."""
    val_fraction: float | None = None
    """Share held out for validation, drawn from the training rows; 0: none; None: the default
    (``splits.DEFAULT_VAL_FRACTION`` when every class has enough training images, docs/data.md)."""
    seed: int = 0
    """Seed of the splits and of the order images are written in."""
    overwrite: bool = False
    """Replace an existing data set in the output folder."""
    on_error: str = "skip"
    """Unreadable images: skip (and list them in the manifest) or fail."""
    workers: int = 0
    """Processes checking and converting images; 0: one per core."""
    dedupe: str = "off"
    """Drop duplicates before writing: cross-split (a copy of a higher split's image; test > val >
    train), all (within a split too: the first in source order stays) or off."""
    near_threshold: int | None = None
    """--dedupe's near duplicates: pHash distance in bits; None: ``duplicates.default_threshold``."""

    def changed(self) -> set[str]:
        """The options set to something other than their default."""
        return {f.name for f in dataclasses.fields(self) if getattr(self, f.name) != f.default}

    def problems(self) -> list[str]:
        """What is wrong with the options whatever the source (a source's own rules: its spec)."""
        issues = []
        test, val = self.test_fraction, self.val_fraction
        if not (0 < test < 1) or (val is not None and (not (0 <= val < 1) or val + test >= 1)):
            issues.append(f"--test-fraction {test} and --val-fraction {val} must be in (0, 1) "
                          "and [0, 1) with room left for training")
        if self.on_error not in ON_ERROR:
            issues.append(f"--on-error must be skip or fail, got {self.on_error!r}")
        if self.dedupe not in DEDUPE:
            issues.append(f"--dedupe must be one of {', '.join(DEDUPE)}, got {self.dedupe!r}")
        if self.near_threshold is not None:
            if self.dedupe == "off":
                issues.append("--near-threshold applies to --dedupe cross-split or all")
            try:
                check_threshold(self.near_threshold)
            except ImgtrainError as e:
                issues.append(str(e))
        try:
            check_channels_size(self.channels, self.size)
        except ImgtrainError as e:
            issues.append(str(e))
        return issues


def parse_size(text: str) -> tuple[int, int]:
    """'28x28' or '28' -> (H, W); for the CLI's --size flag."""
    parts = str(text).lower().replace("×", "x").split("x")
    try:
        hw = tuple(int(p) for p in parts) * (2 if len(parts) == 1 else 1)
    except ValueError:
        hw = ()
    if len(hw) != 2 or min(hw) <= 0:
        raise ImgtrainError(f"--size must look like HxW, e.g. 28x28, got {text!r}")
    return hw  # type: ignore[return-value]


def check_channels_size(channels, size) -> None:
    if channels not in (None, 1, 3):
        raise ImgtrainError(f"channels must be 1 (grayscale) or 3 (RGB), got {channels!r}")
    if size is not None and not (
        len(size) == 2 and all(isinstance(v, (int, np.integer)) and v > 0 for v in size)
    ):
        raise ImgtrainError(f"size must be (height, width) in pixels, e.g. 28x28, got {size!r}")
    if size is not None:
        check_image_size(size, "pass a smaller --size")


def check_image_size(size, hint: str) -> None:
    """A training resolution (H, W) every reader accepts: prepare must not write a data set whose
    manifest ``format.manifest_problems`` refuses."""
    h, w = size
    if max(h, w) > MAX_IMAGE_SIDE or h * w > MAX_IMAGE_PIXELS:
        raise ImgtrainError(f"size {h}x{w} is over the bound of {MAX_IMAGE_SIDE} px a side and "
                            f"{MAX_IMAGE_PIXELS:,} pixels in all (the largest image imgtrain decodes); {hint}")
