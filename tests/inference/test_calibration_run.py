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

import numpy as np
import pytest

from imgtrain.inference.options import InferenceOptions
from imgtrain.storage import checkpoint as ckpt
from tests.conftest import assert_one_line_error, cli_here, copy_run
from tests.ports import unused_port

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


@pytest.fixture(scope="module")
def onnx_export(calibrated, tmp_path_factory):
    """The calibrated run's ONNX export (verified on the test split)."""
    import imgtrain

    storage, name, _ = calibrated
    out = tmp_path_factory.mktemp("calibrated-onnx") / "onnx"
    assert imgtrain.export(str(storage / name), "onnx", out).verification.passed
    return out


@pytest.mark.integration  # an ONNX export, verified on the test split
def test_the_onnx_export_divides_the_logits_by_the_temperature(calibrated, onnx_export, held_out):
    from imgtrain.data.format import read_split
    from imgtrain.inference.predictor import Predictor

    storage, name, found = calibrated
    out = onnx_export
    record = json.loads((out / "imgtrain.json").read_text())
    assert record["temperature"] == pytest.approx(found["temperature"])
    logit_scores = {m: found["ood_thresholds"][m] for m in ("energy", "max-logit", "max-softmax")}
    assert record["ood"] == {"method": "max-softmax", "keep": 0.95, "threshold": found["ood_thresholds"]["max-softmax"],
                             "thresholds": logit_scores}
    assert f"T = {found['temperature']:.4f}" in (out / "MODEL_CARD.md").read_text()
    _, images, _ = read_split(held_out, "test")
    calibrated_model, onnx = Predictor(found["checkpoint"]), Predictor(out, engine="onnxruntime")
    probs, logits, _ = calibrated_model._forward(images[:50])
    assert np.abs(onnx.predict_proba(images[:50]) - probs).max() < 1e-4
    plain = np.exp(logits - logits.max(1, keepdims=True))
    assert np.abs(plain / plain.sum(1, keepdims=True) - probs).max() > 0.01  # T did change them
    # mahalanobis needs the features, which no export outputs: its engine scores by the calibrated softmax
    assert Predictor(out, engine="onnxruntime", ood_score="mahalanobis").ood_score == "max-softmax"


@pytest.mark.integration
def test_the_onnx_export_scores_as_the_checkpoint_does(calibrated, onnx_export, held_out, photo_crops, tmp_path):
    """The export's second output, the logits: its engine's energy and max-logit are the
    checkpoint's (float32 kernels differ between ONNX Runtime and PyTorch, and between CPUs: close,
    not bit-equal), and --reject auto takes the threshold calibration stored for that score.
    An export made before that output keeps working, scored by its calibrated softmax."""
    import imgtrain
    from imgtrain.data.format import read_split
    from imgtrain.inference.predictor import Predictor, rejection

    from imgtrain.inference import ood

    _, _, found = calibrated
    _, images, _ = read_split(held_out, "test")
    record = json.loads((onnx_export / "imgtrain.json").read_text())
    _, logits, _ = Predictor(found["checkpoint"])._forward(images[:50])  # the checkpoint's own
    exported = Predictor(onnx_export, engine="onnxruntime")
    for method in ("energy", "max-logit", "max-softmax"):
        onnx = Predictor(exported.loaded, ood_score=method)
        assert onnx.ood_score == method
        np.testing.assert_allclose(onnx.predict_with_scores(images[:50])[1],
                                   ood.scores(logits, method, found["temperature"]), rtol=1e-4, atol=1e-4,
                                   err_msg=method)
        assert rejection(onnx_export, record, method, "auto") == found["ood_thresholds"][method]
    options = InferenceOptions(backend="local", engine="onnxruntime")  # the default score: energy
    crops = imgtrain.predict(str(onnx_export), str(photo_crops), tmp_path / "crops.csv", reject="auto",
                             options=options)
    assert crops.ood_score == "energy" and "ood_energy" in crops.predictions.columns
    assert crops.threshold == found["ood_thresholds"]["energy"]

    old = _without_logits(onnx_export, tmp_path / "old")
    before = Predictor(old, engine="onnxruntime", ood_score="energy")
    assert before.ood_score == "max-softmax"
    probs, scores = before.predict_with_scores(images[:50])
    assert np.allclose(scores, probs.max(1)) and np.allclose(probs, exported.predict_proba(images[:50]))
    assert rejection(old, json.loads((old / "imgtrain.json").read_text()), "max-softmax", "auto") == \
        found["ood_thresholds"]["max-softmax"]


