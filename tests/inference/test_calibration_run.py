"""Calibration and rejection on a real run (issue 49), without training one more: a copy of the
shared ``local_run`` (its data set has no validation split: nothing was fitted at its end),
calibrated by ``imgtrain calibrate --data`` on a held-out set's val split (300 other training
images of the embedded sample) and measured on that set's test split (300 other test images),
which calibration never saw. Measured on this run: T = 1.20 (overconfident), test NLL 0.811 ->
0.796, ECE 0.060 -> 0.048; AUROC against photo crops 1.00 with the mahalanobis score, 0.26 with
energy (the logits say nothing useful about photos here: BENCHMARKS.md, bench/calibration_ood.py).
Fitting at the end of training is checked on test_recorded_validation's run, which has a val split."""

from __future__ import annotations

import asyncio
import json
import socket

import numpy as np
import pytest

from imgtrain.inference.options import InferenceOptions
from imgtrain.storage import checkpoint as ckpt
from tests.conftest import assert_one_line_error, cli_here, copy_run

LOCAL = InferenceOptions(backend="local")


@pytest.fixture(scope="module")
def held_out(sample_raw, tmp_path_factory):
    """local_run's training images (the sample's first 256: the class means' images), the sample's
    training images 256-555 as val and its test images 100-399 as test: none of these two in
    local_run's data set."""
    from imgtrain.data.raw import RawDataset, gather
    from imgtrain.data.writer import write_dataset

    rows = lambda s, a, b: gather(s.images, s.labels, s.ids, np.arange(a, b))  # noqa: E731
    out = tmp_path_factory.mktemp("held-out") / "held"
    write_dataset(RawDataset(sample_raw.classes, rows(sample_raw.train, 0, 256), rows(sample_raw.test, 100, 400),
                             val=rows(sample_raw.train, 256, 556)), out, name="held", source="mnist-sample")
    return out


@pytest.fixture(scope="module")
def calibrated(local_run, held_out, tmp_path_factory):
    """(storage, run name, ``calibrate``'s JSON) of a copy of local_run calibrated on held_out's val."""
    from imgtrain.inference.calibrate import calibrate

    storage = copy_run(local_run, tmp_path_factory.mktemp("calibrated"))
    return storage, local_run.name, calibrate(local_run.name, storage=str(storage), data=str(held_out)).to_json()


@pytest.fixture(scope="module")
def photo_crops(tmp_path_factory):
    """60 crops (64x64) of scikit-learn's two sample photos: images of none of the digits."""
    from PIL import Image
    from sklearn.datasets import load_sample_images

    folder = tmp_path_factory.mktemp("photo-crops")
    rng = np.random.default_rng(0)
    for p, photo in enumerate(load_sample_images().images):
        for k in range(30):
            y, x = rng.integers(0, photo.shape[0] - 64), rng.integers(0, photo.shape[1] - 64)
            Image.fromarray(photo[y:y + 64, x:x + 64]).save(folder / f"photo{p}-{k}.png")
    return folder


def test_calibrate_stores_what_it_fitted_on_the_val_split(calibrated, local_run):
    storage, name, found = calibrated
    best = storage / name / local_run.best_checkpoint.name
    assert found["checkpoint"] == str(best) and found["fitted_on"] == "val" and found["images"] == 300
    assert set(found["ood_thresholds"]) == {"energy", "max-logit", "max-softmax", "mahalanobis"}
    assert found["nll"]["after"] < found["nll"]["before"]
    assert ckpt.CALIBRATION_FILE in ckpt.verify(best)["sha256"]  # recorded, and verified with the rest


def test_calibration_lowers_nll_and_ece_on_a_test_split_it_never_saw(calibrated, held_out, capsys):
    storage, name, _ = calibrated
    proc = cli_here(capsys, "evaluate", name, "--storage", str(storage), "--data", str(held_out), "--backend",
                    "local", "--json")
    assert proc.returncode == 0, proc.stderr
    ev = json.loads(proc.stdout)
    scaling = ev["temperature_scaling"]
    assert ev["split"] == "test" and ev["num_samples"] == 300 and scaling["fitted_on"] == "val"
    assert scaling["temperature"] > 1.1  # overconfident: measured 1.20
    assert scaling["nll"]["after"] < scaling["nll"]["before"] - 0.005  # measured 0.811 -> 0.796
    assert scaling["ece"]["after"] < scaling["ece"]["before"] - 0.005  # measured 0.060 -> 0.048
    assert ev["ece"] == scaling["ece"]["after"] and ev["nll"] == pytest.approx(scaling["nll"]["after"])
    text = cli_here(capsys, "evaluate", name, "--storage", str(storage), "--data", str(held_out), "--backend", "local")
    assert f"temperature scaling T = {scaling['temperature']:.4f} (fitted on val split): test ECE " in text.stdout


def test_rejection_separates_photo_crops_from_the_test_split(calibrated, held_out, photo_crops, tmp_path):
    import imgtrain

    storage, name, _ = calibrated
    run = str(storage / name)
    features = InferenceOptions(backend="local", ood_score="mahalanobis")
    ev = imgtrain.evaluate(run, data=str(held_out), options=features, ood=str(photo_crops))
    assert ev.ood["method"] == "mahalanobis" and ev.ood["out_of_distribution"]["images"] == 60
    assert ev.ood["in_distribution"] == {"split": "test", "images": 300}
    assert ev.ood["auroc"] > 0.95 and ev.ood["fpr_at_95_tpr"] < 0.1  # measured 1.00 and 0.00

    # --reject auto: the threshold keeping 95 % of val turns the photos away, not the digits
    crops = imgtrain.predict(run, str(photo_crops), tmp_path / "crops.csv", reject="auto", options=features)
    rows = crops.predictions
    assert {"ood_mahalanobis", "rejected"} <= set(rows.columns) and crops.rejected == rows["rejected"].sum()
    assert rows["rejected"].mean() > 0.9 and (rows.loc[rows["rejected"], "pred_class"] == "unknown").all()
    assert (rows.loc[rows["rejected"], "pred_index"] == -1).all()
    digits = imgtrain.predict(run, str(held_out), tmp_path / "digits.csv", reject="auto", options=features)
    assert digits.predictions["rejected"].mean() < 0.2  # about the 5 % the threshold gives up on val
    energy = imgtrain.predict(run, str(photo_crops), tmp_path / "energy.csv", options=LOCAL).predictions
    assert "ood_energy" in energy.columns and "rejected" not in energy.columns  # the default score, no rejection


