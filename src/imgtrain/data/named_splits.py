"""A source's own splits, as its file and folder names give them: ``train-000.tar``,
``test/000.tar``, ``data/validation-00000-of-00001.parquet``, a DatasetDict's ``validation``.
Kept as they are (train, val, test); a split the source lacks is drawn as for any source."""

from __future__ import annotations

import re

import numpy as np

from imgtrain.errors import ImgtrainError

# The words that name a split, and the split imgtrain calls it.
SPLIT_WORDS = {"train": "train", "training": "train", "val": "val", "valid": "val", "validation": "val",
               "dev": "val", "test": "test", "testing": "test"}
SPLIT_CODES = {"train": 0, "val": 1, "test": 2}  # as prepare.assign_splits numbers them
SPLIT_NAMES = {code: name for name, code in SPLIT_CODES.items()}


def split_of_name(name: str) -> str | None:
    """"validation" -> "val": a split's own name (a DatasetDict's), or None for another name."""
    return SPLIT_WORDS.get(name.lower())


def split_of_path(relative: str) -> str | None:
    """The split a file's path names: the last of its words (runs of letters) that names one,
    so that the file's own name wins over its folders'; None when no word does. ``imagenet-
    train-000123.tar`` is train; ``contest-000.tar`` and ``trainers.tar`` name none."""
    words = re.findall(r"[a-z]+", relative.lower())
    return next((SPLIT_WORDS[w] for w in reversed(words) if w in SPLIT_WORDS), None)


def splits_of_files(relatives: list[str], what: str) -> list[str | None]:
    """The split each file names (``split_of_path``), when all of them name one; all None when
    none does. Some and not others is an error: which split would the rest go to?"""
    named = [split_of_path(r) for r in relatives]
    unnamed = [r for r, s in zip(relatives, named) if s is None]
    if unnamed and len(unnamed) < len(relatives):
        example = next(r for r, s in zip(relatives, named) if s is not None)
        raise ImgtrainError(f"some {what} name a split ({example}) and others do not ({unnamed[0]}); name "
                            "train/val/test in every file or folder name, or in none to split at random")
    return named


def fixed_splits(codes: np.ndarray | None, what: str) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(fixed_test, fixed_val) masks of a ``Listing`` from per-image split codes (SPLIT_CODES;
    None: the source has no splits of its own). A source without training images is refused."""
    if codes is None:
        return None, None
    if not (codes == SPLIT_CODES["train"]).any():
        raise ImgtrainError(f"{what} has no training images: its names give only the {' and '.join(_present(codes))} "
                            "split(s); add the training split, or name no split (train/val/test) in any file "
                            "or folder name to split at random")
    test, val = codes == SPLIT_CODES["test"], codes == SPLIT_CODES["val"]
    return (test if test.any() else None), (val if val.any() else None)


def _present(codes: np.ndarray) -> list[str]:
    return [name for name, code in SPLIT_CODES.items() if (codes == code).any()] or ["nothing"]
