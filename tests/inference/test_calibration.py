"""Temperature scaling, the out-of-distribution scores and the stored calibration, as pure
functions and files (no training): the fitting, each score against values worked out by hand,
``--reject auto``'s threshold keeping 95 %, AUROC and FPR95 against scikit-learn's, and
``calibrated.pt`` verified like every other file of a checkpoint."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from imgtrain.errors import ImgtrainError
from imgtrain.inference import ood, temperature
from imgtrain.storage import checkpoint as ckpt


def test_the_fitted_temperature_is_the_one_the_labels_were_drawn_at():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 4, size=(2000, 10))
    scaled = np.exp(temperature.log_probabilities(logits, 2.5))  # the labels follow softmax(logits / 2.5)
    labels = (rng.random((2000, 1)) < scaled.cumsum(axis=1)).argmax(axis=1)  # one draw per row
    t = temperature.fit_temperature(logits, labels)
    assert abs(t - 2.5) < 0.25
    assert temperature.nll(logits, labels, t) < temperature.nll(logits, labels) - 0.1
    assert temperature.ece(logits, labels, t) < temperature.ece(logits, labels) / 2


def test_nll_and_ece_by_hand():
    logits = np.log([[1.0, 3.0], [1.0, 1.0]])  # probabilities 0.25/0.75 and 0.5/0.5
    labels = np.array([1, 1])
    assert temperature.nll(logits, labels) == pytest.approx(-(math.log(0.75) + math.log(0.5)) / 2)
    # bins (11/15, 12/15] and (7/15, 8/15]: one right at 0.75, one wrong at 0.5 (the tie's argmax is 0)
    assert temperature.ece(logits, labels) == pytest.approx((abs(1 - 0.75) + abs(0 - 0.5)) / 2)
    # T = 2: p = 3^0.5 / (1 + 3^0.5) for the first image
    p = math.sqrt(3) / (1 + math.sqrt(3))
    assert temperature.nll(logits, labels, 2.0) == pytest.approx(-(math.log(p) + math.log(0.5)) / 2)


def test_each_score_against_its_value_by_hand():
    logits = np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    e = math.e
    assert ood.scores(logits, "energy") == pytest.approx([math.log(e + e**2 + e**3), math.log(3)])
    assert ood.scores(logits, "max-logit") == pytest.approx([3.0, 0.0])
    assert ood.scores(logits, "max-softmax") == pytest.approx([e**3 / (e + e**2 + e**3), 1 / 3])
    # max-softmax takes the calibration's temperature: softmax(f / 2)
    assert ood.scores(logits, "max-softmax", 2.0)[0] == pytest.approx(e**1.5 / (e**0.5 + e + e**1.5))
    assert ood.scores(np.array([[1000.0, 999.0]]), "energy")[0] == pytest.approx(1000 + math.log(1 + 1 / e))
    assert [ood.column(m) for m in ood.METHODS] == ["ood_energy", "ood_max_logit", "ood_max_softmax", "ood_mahalanobis"]


@pytest.mark.parametrize("n", [7, 20, 100, 1001])
def test_the_auto_threshold_keeps_95_percent(n):
    values = np.random.default_rng(n).normal(size=n)
    t = ood.keep_threshold(values)
    kept = int((values >= t).sum())
    assert kept == math.ceil(0.95 * n)  # at least 95 %, and no threshold above keeps that many
    assert (values > t).sum() < 0.95 * n


def test_auroc_and_fpr95_are_scikit_learns():
    from sklearn.metrics import roc_auc_score, roc_curve

    rng = np.random.default_rng(1)
    inside = np.round(rng.normal(1, 1, 300), 1)  # rounded: ties, which count half
    outside = np.round(rng.normal(0, 1, 200), 1)
    truth = np.r_[np.ones(300), np.zeros(200)]
    assert ood.auroc(inside, outside) == pytest.approx(roc_auc_score(truth, np.r_[inside, outside]))
    fpr, tpr, _ = roc_curve(truth, np.r_[inside, outside])
    assert ood.fpr_at_tpr(inside, outside) == pytest.approx(fpr[np.searchsorted(tpr, 0.95)])
    assert ood.auroc([2, 3], [0, 1]) == 1.0 and ood.fpr_at_tpr([2, 3], [0, 1]) == 0.0


def test_reject_takes_auto_or_a_number_and_says_so_in_one_line_otherwise():
    assert ood.parse_reject(None) is None and ood.parse_reject("auto") == "auto"
    assert ood.parse_reject("-3.5") == -3.5
    for bad in ("often", "nan", "inf", ""):
        with pytest.raises(ImgtrainError) as refused:
            ood.parse_reject(bad)
        assert "\n" not in str(refused.value) and "--reject must be auto or a number" in str(refused.value)
    with pytest.raises(ImgtrainError, match="--ood-score must be one of energy, max-logit, max-softmax"):
        ood.check_method("entropy")


PAYLOAD = {"temperature": 1.7, "fitted_on": "val", "images": 10, "nll": [0.5, 0.4], "ece": [0.1, 0.02],
           "ood_keep": 0.95, "ood_thresholds": {"energy": 3.0, "max-logit": 2.5, "max-softmax": 0.6}}


@pytest.fixture
def checkpoint_dir(tmp_path):
    import torch

    return ckpt.save(tmp_path / "checkpoint_epoch_0000", {"w": torch.zeros(2)}, {"epoch": 0}, {"epoch": 0})


def test_the_stored_calibration_is_verified_with_the_checkpoint(checkpoint_dir):
    from imgtrain.inference.calibration_record import Calibration

    assert ckpt.load_calibration(checkpoint_dir) is None
    ckpt.add_file(checkpoint_dir, ckpt.CALIBRATION_FILE, PAYLOAD)
    meta = ckpt.verify(checkpoint_dir)
    assert ckpt.CALIBRATION_FILE in meta["sha256"]
    loaded = Calibration.from_file(ckpt.load_calibration(checkpoint_dir))
    assert loaded.temperature == 1.7 and loaded.ood_thresholds["energy"] == 3.0 and loaded.nll == (0.5, 0.4)
    assert "T = 1.7000, fitted on 10 val images: NLL 0.5000 -> 0.4000" in loaded.line()

    (checkpoint_dir / ckpt.CALIBRATION_FILE).write_bytes(b"changed")
    with pytest.raises(ckpt.CheckpointError, match="calibrated.pt fails its sha256 check"):
        ckpt.verify(checkpoint_dir)


def test_a_calibration_file_the_table_does_not_list_is_not_read(checkpoint_dir):
    import torch

    torch.save(PAYLOAD, checkpoint_dir / ckpt.CALIBRATION_FILE)  # dropped in: never verified, never used
    assert ckpt.load_calibration(checkpoint_dir) is None


@pytest.mark.parametrize("bad", [{**PAYLOAD, "temperature": -1.0}, {**PAYLOAD, "temperature": float("nan")},
                                 {**PAYLOAD, "ood_thresholds": {"energy": "high"}}, [1, 2]])
def test_a_calibration_out_of_bounds_is_refused_in_one_line(checkpoint_dir, bad):
    ckpt.add_file(checkpoint_dir, ckpt.CALIBRATION_FILE, bad)
    with pytest.raises(ckpt.CheckpointError) as refused:
        ckpt.load_calibration(checkpoint_dir)
    assert "does not hold a temperature above 0" in str(refused.value) and "\n" not in str(refused.value)


def test_a_calibration_file_holding_an_object_is_refused(checkpoint_dir):
    from pathlib import PurePosixPath

    import torch

    torch.save({**PAYLOAD, "x": PurePosixPath("/etc")}, checkpoint_dir / "object.pt")  # an object, not plain data
    (checkpoint_dir / "object.pt").replace(checkpoint_dir / ckpt.CALIBRATION_FILE)
    meta = ckpt.read_meta(checkpoint_dir)
    meta["sha256"][ckpt.CALIBRATION_FILE] = "x"
    (checkpoint_dir / ckpt.META_FILE).write_text(json.dumps(meta))
    with pytest.raises(ckpt.CheckpointError, match="refusing to load"):
        ckpt.load_calibration(checkpoint_dir)


def test_a_multi_label_model_or_a_data_set_without_val_gets_no_calibration_in_one_line():
    from imgtrain.inference.calibrate import NotFitted, check_fittable

    with pytest.raises(NotFitted, match="not fitted for a multi-label model"):
        check_fittable(None, {"multi_label": True, "splits": {"val": {"num_samples": 10}}}, "d")
    with pytest.raises(NotFitted, match="d has no validation split, so nothing was fitted"):
        check_fittable(None, {"splits": {"train": {"num_samples": 10}, "test": {"num_samples": 5}}}, "d")
    check_fittable(None, {"splits": {"val": {"num_samples": 10}}}, "d")  # fittable: no error


def test_mahalanobis_scores_the_distance_to_the_nearest_class_mean():
    rng = np.random.default_rng(0)
    features = np.r_[rng.normal(0, 1, (200, 3)), rng.normal(10, 1, (200, 3))]
    labels = np.r_[np.zeros(200, int), np.ones(200, int)]
    fitted = ood.fit_mahalanobis(features, labels, shrink=0.0)
    cov = np.cov(np.r_[features[:200] - features[:200].mean(0), features[200:] - features[200:].mean(0)].T, bias=True)
    probe = np.array([[1.0, 2.0, 0.5], [10.0, 10.0, 10.0]])
    d = probe[0] - features[:200].mean(0)  # the first probe's nearest class: 0
    assert ood.scores(None, "mahalanobis", features=probe, fitted=fitted)[0] == pytest.approx(-d @ np.linalg.inv(cov) @ d,
                                                                                             rel=1e-4)
    far = ood.scores(None, "mahalanobis", features=np.array([[5.0, 5.0, 5.0]]), fitted=fitted)
    assert far[0] < ood.scores(None, "mahalanobis", features=probe, fitted=fitted).min()
    with pytest.raises(ImgtrainError, match="needs the class means"):
        ood.scores(None, "mahalanobis", features=probe)
