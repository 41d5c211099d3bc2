"""Metrics and input conversion used by evaluate and predict (no Ray, no checkpoint)."""

from __future__ import annotations

import json
import time
import tracemalloc

import numpy as np
import pytest
from PIL import Image

from imgtrain.errors import ImgtrainError
from imgtrain.inference.batch import (
    DENSE_CONFUSION_MAX_CLASSES,
    InferenceOptions,
    confusion_counts,
    confusion_json,
    per_class_scores,
)
from imgtrain.inference.inputs import ERROR_KEY, conform
from tests.conftest_data_helpers import read_inputs_whole


def test_confusion_matrix_rows_are_true_classes():
    labels = np.array([0, 0, 1, 2, 2, 2])
    preds = np.array([0, 1, 1, 2, 2, 0])
    counts = confusion_counts(labels, preds, 3)
    assert counts.tolist() == [[0, 0, 1], [0, 1, 1], [1, 1, 1], [2, 0, 1], [2, 2, 2]]  # pairs that occur
    assert confusion_json(counts, 3) == [[1, 1, 0], [0, 1, 0], [1, 0, 2]]  # dense, as it always was


def test_the_confusion_of_many_classes_costs_what_is_evaluated_not_k_squared():
    # A checkpoint's class count is its owner's choice, up to limits.MAX_CLASSES: dense, its
    # confusion matrix was 80 GB. 5,000 samples must cost about 5,000 samples.
    k, rng = 100_000, np.random.default_rng(0)
    labels = rng.integers(0, k, 5_000)
    preds = np.where(rng.random(5_000) < 0.5, labels, rng.integers(0, k, 5_000))
    tracemalloc.start()
    started = time.monotonic()
    try:
        counts = confusion_counts(labels, preds, k)
        cm = confusion_json(counts, k)
        scores = per_class_scores(counts, [f"c{i}" for i in range(k)])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.monotonic() - started < 10 and peak < 50 << 20, peak
    assert cm["shape"] == [k, k] and sum(n for _, _, n in cm["entries"]) == 5_000
    assert json.loads(json.dumps(cm)) == cm  # what evaluate --json prints
    first = cm["entries"][0]
    assert first == [int(labels.min()), int(preds[labels == labels.min()][0]), 1]
    assert sum(s["support"] for s in scores.values()) == 5_000
    assert confusion_json(confusion_counts(labels % 7, preds % 7, DENSE_CONFUSION_MAX_CLASSES), 1_000)[6][6] > 0


def test_per_class_scores_match_hand_computed_values():
    cm = confusion_counts(np.array([0, 0, 1, 2, 2, 2]), np.array([0, 1, 1, 2, 2, 0]), 3)
    scores = per_class_scores(cm, ["a", "b", "c"])
    assert scores["a"] == {"precision": 0.5, "recall": 0.5, "f1": 0.5, "support": 2}
    assert scores["b"]["precision"] == 0.5 and scores["b"]["recall"] == 1.0
    assert scores["b"]["f1"] == pytest.approx(2 / 3)
    assert scores["c"]["precision"] == 1.0 and scores["c"]["recall"] == pytest.approx(2 / 3)
    # A class never predicted and never present scores 0, not NaN.
    empty = per_class_scores(confusion_counts(np.zeros(0, int), np.zeros(0, int), 2), ["x", "y"])
    assert empty["x"] == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "support": 0}


def test_conform_converts_colour_and_size_like_pil():
    rgb = np.zeros((2, 56, 56, 3), np.uint8)
    rgb[:, 10:40, 10:40] = (255, 255, 255)
    out, converted = conform(rgb, (28, 28, 1))
    assert out.shape == (2, 28, 28, 1) and converted == 2
    assert out[0, 12, 12, 0] == 255 and out[0, 0, 0, 0] == 0
    same, converted = conform(out, (28, 28, 1))
    assert same is out and converted == 0


def test_read_inputs_single_image_and_glob(tmp_path):
    Image.fromarray(np.full((28, 28), 200, np.uint8)).save(tmp_path / "a.png")
    Image.fromarray(np.full((30, 20, 3), 50, np.uint8)).save(tmp_path / "b.png")
    one = read_inputs_whole(str(tmp_path / "a.png"), (28, 28, 1))
    assert one["image"].shape == (1, 28, 28, 1) and one["_converted"].sum() == 0 and one["image"].max() == 200
    both = read_inputs_whole(str(tmp_path / "*.png"), (28, 28, 1))
    assert [p.rsplit("/", 1)[1] for p in both["path"]] == ["a.png", "b.png"]
    assert both["_converted"].sum() == 1 and both["image"].shape == (2, 28, 28, 1)
    assert list(both[ERROR_KEY]) == ["", ""] and list(both["_row"]) == [0, 1]


def test_photos_are_centre_cropped_as_validation_saw_them():
    wide = np.zeros((1, 40, 80, 3), np.uint8)
    wide[:, :, 35:45] = 255  # a white stripe in the middle, black margins far left and right
    out, converted = conform(wide, (32, 32, 3), preset="photos")
    assert out.shape == (1, 32, 32, 3) and converted == 1
    assert out[0, 16, 16].tolist() == [255, 255, 255] and out[0, 16, 0].tolist() == [0, 0, 0]


def test_inference_options_report_every_problem():
    with pytest.raises(ImgtrainError) as e:
        InferenceOptions(backend="gpu", batch_size=0, concurrency=0, top_k=0).validate()
    for fragment in ("backend", "batch size", "concurrency", "top-k"):
        assert fragment in str(e.value)
