"""What a multi-label model answers (``multilabel_answers.py``): the label set at the per-label
thresholds, ``predict``'s columns, ``serve``'s JSON, the data set's separator, an export's
thresholds held to their bounds; and a prepared multi-label data set read as ``predict``'s input
(its label sets carried as text). No model is trained here: tests/integration/test_multilabel.py
predicts, exports and serves a real multi-label run."""

from __future__ import annotations

import json

import numpy as np
import pytest

from imgtrain.data.format import DEFAULT_LABEL_SEP, label_separator
from imgtrain.errors import ImgtrainError
from imgtrain.inference import multilabel_answers as ml

CLASSES = ["cat", "dog", "tree"]
THRESHOLDS = np.asarray([0.5, 0.3, 0.9], np.float32)
PROBS = np.asarray([[0.5, 0.29, 0.95],  # cat at its threshold exactly: in; dog just under: out
                    [0.1, 0.2, 0.3],  # nothing over its threshold
                    [0.7, 0.8, 0.1]], np.float32)


def test_a_label_is_in_the_set_at_or_over_its_threshold():
    assert ml.decide(PROBS, THRESHOLDS).tolist() == [[True, False, True], [False, False, False], [True, True, False]]


def test_predict_writes_the_label_set_joined_by_the_separator_and_a_probability_per_class():
    out = ml.prediction_columns(PROBS, THRESHOLDS, CLASSES, ";")
    assert list(out) == ["labels", "prob_cat", "prob_dog", "prob_tree"]
    assert out["labels"].tolist() == ["cat;tree", "", "cat;dog"]  # class order, "" for no label
    assert np.array_equal(out["prob_dog"], PROBS[:, 1])


def test_repeated_class_names_keep_a_probability_column_each():
    assert ml.probability_columns(["a", "b", "a"]) == ["prob_a", "prob_b", "prob_a_2"]


def test_serve_answers_the_labels_over_their_thresholds_most_probable_first_and_every_probability():
    got = ml.answer(PROBS[2], THRESHOLDS, CLASSES)
    assert got["labels"] == [{"label": "dog", "probability": pytest.approx(0.8)},
                             {"label": "cat", "probability": pytest.approx(0.7)}]
    assert list(got["probabilities"]) == CLASSES and got["probabilities"]["tree"] == pytest.approx(0.1)
    assert ml.answer(PROBS[1], THRESHOLDS, CLASSES)["labels"] == []
    json.dumps(got)  # plain types only


@pytest.mark.parametrize("options, expected", [
    ({"label_sep": "|"}, "|"),
    ({"label_sep": ", "}, ", "),
    ({"label_sep": "\t"}, "\t"),
    ({}, DEFAULT_LABEL_SEP),  # prepared before the separator was recorded
    ({"label_sep": ""}, DEFAULT_LABEL_SEP),
    ({"label_sep": "\n"}, DEFAULT_LABEL_SEP),  # would start a new CSV row in a tool that does not quote
    ({"label_sep": "x" * 100}, DEFAULT_LABEL_SEP),
    ({"label_sep": 3}, DEFAULT_LABEL_SEP),
])
def test_the_separator_is_the_data_sets_own_held_to_a_short_line_of_text(options, expected):
    assert label_separator({"multi_label": True, "options": options}) == expected
    assert label_separator({"options": "not a table"}) == DEFAULT_LABEL_SEP


@pytest.mark.parametrize("values", [None, [0.5, 0.5], [0.5, 0.5, 1.5], [0.5, "0.5", 0.5], [0.5, True, 0.5]])
def test_an_exports_thresholds_out_of_bounds_are_refused_in_one_line(values, tmp_path):
    with pytest.raises(ImgtrainError, match="does not hold 3 thresholds between 0 and 1") as e:
        ml.export_thresholds({"thresholds": values}, 3, tmp_path)
    assert "\n" not in str(e.value)


def test_an_exports_thresholds_are_read_back_exactly():
    values, chosen_on = ml.export_thresholds({"thresholds": THRESHOLDS.tolist(), "thresholds_chosen_on": "val"},
                                             3, "x")
    assert values.dtype == np.float32 and np.array_equal(values, THRESHOLDS) and chosen_on == "val"
    assert ml.export_thresholds({"thresholds": [0, 1, 0.5], "thresholds_chosen_on": "<b>"}, 3, "x")[1] is None


@pytest.fixture(scope="module")
def grids(tmp_path_factory):
    """A small prepared multi-label set: 2x2 grids of scikit-learn digits, ``|`` between the labels."""
    import csv

    from imgtrain.data.options import PrepareOptions
    from imgtrain.data.prepare import prepare
    from tests.multilabel_digits import write_digit_grids

    folder = tmp_path_factory.mktemp("grids")
    table = write_digit_grids(folder / "source", count=40, seed=1)
    with open(table) as f:
        rows = list(csv.DictReader(f))
    piped = folder / "source" / "piped.csv"
    with open(piped, "w", newline="") as f:
        writer = csv.DictWriter(f, ["path", "labels", "split"])
        writer.writeheader()
        writer.writerows({**r, "labels": "|".join(r["labels"].split())} for r in rows)
    options = PrepareOptions(label_column="labels", multi_label=True, label_sep="|", split_column="split")
    manifest = prepare("list", folder / "prepared", str(piped), options)
    return folder / "prepared", manifest, {r["path"]: r["labels"].split() for r in rows}


def test_a_multi_label_data_set_is_read_as_predicts_input_with_its_label_sets_as_text(grids):
    """It failed: the reader was built for single-label shards ("lacks column(s) label")."""
    import pandas as pd

    from imgtrain.inference.inputs import list_inputs, read_task

    prepared, manifest, labels_of = grids
    assert label_separator(manifest) == "|"
    inputs = list_inputs(str(prepared), "test")
    assert inputs.columns == ("id", "true_labels")
    rows = [read_task({"task": [json.dumps(t)]}, tuple(manifest["image_shape"]), manifest["preset"])
            for t in inputs.tasks]
    got = [label for part in rows for label in part["true_labels"]]
    assert len(got) == inputs.total == manifest["splits"]["test"]["num_samples"]
    names = pd.read_parquet(prepared / "sources.parquet").set_index("id")["name"]
    ids = [i for part in rows for i in part["id"]]
    assert got == ["|".join(sorted(labels_of[names[i]], key=manifest["classes"].index)) for i in ids]
