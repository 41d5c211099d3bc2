"""Multi-label figures from per-label probabilities ``scores`` float [n, C] and multi-hot
``targets`` [n, C]: average precision per label and its macro mean (mAP), the F1-best decision
threshold per label, and the scores of a thresholded prediction (per-label precision, recall and
F1, micro and macro F1, exact-match ratio, Hamming loss). Used by validation in training
(``val_map``, the thresholds stored with a checkpoint) and by ``evaluate``.

Plain numpy, vectorised over the labels (scikit-learn is only a test dependency here; the tests
hold every figure to its functions). Definitions:

- average precision (``average_precision_score``): over the distinct scores in descending order,
  sum of (recall step) x (precision at that score); tied scores are one threshold. A label without
  a positive sample has none (NaN), and mAP is the mean over the labels that have one.
- the F1-best threshold of a label: of the thresholds "score >= s" for each distinct score s, the
  one with the highest F1 (the highest such s on a tie); the threshold stored is halfway between
  the lowest score it calls positive and the next lower score (the lowest score itself when there
  is none), so a nearby score on other images is not decided by a rounding. A label without a
  positive sample keeps DEFAULT_THRESHOLD.
- precision, recall, F1 per label with ``zero_division=0``; macro F1 is the mean over the labels
  present or predicted (as ``metrics.py``'s single-label macro average; scikit-learn's with those
  ``labels``); micro F1 from the summed counts; exact match: every label right
  (``accuracy_score``); Hamming loss: the share of wrong (image, label) decisions.
"""

from __future__ import annotations

import numpy as np

DEFAULT_THRESHOLD = 0.5


def _sorted_runs(scores: np.ndarray, targets: np.ndarray):
    """Per label (column), the scores in descending order, the targets in that order, the
    running count of positives, and for each position the index of the last position of its run
    of tied scores (where a threshold "score >= s" ends)."""
    scores = np.asarray(scores, np.float64)
    targets = np.asarray(targets).astype(bool)
    n = scores.shape[0]
    order = np.argsort(-scores, axis=0, kind="stable")
    s = np.take_along_axis(scores, order, 0)
    y = np.take_along_axis(targets, order, 0)
    tp = np.cumsum(y, axis=0, dtype=np.int64)
    is_end = np.ones_like(s, dtype=bool)
    is_end[:-1] = s[:-1] != s[1:]
    positions = np.broadcast_to(np.arange(n)[:, None], s.shape)
    end = np.minimum.accumulate(np.where(is_end, positions, n)[::-1], axis=0)[::-1]
    return s, y, tp, is_end, end


def average_precision(scores, targets) -> np.ndarray:
    """float [C]: each label's average precision (NaN for a label without positives)."""
    scores = np.asarray(scores)
    if scores.ndim != 2 or scores.shape[0] == 0:
        return np.full(scores.shape[-1] if scores.ndim == 2 else 0, np.nan)
    s, y, tp, _, end = _sorted_runs(scores, targets)
    positives = tp[-1].astype(np.float64)
    precision_at_end = np.take_along_axis(tp, end, 0) / (end + 1.0)  # each position: its threshold's precision
    with np.errstate(invalid="ignore", divide="ignore"):
        ap = (y * precision_at_end).sum(0) / positives
    return np.where(positives > 0, ap, np.nan)


def mean_average_precision(ap: np.ndarray) -> float:
    """The mean of the labels' APs over those with positives; 0.0 when none has one."""
    ap = np.asarray(ap, np.float64)
    present = ~np.isnan(ap)
    return float(ap[present].mean()) if present.any() else 0.0


def best_f1_thresholds(scores, targets) -> np.ndarray:
    """float32 [C]: each label's F1-best decision threshold (module docstring)."""
    scores = np.asarray(scores)
    c = scores.shape[1] if scores.ndim == 2 else 0
    if scores.ndim != 2 or scores.shape[0] == 0:
        return np.full(c, DEFAULT_THRESHOLD, np.float32)
    s, _, tp, is_end, _ = _sorted_runs(scores, targets)
    positives = tp[-1]
    predicted = np.arange(1, s.shape[0] + 1)[:, None]
    f1 = np.where(is_end, 2.0 * tp / (predicted + positives), -1.0)  # only where a threshold ends
    best = f1.argmax(0)  # the first (highest) threshold on a tie
    cols = np.arange(c)
    lowest_in = s[best, cols]
    next_lower = s[np.minimum(best + 1, s.shape[0] - 1), cols]
    halfway = ((lowest_in + next_lower) / 2).astype(np.float32)
    # adjacent float32 scores: the halfway point may round down onto the next lower one
    threshold = np.where((best + 1 < s.shape[0]) & (halfway > next_lower), halfway, lowest_in)
    return np.where(positives > 0, threshold, DEFAULT_THRESHOLD).astype(np.float32)


def label_counts(scores, targets, thresholds) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """int64 [C] true positives, false positives, false negatives of "score >= threshold"."""
    predicted = np.asarray(scores) >= np.asarray(thresholds, np.float64)
    actual = np.asarray(targets).astype(bool)
    return ((predicted & actual).sum(0), (predicted & ~actual).sum(0), (~predicted & actual).sum(0))


def set_scores(scores, targets, thresholds) -> dict:
    """The thresholded prediction's figures (module docstring): ``precision``, ``recall``, ``f1``,
    ``support`` (float/int [C]), ``f1_micro``, ``f1_macro``, ``exact_match``, ``hamming_loss``."""
    from imgtrain.inference.metrics import class_scores

    scores, targets = np.asarray(scores), np.asarray(targets).astype(bool)
    predicted = scores >= np.asarray(thresholds, np.float64)
    tp, fp, fn = label_counts(scores, targets, thresholds)
    precision, recall, f1, support = class_scores(tp, fp, fn)
    seen = (tp + fp + fn) > 0
    all_tp, wrong = int(tp.sum()), int(fp.sum() + fn.sum())
    n = max(len(scores), 1)
    return {
        "precision": precision, "recall": recall, "f1": f1, "support": support,
        "f1_micro": 2 * all_tp / (2 * all_tp + wrong) if all_tp + wrong else 0.0,
        "f1_macro": float(f1[seen].mean()) if seen.any() else 0.0,
        "exact_match": float((predicted == targets).all(1).sum() / n),
        "hamming_loss": float(wrong / max(targets.size, 1)),
    }
