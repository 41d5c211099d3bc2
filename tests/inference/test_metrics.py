"""evaluate's figures from the batch sums (``inference/metrics.py``), held to scikit-learn's on a
fixed prediction set, and the calibration error to a hand computation (no model, no Ray)."""

from __future__ import annotations

import time
import tracemalloc

import numpy as np
import pytest
from sklearn.metrics import precision_recall_fscore_support, top_k_accuracy_score

from imgtrain.inference.metrics import ECE_BINS, EvalSums

K = 8
NEVER_PREDICTED, NEVER_PRESENT, NEITHER = 5, 6, 7


def fixed_predictions(n: int = 300, seed: int = 0):
    """(labels [n], probabilities [n, K]) with class 5 never the prediction (though often in the
    top 5), class 6 predicted but never the true class, class 7 neither; no ties."""
    rng = np.random.default_rng(seed)
    labels = rng.choice([0, 1, 2, 3, 4, 5], n)
    logits = rng.normal(size=(n, K))
    logits[np.arange(n), labels] += 1.5  # a model better than chance
    logits[:, NEITHER] -= 10
    others = np.delete(logits, NEVER_PREDICTED, axis=1).max(axis=1)
    logits[:, NEVER_PREDICTED] = others - 0.1 - rng.random(n)  # close behind the first, never it
    probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    return labels, probs


def summed(labels, probs, batch: int = 64) -> EvalSums:
    """The sums as evaluate makes them: batch by batch, from each row's 5 most probable classes."""
    sums = EvalSums(probs.shape[1])
    for i in range(0, len(labels), batch):
        p = probs[i:i + batch]
        top = np.argsort(-p, axis=1, kind="stable")[:, :5]  # as Predictor ranks them
        sums.add(labels[i:i + batch], top, p.max(axis=1))
    return sums


def test_top5_and_the_averaged_scores_match_scikit_learn_with_classes_never_predicted_or_present():
    labels, probs = fixed_predictions()
    preds = probs.argmax(axis=1)
    assert NEVER_PREDICTED in labels and NEVER_PREDICTED not in preds  # the set is what it claims
    assert NEVER_PRESENT in preds and NEVER_PRESENT not in labels
    assert NEITHER not in preds and NEITHER not in labels
    sums = summed(labels, probs)

    top5 = top_k_accuracy_score(labels, probs, k=5, labels=np.arange(K))
    assert 0.5 < top5 < 1  # not every row a hit: the comparison can fail
    assert sums.top5_accuracy == pytest.approx(top5, abs=1e-12)
    assert sums.accuracy == pytest.approx(np.mean(preds == labels), abs=1e-12)
    averages = sums.averages()
    for average in ("macro", "weighted"):
        # zero_division=0: the never-predicted class's precision and the never-present class's
        # recall count as 0; macro averages over the classes present or predicted (sklearn's
        # default labels), so class 7 (neither) is left out of it.
        p, r, f, _ = precision_recall_fscore_support(labels, preds, average=average, zero_division=0)
        assert averages[average] == pytest.approx({"precision": p, "recall": r, "f1": f}, abs=1e-12)
    p, r, f, support = precision_recall_fscore_support(labels, preds, labels=np.arange(K), zero_division=0)
    ours = sums.class_scores()
    for got, want in zip(ours, (p, r, f, support)):
        assert got == pytest.approx(want, abs=1e-12)
    assert ours[0][NEVER_PREDICTED] == 0 and ours[1][NEVER_PRESENT] == 0 and ours[1][NEVER_PREDICTED] == 0


def test_top5_is_not_given_for_five_classes_or_fewer():
    sums = EvalSums(5)
    sums.add([0, 1], [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4]], [0.9, 0.9])
    assert sums.top5_accuracy is None and sums.accuracy == 0.5
    six = EvalSums(6)
    six.add([5], [[0, 1, 2, 3, 4]], [0.5])  # the true class is the sixth: a miss
    assert six.top5_accuracy == 0.0


def test_expected_calibration_error_equals_the_hand_computed_value():
    # 15 bins of width 1/15, (lower, upper]: 0.95 -> (14/15, 1], 0.55 -> (8/15, 9/15], 0.3 -> (4/15, 5/15].
    confidence = [0.95, 0.95, 0.55, 0.55, 0.55, 0.3]
    correct = [True, False, True, True, False, True]
    labels = np.zeros(6, np.int64)
    sums = EvalSums(3)
    sums.add(labels, np.where(correct, 0, 1), confidence)
    # (2/6)|1/2 - 0.95| + (3/6)|2/3 - 0.55| + (1/6)|1 - 0.3| = 0.15 + 0.058333 + 0.116667
    assert sums.ece == pytest.approx(0.325, abs=1e-12)
    bins = sums.calibration()
    assert len(bins) == ECE_BINS and sum(b["count"] for b in bins) == 6
    assert bins[14] == pytest.approx({"lower": 14 / 15, "upper": 1.0, "count": 2, "confidence": 0.95, "accuracy": 0.5})
    assert bins[8]["count"] == 3 and bins[8]["accuracy"] == pytest.approx(2 / 3)
    assert bins[4]["count"] == 1 and bins[0] == {"lower": 0.0, "upper": 1 / 15, "count": 0, "confidence": None,
                                                 "accuracy": None}
    # A confidence of 1 is the last bin's (its upper edge is closed); a perfectly calibrated set scores 0.
    edge = EvalSums(2)
    edge.add([0, 0], [0, 0], [1.0, 1.0])
    assert edge.calibration()[-1]["count"] == 2 and edge.ece == 0.0


def test_the_sums_of_100000_classes_cost_the_classes_not_their_square():
    k, n, rng = 100_000, 5_000, np.random.default_rng(1)
    labels = rng.integers(0, k, n)
    top = rng.integers(0, k, (n, 5))
    top[: n // 2, 2] = labels[: n // 2]  # half of them hit in their third place
    tracemalloc.start()
    started = time.monotonic()
    try:
        sums = EvalSums(k)
        for i in range(0, n, 500):
            sums.add(labels[i:i + 500], top[i:i + 500], rng.random(500))
        averages, peak = sums.averages(), tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.monotonic() - started < 10 and peak < 50 << 20, peak
    assert sums.top5_accuracy >= 0.5 and 0 <= averages["macro"]["f1"] <= 1
