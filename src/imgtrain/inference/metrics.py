"""``evaluate``'s figures, summed batch by batch (``EvalSums.add``): accuracy, top-5 accuracy,
per-class, macro and weighted precision/recall/F1, and the expected calibration error with its
reliability bins. What is kept is O(classes + bins): per-class counts of true positives, false
positives and false negatives, and per-bin sums, never the predictions and never a K x K table
(up to limits.MAX_CLASSES = 100,000 classes).

Definitions (the tests hold them to scikit-learn's):

- top-5 accuracy: the true class is among the 5 most probable (``top_k_accuracy_score(k=5)``);
  only with 6 or more classes, where it can differ from 1 (``None`` otherwise: "n/a").
- precision, recall, F1 per class with ``zero_division=0``: a class never predicted has precision
  0, a class never present recall 0. Macro: the unweighted mean over the classes that are present
  or predicted (scikit-learn's default ``labels``: a class absent from both has no score to
  average); weighted: the mean weighted by each class's number of true samples
  (``precision_recall_fscore_support(average="macro" | "weighted", zero_division=0)``).
- expected calibration error (Guo et al., 2017): the confidence (the top class's probability) is
  put into 15 equal-width bins (lower, upper] over [0, 1]; ECE = sum over bins of
  (bin count / n) * |accuracy in the bin - mean confidence in the bin|.
"""

from __future__ import annotations

import numpy as np

TOP_K = 5  # top-5 accuracy
ECE_BINS = 15  # equal-width confidence bins, the usual count (Guo et al., 2017)


class EvalSums:
    """Running sums over the evaluated batches, for ``num_classes`` classes."""

    def __init__(self, num_classes: int, bins: int = ECE_BINS):
        self.k, self.bins, self.n, self.top_hits = num_classes, bins, 0, 0
        self.tp, self.fp, self.fn = (np.zeros(num_classes, np.int64) for _ in range(3))
        self.bin_count = np.zeros(bins, np.int64)
        self.bin_confidence = np.zeros(bins, np.float64)  # sum of the confidences in each bin
        self.bin_correct = np.zeros(bins, np.int64)

    def add(self, labels, top, confidence) -> None:
        """One batch: ``labels`` int [B]; ``top`` int [B, k'] the most probable classes first
        (k' >= min(TOP_K, num_classes)); ``confidence`` float [B], the first one's probability."""
        labels, top = np.asarray(labels, np.int64), np.asarray(top, np.int64)
        top = top[:, None] if top.ndim == 1 else top
        confidence = np.asarray(confidence, np.float64)
        preds, hit = top[:, 0], top[:, 0] == labels
        self.n += len(labels)
        self.top_hits += int((top[:, :TOP_K] == labels[:, None]).any(axis=1).sum())
        self.tp += np.bincount(labels[hit], minlength=self.k)
        self.fp += np.bincount(preds[~hit], minlength=self.k)
        self.fn += np.bincount(labels[~hit], minlength=self.k)
        # bin m (0-based) holds (m/M, (m+1)/M]; a confidence of exactly 0 joins the first
        which = np.clip(np.ceil(confidence * self.bins).astype(np.int64) - 1, 0, self.bins - 1)
        self.bin_count += np.bincount(which, minlength=self.bins)
        self.bin_confidence += np.bincount(which, confidence, minlength=self.bins)
        self.bin_correct += np.bincount(which[hit], minlength=self.bins)

    # ------------------------------------------------------------ what the sums give

    @property
    def accuracy(self) -> float:
        return float(self.tp.sum() / max(self.n, 1))

    @property
    def top5_accuracy(self) -> float | None:
        """None with fewer than TOP_K + 1 classes: every prediction would be a hit."""
        return self.top_hits / max(self.n, 1) if self.k > TOP_K else None

    def class_scores(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """float [K] precision, recall, F1 and int [K] support, 0 where undefined."""
        return class_scores(self.tp, self.fp, self.fn)

    def averages(self) -> dict[str, dict[str, float]]:
        """``{"macro": {precision, recall, f1}, "weighted": {...}}`` (module docstring)."""
        precision, recall, f1, support = self.class_scores()
        seen = (self.tp + self.fp + self.fn) > 0  # present or predicted
        weights = support / max(support.sum(), 1)
        return {
            "macro": {name: float(v[seen].mean()) if seen.any() else 0.0
                      for name, v in (("precision", precision), ("recall", recall), ("f1", f1))},
            "weighted": {name: float((v * weights).sum())
                         for name, v in (("precision", precision), ("recall", recall), ("f1", f1))},
        }

    def calibration(self) -> list[dict]:
        """One entry per bin: its bounds, count, mean confidence and accuracy (None when empty)."""
        edges = np.linspace(0.0, 1.0, self.bins + 1)
        return [
            {"lower": float(edges[m]), "upper": float(edges[m + 1]), "count": int(c),
             "confidence": float(self.bin_confidence[m] / c) if c else None,
             "accuracy": float(self.bin_correct[m] / c) if c else None}
            for m, c in enumerate(self.bin_count)
        ]

    @property
    def ece(self) -> float:
        gaps = np.abs(self.bin_correct - self.bin_confidence)  # per bin: count * |accuracy - confidence|
        return float(gaps.sum() / max(self.n, 1))


def class_scores(tp, fp, fn) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Precision, recall, F1 (float [K], 0 where undefined) and support (int [K]) from counts."""
    tp, fp, fn = (np.asarray(a, np.float64) for a in (tp, fp, fn))
    predicted, actual = tp + fp, tp + fn
    precision = np.divide(tp, predicted, out=np.zeros_like(tp), where=predicted > 0)
    recall = np.divide(tp, actual, out=np.zeros_like(tp), where=actual > 0)
    denom = precision + recall
    f1 = np.divide(2 * precision * recall, denom, out=np.zeros_like(tp), where=denom > 0)
    return precision, recall, f1, actual.astype(np.int64)
