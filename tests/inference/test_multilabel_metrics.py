"""The multi-label figures (inference/multilabel_metrics.py) held to scikit-learn's: average
precision (ties included) and its macro mean, the F1-best threshold per label against a search
over every candidate, and the thresholded prediction's per-label, micro and macro scores,
exact-match ratio and Hamming loss."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import (
    accuracy_score,
    average_precision_score,
    f1_score,
    hamming_loss,
    precision_recall_fscore_support,
)

from imgtrain.inference import multilabel_metrics as mm


def sample(seed: int = 0, n: int = 120, c: int = 6):
    """Scores that follow the labels loosely, rounded so that many tie; the last label has no
    positive sample."""
    rng = np.random.default_rng(seed)
    targets = (rng.random((n, c)) < 0.3).astype(np.uint8)
    targets[:, -1] = 0
    scores = np.round(rng.random((n, c)) * 0.6 + targets * 0.3, 2).astype(np.float32)
    return scores, targets


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_average_precision_is_scikit_learns_with_ties_and_none_without_positives(seed):
    scores, targets = sample(seed)
    ap = mm.average_precision(scores, targets)
    expected = [average_precision_score(targets[:, c], scores[:, c]) for c in range(scores.shape[1] - 1)]
    assert ap[:-1] == pytest.approx(expected, abs=1e-12)
    assert np.isnan(ap[-1])
    assert mm.mean_average_precision(ap) == pytest.approx(np.mean(expected), abs=1e-12)


def test_average_precision_by_hand():
    # scores 0.9 (pos), 0.8 (neg), 0.8 (pos), 0.1 (pos): thresholds 0.9 -> P 1, R 1/3; 0.8 (the tie
    # is one threshold) -> P 2/3, R 2/3; 0.1 -> P 3/4, R 1. AP = 1/3 + 1/3 * 2/3 + 1/3 * 3/4
    scores = np.array([[0.9], [0.8], [0.8], [0.1]], np.float32)
    targets = np.array([[1], [0], [1], [1]])
    assert mm.average_precision(scores, targets)[0] == pytest.approx(1 / 3 + 2 / 9 + 1 / 4)
    assert mm.mean_average_precision(np.array([np.nan, np.nan])) == 0.0


@pytest.mark.parametrize("seed", [0, 3])
def test_each_threshold_is_the_f1_best_one_and_labels_without_positives_keep_a_half(seed):
    scores, targets = sample(seed)
    thresholds = mm.best_f1_thresholds(scores, targets)
    assert thresholds.dtype == np.float32 and thresholds[-1] == mm.DEFAULT_THRESHOLD
    for c in range(scores.shape[1] - 1):
        best = max(f1_score(targets[:, c], scores[:, c] >= s) for s in np.unique(scores[:, c]))
        assert f1_score(targets[:, c], scores[:, c] >= thresholds[c]) == pytest.approx(best)
        # halfway between two scores: no score of the split sits on it
        assert not np.any(scores[:, c] == thresholds[c]) or thresholds[c] == scores[:, c].min()


def test_the_threshold_by_hand():
    # positives at 0.9 and 0.7, a negative at 0.8 and 0.2: ">= 0.7" has F1 0.8 (2 TP, 1 FP), the best;
    # the threshold is halfway between 0.7 and the next lower score, 0.2
    scores = np.array([[0.9], [0.8], [0.7], [0.2]], np.float32)
    targets = np.array([[1], [0], [1], [0]])
    assert mm.best_f1_thresholds(scores, targets)[0] == pytest.approx(0.45)
    assert mm.best_f1_thresholds(np.zeros((0, 3), np.float32), np.zeros((0, 3))).tolist() == [0.5] * 3


def test_the_thresholded_scores_are_scikit_learns():
    scores, targets = sample(5)
    thresholds = mm.best_f1_thresholds(scores, targets)
    predicted = (scores >= thresholds).astype(np.uint8)
    got = mm.set_scores(scores, targets, thresholds)
    precision, recall, f1, support = precision_recall_fscore_support(targets, predicted, zero_division=0)
    assert got["precision"] == pytest.approx(precision) and got["recall"] == pytest.approx(recall)
    assert got["f1"] == pytest.approx(f1) and got["support"].tolist() == support.tolist()
    assert got["f1_micro"] == pytest.approx(f1_score(targets, predicted, average="micro"))
    seen = [c for c in range(targets.shape[1]) if targets[:, c].any() or predicted[:, c].any()]
    assert got["f1_macro"] == pytest.approx(f1_score(targets, predicted, average="macro", labels=seen))
    assert got["exact_match"] == pytest.approx(accuracy_score(targets, predicted))
    assert got["hamming_loss"] == pytest.approx(hamming_loss(targets, predicted))


def test_the_surest_wrong_labels_are_extra_ones_by_probability_and_missed_ones_by_its_complement():
    from imgtrain.inference.multilabel_eval import confident_wrong_labels

    scores = np.array([[0.95, 0.10, 0.60],   # label 0 extra (0.95); label 2 right
                       [0.40, 0.02, 0.70],   # label 1 missed (1 - 0.02 = 0.98); label 0 right at 0.4 < 0.5
                       [0.55, 0.80, 0.30]])  # label 0 extra (0.55), label 2 missed (0.70)
    targets = np.array([[0, 0, 1], [0, 1, 1], [0, 1, 1]], np.uint8)
    rows, labels, sure = confident_wrong_labels(scores, targets, np.array([0.5, 0.5, 0.5]), 3)
    assert rows.tolist() == [1, 0, 2] and labels.tolist() == [1, 0, 2]
    np.testing.assert_allclose(sure, [0.98, 0.95, 0.70])
    assert [len(a) for a in confident_wrong_labels(scores, scores >= 0.5, np.full(3, 0.5), 16)] == [0, 0, 0]
