"""Stratified, seeded splits: the rule every source's test (and validation) split follows."""

from __future__ import annotations

import numpy as np

from imgtrain.errors import ImgtrainError


def _check_fraction(test_fraction: float) -> None:
    if not (isinstance(test_fraction, (int, float)) and 0.0 < test_fraction < 1.0):
        raise ImgtrainError(
            f"test fraction must be between 0 and 1 (exclusive), got {test_fraction!r}; "
            "pass e.g. --test-fraction 0.2"
        )


def stratified_split(
    labels: np.ndarray, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Row indices (train [N_train], test [N_test]) of a per-class seeded split.

    Each class sends ``count * test_fraction`` rows (rounded half up) to test, at least one and
    at most ``count - 1`` when it has two or more rows, chosen by a seeded permutation. Both
    index arrays come back in a seeded random order, not grouped by class.
    """
    _check_fraction(test_fraction)
    rng = np.random.default_rng(seed)
    train_parts, test_parts = [], []
    for c in np.unique(labels):
        members = np.flatnonzero(labels == c)
        members = members[rng.permutation(len(members))]
        n_test = int(np.floor(len(members) * test_fraction + 0.5))  # half up, not to even
        n_test = min(max(n_test, 1), len(members) - 1) if len(members) >= 2 else 0
        test_parts.append(members[:n_test])
        train_parts.append(members[n_test:])
    train = np.concatenate(train_parts) if train_parts else np.zeros(0, np.int64)
    test = np.concatenate(test_parts) if test_parts else np.zeros(0, np.int64)
    if len(test) == 0:
        raise ImgtrainError(
            f"test fraction {test_fraction} leaves the test split empty for {len(labels)} "
            "images; add images or raise --test-fraction"
        )
    return rng.permutation(train), rng.permutation(test)


def random_split(n: int, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Row indices (train, test) of a seeded random split of ``n`` rows, for rows without one class
    to stratify by (multi-label images): ``n * test_fraction`` rows (rounded half up) to test, at
    least one and at most ``n - 1``."""
    _check_fraction(test_fraction)
    if n < 2:
        raise ImgtrainError(f"test fraction {test_fraction} leaves the test split empty for {n} images; add images")
    order = np.random.default_rng(seed).permutation(n)
    n_test = min(max(int(np.floor(n * test_fraction + 0.5)), 1), n - 1)
    return order[n_test:], order[:n_test]


# The validation split `data prepare` carves from the training rows when the source has none and
# --val-fraction is not given: what training selects its best checkpoint on, so that the test
# split is first seen by `evaluate` and `report`.
DEFAULT_VAL_FRACTION = 0.1
# ... unless a class has fewer training images than this: one of them to validation would cost
# it a tenth or more of what it learns from, and one or two validation images say little anyway.
MIN_TRAIN_PER_CLASS_FOR_VAL = 10


def too_few_for_val(train_labels: np.ndarray, classes) -> str | None:
    """Why the default draws no validation split from these training labels (the smallest class
    and its count), or None when every class that has training images has enough."""
    present, counts = np.unique(train_labels, return_counts=True)
    if not len(counts) or counts.min() >= MIN_TRAIN_PER_CLASS_FOR_VAL:
        return None
    smallest = int(np.argmin(counts))
    label = int(present[smallest])
    name = classes[label] if label < len(classes) else str(label)
    return (f"class {name!r} has only {int(counts[smallest])} training image(s); the default "
            f"carves one when every class has {MIN_TRAIN_PER_CLASS_FOR_VAL} or more")
