"""Bounds on what a data set may hold, checked by every source and every reader."""

from __future__ import annotations

from imgtrain.errors import ImgtrainError

# One class per label value up to the largest: a stray label of 20,000,000 would make as many
# classes (and a 10-GB output layer). Real data sets with more classes than this are rare.
MAX_CLASSES = 100_000


def check_class_count(count: int, where: str, hint: str = "check the labels") -> None:
    if count > MAX_CLASSES:
        raise ImgtrainError(f"{where} make {count:,} classes, more than the {MAX_CLASSES:,} imgtrain accepts; {hint}")
