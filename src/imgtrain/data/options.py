"""The options of ``data prepare`` (``PrepareOptions``) and ``data inspect`` (``InspectOptions``),
each declared once (``settings.option``: the CLI's flags and help and the Python API's keywords
come from here), and the checks of the options every source shares. Which of the others a source
takes, its spec says (``sources/registry.py``)."""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from pathlib import Path

from imgtrain.errors import ImgtrainError
from imgtrain.settings import option

ON_ERROR = ("skip", "fail")
DEDUPE = ("off", "cross-split", "all")
THRESHOLD_HELP = "pHash distance in bits (default 4; 0 for grayscale images of 32 px or less)."


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


@dataclass(frozen=True)
class PrepareOptions:
    """How ``data prepare`` reads a source and writes the data set. The options only some sources
    take (``registry.SOURCE_OPTIONS``) are shown in --help after the sources that use them."""

    download: bool = option(False, "Fetch the files into --source first (needs internet).")
    image_column: str = option("image", "The image column (PNG/JPEG bytes or pixel arrays).")
    label_column: str = option("label", "The label column (class ids or names).")
    path_column: str = option("path", "The column of image paths (relative to the table).")
    multi_label: bool = option(False, "Several labels per image: the label column holds a list of them, or "
                               "names joined by --label-sep; an image may have none.", flag="--multi-label")
    label_sep: str | None = option(None, "--multi-label: what separates the names in a string label column "
                                   "(default: a space).")
    split_column: str | None = option(None, "A column of train/val/test: the table's own splits (no split is "
                                      "drawn where it gives one).")
    channels: int | None = option(None, "1 (grayscale) or 3 (RGB); default: 1 when every image is gray.")
    size: tuple[int, int] | None = option(None, "Resize (and re-encode) every image to HxW, e.g. 64x64; default: "
                                          "keep them, train at their size (or the median one).", parse=parse_size)
    test_fraction: float = option(0.2, "Share held out for testing when the source has no split.")
    val_fraction: float | None = option(
        None, "Share held out for validation, from the training images (picks the best checkpoint; the test "
        "split then stays untouched until evaluate/report); 0 = none. Default: 0.1 where the source has no "
        "validation split and every class has 10 or more training images.")
    # (that 0.1 is splits.DEFAULT_VAL_FRACTION, docs/data.md)
    on_error: str = option("skip", "Unreadable images: skip (and list them) or fail.", choices=ON_ERROR)
    workers: int = option(0, "Processes checking and converting images; 0 = one per core.")
    seed: int = option(0, "Seed of the splits.")  # and of the order images are written in
    overwrite: bool = option(False, "Replace an existing data set in OUT_DIR.", flag="--overwrite")
    dedupe: str = option("off", "Drop duplicates (exact, or near as `data inspect` finds them): cross-split (a copy "
                         "of a test or val image leaves the lower split), all (also within a split: the first in "
                         "source order stays), off. Listed in OUT_DIR/dedupe.csv.", choices=DEDUPE)
    near_threshold: int | None = option(None, "--dedupe: the near duplicates' " + THRESHOLD_HELP)

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
        if self.label_sep is not None and not self.multi_label:
            issues.append("--label-sep applies to --multi-label; add --multi-label or drop --label-sep")
        if self.label_sep == "":
            issues.append("--label-sep must not be empty")
        if self.on_error not in ON_ERROR:
            issues.append(f"--on-error must be skip or fail, got {self.on_error!r}")
        if self.dedupe not in DEDUPE:
            issues.append(f"--dedupe must be one of {', '.join(DEDUPE)}, got {self.dedupe!r}")
        if self.near_threshold is not None:
            from imgtrain.data.duplicates import check_threshold  # numpy: not for --help

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


@dataclass(frozen=True)
class InspectOptions:
    """How ``data inspect`` looks at a prepared data set."""

    out: Path | None = option(None, "Where to write the page; default: <data set name>-inspect.html in the "
                              "current folder.")
    workers: int = option(0, "Processes reading and hashing images; 0 = one per core.")
    threshold: int | None = option(None, "Near duplicates: " + THRESHOLD_HELP, flag="--near-threshold")
    seed: int = option(0, "Seed of the sample images shown per class.")


def check_channels_size(channels, size) -> None:
    if channels not in (None, 1, 3):
        raise ImgtrainError(f"channels must be 1 (grayscale) or 3 (RGB), got {channels!r}")
    if size is not None and not (
        len(size) == 2 and all(isinstance(v, numbers.Integral) and v > 0 for v in size)  # numpy's too
    ):
        raise ImgtrainError(f"size must be (height, width) in pixels, e.g. 28x28, got {size!r}")
    if size is not None:
        check_image_size(size, "pass a smaller --size")


def check_image_size(size, hint: str) -> None:
    """A training resolution (H, W) every reader accepts: prepare must not write a data set whose
    manifest ``format.manifest_problems`` refuses."""
    from imgtrain.data.limits import MAX_IMAGE_PIXELS, MAX_IMAGE_SIDE  # numpy and PIL: not for --help

    h, w = size
    if max(h, w) > MAX_IMAGE_SIDE or h * w > MAX_IMAGE_PIXELS:
        raise ImgtrainError(f"size {h}x{w} is over the bound of {MAX_IMAGE_SIDE} px a side and "
                            f"{MAX_IMAGE_PIXELS:,} pixels in all (the largest image imgtrain decodes); {hint}")