def test_serve_answers_the_score_and_unknown(calibrated, held_out, photo_crops):
    from PIL import Image

    from imgtrain.data.format import read_split
    from imgtrain.inference.options import Limits
    from imgtrain.inference.predictor import rejection
    from imgtrain.inference.routes import ModelServer

    storage, name, found = calibrated
    best = found["checkpoint"]
    threshold = rejection(best, ckpt.read_meta(best), "mahalanobis", "auto")
    assert threshold == found["ood_thresholds"]["mahalanobis"]
    written = next(c for c in ModelServer.func_or_class.__mro__[1:] if c.__name__ == "ModelServer")
    replica = written(best, Limits(), 1, False, "none", "torch", "mahalanobis", threshold)
    health = replica.healthz()
    assert health["ood"] == {"method": "mahalanobis", "threshold": threshold}
    assert health["temperature"] == found["temperature"]
    crop = np.asarray(Image.open(sorted(photo_crops.iterdir())[0]).convert("L").resize((28, 28)))
    _, images, labels = read_split(held_out, "test")
    right = next(i for i in range(len(labels)) if replica.predictor.predict_proba(images[i]).argmax() == labels[i])
    body = json.dumps({"images": [crop.tolist(), images[right][..., 0].tolist()]}).encode()
    photo, digit = asyncio.run(replica._answer(body, True))
    assert photo["label"] == "unknown" and photo["index"] == -1 and photo["ood"]["rejected"] is True
    assert photo["ood"]["score"] < threshold <= digit["ood"]["score"]
    assert digit["label"] == str(labels[right]) and digit["ood"] == {
        "method": "mahalanobis", "score": digit["ood"]["score"], "threshold": threshold, "rejected": False}


@pytest.mark.integration  # an ONNX export, verified on the test split
def test_the_onnx_export_divides_the_logits_by_the_temperature(calibrated, held_out, tmp_path):
    import imgtrain
    from imgtrain.data.format import read_split
    from imgtrain.inference.predictor import Predictor

    storage, name, found = calibrated
    out = tmp_path / "onnx"
    assert imgtrain.export(str(storage / name), "onnx", out).verification.passed
    record = json.loads((out / "imgtrain.json").read_text())
    assert record["temperature"] == pytest.approx(found["temperature"])
    assert record["ood"] == {"method": "max-softmax", "keep": 0.95, "threshold": found["ood_thresholds"]["max-softmax"]}
    assert f"T = {found['temperature']:.4f}" in (out / "MODEL_CARD.md").read_text()
    _, images, _ = read_split(held_out, "test")
    calibrated_model, onnx = Predictor(found["checkpoint"]), Predictor(out, engine="onnxruntime")
    probs, logits, _ = calibrated_model._forward(images[:50])
    assert np.abs(onnx.predict_proba(images[:50]) - probs).max() < 1e-4
    plain = np.exp(logits - logits.max(1, keepdims=True))
    assert np.abs(plain / plain.sum(1, keepdims=True) - probs).max() > 0.01  # T did change them
    # the export's engine scores by its calibrated softmax, whatever was asked; --reject auto takes its copy
    assert Predictor(out, engine="onnxruntime", ood_score="energy").ood_score == "max-softmax"
    assert np.allclose(onnx.predict_with_scores(images[:50])[1], probs.max(1), atol=1e-4)


def test_without_a_val_split_nothing_is_fitted_and_the_refusals_are_one_line(local_run, tmp_path, capsys):
    storage = copy_run(local_run, tmp_path)
    refused = cli_here(capsys, "calibrate", local_run.name, "--storage", str(storage))
    assert_one_line_error(refused, "has no validation split, so nothing was fitted")
    assert ckpt.load_calibration(storage / local_run.name / local_run.best_checkpoint.name) is None
    data, out = local_run.config["data"], str(tmp_path / "p.csv")
    predict = ("predict", local_run.name, data, "--out", out, "--storage", str(storage), "--backend", "local")
    assert_one_line_error(cli_here(capsys, *predict, "--reject", "auto"), "--reject auto", "imgtrain calibrate")
    assert_one_line_error(cli_here(capsys, *predict, "--reject", "often"), "--reject must be auto or a number")
    assert_one_line_error(cli_here(capsys, *predict, "--ood-score", "mahalanobis"),
                          "--ood-score mahalanobis needs the class means")
    with socket.socket() as free:  # a port serve's own check finds free
        free.bind(("127.0.0.1", 0))
        port = str(free.getsockname()[1])
    serve = cli_here(capsys, "serve", local_run.name, "--storage", str(storage), "--port", port, "--reject", "auto")
    assert_one_line_error(serve, "--reject auto", "imgtrain calibrate")  # before Ray starts
    shown = cli_here(capsys, "evaluate", local_run.name, "--storage", str(storage), "--backend", "local")
    assert shown.returncode == 0 and "no temperature scaling: this checkpoint has none" in shown.stdout
