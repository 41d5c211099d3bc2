"""Evaluate, predict and load_model on a real trained checkpoint, on a real Ray cluster."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image

import imgtrain
from imgtrain import checkpoint as ckpt
from imgtrain.config import TrainConfig
from imgtrain.data.format import read_split
from imgtrain.errors import ImgtrainError
from imgtrain.inference.batch import InferenceOptions, evaluate, predict
from imgtrain.inference.predictor import Predictor, load_model
from imgtrain.training.progress import TrainingDisplay
from tests.conftest import assert_one_line_error, run_cli

pytestmark = pytest.mark.integration

LOCAL = InferenceOptions(backend="local")


@pytest.fixture(scope="module")
def trained(ray_cluster, tiny_data, tmp_path_factory):
    """A 2-worker Ray Train run: validation split across ranks, the case evaluate must match."""
    storage = tmp_path_factory.mktemp("runs")
    cfg = TrainConfig(data=str(tiny_data), storage=str(storage), name="inf", workers=2, epochs=1,
                      batch_size=32, eval_batch_size=50)
    result = imgtrain.train(cfg, display=TrainingDisplay(quiet=True))
    return result, storage


def test_evaluate_on_ray_data_equals_the_accuracy_recorded_in_training(trained, ray_cluster):
    result, storage = trained
    ev = evaluate("inf", storage=str(storage), options=InferenceOptions(concurrency=2, batch_size=16))
    recorded = ckpt.read_meta(result.best_checkpoint)["metrics"]["val_accuracy"]
    assert ev.accuracy == recorded == ev.recorded_val_accuracy
    assert ev.num_samples == 100 and np.sum(ev.confusion_matrix) == 100
    assert sorted(ev.predictions["id"]) == sorted(read_split(result.config["data"], "test")[0])
    assert sum(s["support"] for s in ev.per_class.values()) == 100
    # The in-process path gives the very same predictions, row by row.
    local = evaluate("inf", storage=str(storage), options=LOCAL)
    pd.testing.assert_frame_equal(local.predictions, ev.predictions)


def test_load_model_returns_an_eval_mode_model_and_its_preprocessing(trained):
    result, storage = trained
    model, preprocess = load_model("inf", storage=str(storage))
    assert not model.training
    _, images, labels = read_split(result.config["data"], "test")
    with torch.inference_mode():
        preds = model(preprocess(images)).argmax(1).numpy()
    assert (preds == labels).mean() == result.final_accuracy
    assert preprocess.classes == tuple(str(i) for i in range(10))
    with pytest.raises(ImgtrainError, match=r"shape \[28, 28, 1\]"):
        preprocess(np.zeros((2, 32, 32, 1), np.uint8))
    # Predictor, used directly, agrees with the model and passes other columns through.
    out = Predictor(result.best_checkpoint)({"image": images[:5], "id": np.arange(5)})
    assert list(out["pred_index"]) == list(preds[:5]) and list(out["id"]) == list(range(5))
    assert np.allclose(out["top1_prob"] + 0, out["confidence"])


def test_cli_evaluate_json(trained, ray_cluster):
    result, storage = trained
    proc = run_cli("evaluate", "inf", "--storage", str(storage), "--json", "--address", ray_cluster)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    for key in ("accuracy", "per_class", "confusion_matrix", "num_samples", "checkpoint"):
        assert key in data
    assert data["accuracy"] == result.final_accuracy
    assert set(data["per_class"]["3"]) == {"precision", "recall", "f1", "support"}


def make_image_folder(root, tiny_data):
    _, images, labels = read_split(tiny_data, "test")
    root.mkdir()
    Image.fromarray(images[0, ..., 0]).save(root / "gray.png")
    # An RGB JPEG twice the size: converted to 1-channel 28x28.
    Image.fromarray(np.repeat(images[1], 3, axis=-1)).resize((56, 56)).save(root / "rgb.jpg")
    (root / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    (root / "notes.txt").write_text("not an image")
    return labels[:2]


def test_cli_predict_image_folder_skips_unreadable_files(trained, tiny_data, tmp_path, ray_cluster):
    _, storage = trained
    make_image_folder(tmp_path / "imgs", tiny_data)
    out = tmp_path / "preds.csv"
    proc = run_cli("predict", "inf", str(tmp_path / "imgs"), "--out", str(out), "--storage",
                   str(storage), "--address", ray_cluster)
    assert proc.returncode == 0, proc.stderr
    assert "broken.png" in proc.stderr and "notes.txt" in proc.stderr
    assert "wrote 2 predictions" in proc.stdout and "1 image(s) converted" in proc.stdout
    df = pd.read_csv(out)
    assert [p.rsplit("/", 1)[1] for p in df["path"]] == ["gray.png", "rgb.jpg"]
    assert {"pred_class", "pred_index", "confidence", "top3_class", "top3_prob"} <= set(df.columns)
    assert ((df["confidence"] > 0) & (df["confidence"] <= 1)).all()

    # The same images through the API agree with the CLI, and failing on bad files is an option.
    api = predict("inf", str(tmp_path / "imgs" / "*.*g"), tmp_path / "api.parquet",
                  storage=str(storage), options=LOCAL)
    assert list(api.predictions["pred_index"]) == list(df["pred_index"])
    fail = run_cli("predict", "inf", str(tmp_path / "imgs"), "--out", str(tmp_path / "f.csv"),
                   "--on-error", "fail", "--storage", str(storage), "--backend", "local")
    assert_one_line_error(fail, "broken.png", "--on-error skip")
    assert not (tmp_path / "f.csv").exists()


def test_predict_a_data_set_and_one_image(trained, tiny_data, tmp_path):
    result, storage = trained
    out = predict("inf", str(tiny_data), tmp_path / "p.parquet", storage=str(storage), options=LOCAL)
    df = pd.read_parquet(out.out)
    assert len(df) == 100 and (df["pred_index"] == df["label"]).mean() == result.final_accuracy
    make_image_folder(tmp_path / "imgs", tiny_data)
    one = predict("inf", str(tmp_path / "imgs" / "gray.png"), tmp_path / "one.csv",
                  storage=str(storage), options=LOCAL)
    assert one.num_predictions == 1 and one.converted == 0


def copy_checkpoint(trained, tmp_path):
    result, _ = trained
    copy = tmp_path / "ckpt"
    shutil.copytree(result.best_checkpoint, copy)
    return copy


def test_checkpoint_that_fails_its_checksum_is_named(trained, tmp_path):
    copy = copy_checkpoint(trained, tmp_path)
    with open(copy / ckpt.MODEL_FILE, "r+b") as f:
        f.seek(-10, 2)
        f.write(b"0123456789")
    proc = run_cli("evaluate", str(copy), "--backend", "local")
    assert_one_line_error(proc, str(copy / ckpt.MODEL_FILE), "sha256")


@pytest.mark.parametrize("model_args, message", [
    ({"architecture": "no_such_net", "in_channels": 1, "num_classes": 10}, "cannot build"),
    ({"architecture": "vit_b_16", "in_channels": 1, "num_classes": 10}, "another architecture or class count"),
    ({"architecture": "resnet18", "in_channels": 1, "num_classes": 5}, "another architecture or class count"),
])
def test_checkpoint_of_another_model_is_refused(trained, tmp_path, model_args, message):
    copy = copy_checkpoint(trained, tmp_path)
    meta = json.loads((copy / ckpt.META_FILE).read_text())
    meta["model_args"] = model_args
    (copy / ckpt.META_FILE).write_text(json.dumps(meta))
    proc = run_cli("predict", str(copy), str(copy), "--out", str(tmp_path / "p.csv"), "--backend", "local")
    assert_one_line_error(proc, message)


def test_bad_prediction_inputs(trained, tmp_path):
    _, storage = trained
    common = ("--storage", str(storage), "--backend", "local")
    assert_one_line_error(run_cli("evaluate", "nope", *common), "no run named 'nope'", "inf")
    (tmp_path / "empty").mkdir()
    assert_one_line_error(
        run_cli("predict", "inf", str(tmp_path / "empty"), "--out", str(tmp_path / "o.csv"), *common),
        "no images to predict")
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("x")
    assert_one_line_error(
        run_cli("predict", "inf", str(tmp_path / "text"), "--out", str(tmp_path / "o.csv"), *common),
        "none of the 1 file(s)", "a.txt")
    assert_one_line_error(
        run_cli("predict", "inf", str(tmp_path / "text"), "--out", str(tmp_path / "o.json"), *common),
        ".parquet or .csv")
    assert_one_line_error(
        run_cli("predict", "inf", str(tmp_path / "missing"), "--out", str(tmp_path / "o.csv"), *common),
        "does not exist")


def test_gpu_inference_without_gpus_fails_fast(trained, ray_cluster):
    _, storage = trained
    proc = run_cli("evaluate", "inf", "--gpu", "--storage", str(storage), "--address", ray_cluster, timeout=60)
    assert_one_line_error(proc, "GPU actor(s)", "0 GPU(s)")