def _without_logits(export, folder):
    """A copy of ``export`` as imgtrain wrote exports before the logits output: the probabilities
    alone, and a record without "outputs" and with max-softmax's threshold only."""
    import shutil

    import onnx

    from imgtrain.ops.files import sha256_file

    shutil.copytree(export, folder)
    model = onnx.load(str(folder / "model.onnx"))
    kept = [o for o in model.graph.output if o.name == "probabilities"]
    del model.graph.output[:]
    model.graph.output.extend(kept)
    onnx.save(model, str(folder / "model.onnx"))
    record = json.loads((folder / "imgtrain.json").read_text())
    del record["outputs"], record["ood"]["thresholds"]
    record["sha256"]["model.onnx"] = sha256_file(folder / "model.onnx")
    (folder / "imgtrain.json").write_text(json.dumps(record))
    return folder


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
    port = str(unused_port())  # a port serve's own check finds free
    serve = cli_here(capsys, "serve", local_run.name, "--storage", str(storage), "--port", port, "--reject", "auto")
    assert_one_line_error(serve, "--reject auto", "imgtrain calibrate")  # before Ray starts
    shown = cli_here(capsys, "evaluate", local_run.name, "--storage", str(storage), "--backend", "local")
    assert shown.returncode == 0 and "no temperature scaling: this checkpoint has none" in shown.stdout


def test_calibrate_stores_the_calibration_in_a_run_in_a_bucket(local_run, held_out, s3_server, tmp_path, capsys):
    """``imgtrain calibrate`` of a run in an object store (a copy of local_run put in the real S3
    server): refused while a driver elsewhere trains it, then fitted on one machine and found,
    with its sha256 in the checkpoint's meta.json, by another."""
    import io
    import time

    import pyarrow.fs as pafs
    import torch

    from tests.integration.test_s3 import BUCKET, bucket, machine, objects, on_machine, read_object, write_object

    name, best, prefix = local_run.name, local_run.best_checkpoint.name, "calibrated-runs"
    runs_uri = f"s3://{BUCKET}/{prefix}"
    run_dir = copy_run(local_run, tmp_path) / name
    _drop_train_state(run_dir / best)
    pafs.copy_files(str(run_dir), f"{BUCKET}/{prefix}/{name}",
                    source_filesystem=pafs.LocalFileSystem(), destination_filesystem=bucket(s3_server))
    status = read_object(s3_server, f"{prefix}/{name}/status.json")
    calibrate = ("calibrate", name, "--storage", runs_uri, "--data", str(held_out), "--json")
    with on_machine(machine(s3_server, tmp_path, "calibrator")):
        driver = {"host": "another-machine", "pid": 4242}
        write_object(s3_server, f"{prefix}/{name}/status.json", {**status, **driver, "status": "running"})
        write_object(s3_server, f"{prefix}/{name}/heartbeat.json", {**driver, "time": time.time()})
        assert_one_line_error(cli_here(capsys, *calibrate), "is being trained right now by process 4242")
        assert f"{best}/calibrated.pt" not in objects(s3_server, f"{prefix}/{name}")
        write_object(s3_server, f"{prefix}/{name}/status.json", status)  # that driver is done
        write_object(s3_server, f"{prefix}/{name}/heartbeat.json", {**driver, "time": time.time(), "released": True})
        done = cli_here(capsys, *calibrate)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["checkpoint"] == f"{runs_uri}/{name}/{best}" and found["fitted_on"] == "val"
    meta = read_object(s3_server, f"{prefix}/{name}/{best}/meta.json")
    assert ckpt.CALIBRATION_FILE in meta["sha256"] and f"{best}/calibrated.pt" in objects(s3_server, f"{prefix}/{name}")
    with bucket(s3_server).open_input_stream(f"{BUCKET}/{prefix}/{name}/{best}/{ckpt.CALIBRATION_FILE}") as f:
        stored = torch.load(io.BytesIO(f.read()), weights_only=True)
    assert stored["temperature"] == pytest.approx(found["temperature"])


def _drop_train_state(checkpoint) -> None:
    """An empty train_state.pt, its sha256 recorded: the optimizer state (129 MB of local_run's
    171 MB checkpoint) is not what calibration reads, and the test S3 server moves it slowly."""
    import torch

    from imgtrain.ops.files import sha256_file

    torch.save({}, checkpoint / ckpt.TRAIN_STATE_FILE)
    meta = ckpt.read_meta(checkpoint)
    meta["sha256"][ckpt.TRAIN_STATE_FILE] = sha256_file(checkpoint / ckpt.TRAIN_STATE_FILE)
    (checkpoint / ckpt.META_FILE).write_text(json.dumps(meta))
