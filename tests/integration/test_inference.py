"""Evaluate, predict and load_model on a real trained checkpoint: the session's 2-worker Ray run
(``ray_run``: validation split across ranks, the case evaluate must match), read only."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image

from imgtrain.data.format import read_split
from imgtrain.errors import ImgtrainError
from imgtrain.inference.batch import InferenceOptions, evaluate, predict
from imgtrain.inference.predictor import Predictor, load_model
from imgtrain.storage import checkpoint as ckpt
from tests.conftest import assert_one_line_error, cli_here, run_cli

pytestmark = pytest.mark.integration

LOCAL = InferenceOptions(backend="local")


@pytest.fixture(scope="module")
def trained(ray_run):
    """(the run, its storage), and what it recorded for its best checkpoint: every command reads that one."""
    return ray_run, str(ray_run.path.parent)


def best_accuracy(result) -> float:
    return ckpt.read_meta(result.best_checkpoint)["metrics"]["val_accuracy"]


def test_evaluate_on_ray_data_equals_the_accuracy_recorded_in_training(trained, ray_cluster):
    result, storage = trained
    ev = evaluate(result.name, storage=storage, options=InferenceOptions(concurrency=2, batch_size=16))
    recorded = best_accuracy(result)
    assert ev.accuracy == recorded == ev.recorded_val_accuracy
    assert ev.num_samples == 100 and np.sum(ev.confusion_matrix) == 100
    assert sorted(ev.predictions["id"]) == sorted(read_split(result.config["data"], "test")[0])
    assert sum(s["support"] for s in ev.per_class.values()) == 100
    # The in-process path gives the very same predictions, row by row.
    local = evaluate(result.name, storage=storage, options=LOCAL)
    pd.testing.assert_frame_equal(local.predictions, ev.predictions)


def test_load_model_returns_an_eval_mode_model_and_its_preprocessing(trained):
    result, storage = trained
    model, preprocess = load_model(result.name, storage=storage)
    assert not model.training
    _, images, labels = read_split(result.config["data"], "test")
    with torch.inference_mode():
        preds = model(preprocess(images)).argmax(1).numpy()
    assert (preds == labels).mean() == best_accuracy(result)
    assert preprocess.classes == tuple(str(i) for i in range(10))
    with pytest.raises(ImgtrainError, match=r"shape \[28, 28, 1\]"):
        preprocess(np.zeros((2, 32, 32, 1), np.uint8))
    # Predictor, used directly, agrees with the model and passes other columns through.
    out = Predictor(result.best_checkpoint)({"image": images[:5], "id": np.arange(5)})
    assert list(out["pred_index"]) == list(preds[:5]) and list(out["id"]) == list(range(5))
    assert np.allclose(out["top1_prob"] + 0, out["confidence"])


def test_cli_evaluate_json(trained, capsys):
    # The CLI's JSON (in this process, on the local backend: Ray's evaluation is the test above's)
    result, storage = trained
    proc = cli_here(capsys, "evaluate", result.name, "--storage", storage, "--json", "--backend", "local")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    for key in ("accuracy", "per_class", "confusion_matrix", "num_samples", "checkpoint"):
        assert key in data
    assert data["accuracy"] == best_accuracy(result)
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


def test_cli_predict_image_folder_skips_unreadable_files(trained, tiny_data, tmp_path, ray_cluster, capsys):
    result, storage = trained
    make_image_folder(tmp_path / "imgs", tiny_data)
    out = tmp_path / "preds.csv"
    proc = cli_here(capsys, "predict", result.name, str(tmp_path / "imgs"), "--out", str(out), "--storage", storage,
                    "--backend", "local")
    assert proc.returncode == 0, proc.stderr
    assert "broken.png" in proc.stderr and "notes.txt" in proc.stderr
    assert "wrote 2 predictions" in proc.stdout and "1 image(s) converted" in proc.stdout
    df = pd.read_csv(out)
    assert [p.rsplit("/", 1)[1] for p in df["path"]] == ["gray.png", "rgb.jpg"]
    assert {"pred_class", "pred_index", "confidence", "top3_class", "top3_prob"} <= set(df.columns)
    assert ((df["confidence"] > 0) & (df["confidence"] <= 1)).all()

    # The same images through the API on Ray Data (the session's cluster) agree with the CLI,
    # and failing on bad files is an option.
    api = predict(result.name, str(tmp_path / "imgs" / "*.*g"), tmp_path / "api.parquet", storage=storage)
    assert list(api.predictions["pred_index"]) == list(df["pred_index"])
    fail = cli_here(capsys, "predict", result.name, str(tmp_path / "imgs"), "--out", str(tmp_path / "f.csv"),
                    "--on-error", "fail", "--storage", storage, "--backend", "local")
    assert_one_line_error(fail, "broken.png", "--on-error skip")
    assert not (tmp_path / "f.csv").exists()


def test_predict_a_data_set_and_one_image(trained, tiny_data, tmp_path):
    result, storage = trained
    out = predict(result.name, str(tiny_data), tmp_path / "p.parquet", storage=storage, options=LOCAL)
    df = pd.read_parquet(out.out)
    assert len(df) == 100 and (df["pred_index"] == df["label"]).mean() == best_accuracy(result)
    make_image_folder(tmp_path / "imgs", tiny_data)
    one = predict(result.name, str(tmp_path / "imgs" / "gray.png"), tmp_path / "one.csv",
                  storage=storage, options=LOCAL)
    assert one.num_predictions == 1 and one.converted == 0


def copy_checkpoint(trained, tmp_path):
    result, _ = trained
    copy = tmp_path / "ckpt"
    shutil.copytree(result.best_checkpoint, copy)
    return copy


def test_checkpoint_that_fails_its_checksum_is_named(trained, tmp_path, capsys):
    copy = copy_checkpoint(trained, tmp_path)
    with open(copy / ckpt.MODEL_FILE, "r+b") as f:
        f.seek(-10, 2)
        f.write(b"0123456789")
    proc = cli_here(capsys, "evaluate", str(copy), "--backend", "local")
    assert_one_line_error(proc, str(copy / ckpt.MODEL_FILE), "sha256")


@pytest.mark.parametrize("model_args, message", [
    ({"architecture": "no_such_net", "in_channels": 1, "num_classes": 10}, "cannot build"),
    ({"architecture": "vit_b_16", "in_channels": 1, "num_classes": 10}, "another architecture or class count"),
    ({"architecture": "resnet18", "in_channels": 1, "num_classes": 5}, "another architecture or class count"),
])
def test_checkpoint_of_another_model_is_refused(trained, tmp_path, capsys, model_args, message):
    copy = copy_checkpoint(trained, tmp_path)
    meta = json.loads((copy / ckpt.META_FILE).read_text())
    meta["model_args"] = model_args
    (copy / ckpt.META_FILE).write_text(json.dumps(meta))
    proc = cli_here(capsys, "predict", str(copy), str(copy), "--out", str(tmp_path / "p.csv"), "--backend", "local")
    assert_one_line_error(proc, message)


def test_bad_prediction_inputs(trained, tmp_path, capsys):
    result, storage = trained
    common = ("--storage", storage, "--backend", "local")
    assert_one_line_error(cli_here(capsys, "evaluate", "nope", *common), "no run named 'nope'",
                          f"runs there: {result.name}")
    (tmp_path / "empty").mkdir()
    assert_one_line_error(
        cli_here(capsys, "predict", result.name, str(tmp_path / "empty"), "--out", str(tmp_path / "o.csv"), *common),
        "no images to predict")
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("x")
    assert_one_line_error(
        cli_here(capsys, "predict", result.name, str(tmp_path / "text"), "--out", str(tmp_path / "o.csv"), *common),
        "none of the 1 file(s)", "a.txt")
    assert_one_line_error(
        cli_here(capsys, "predict", result.name, str(tmp_path / "text"), "--out", str(tmp_path / "o.json"), *common),
        ".parquet or .csv")
    assert_one_line_error(
        cli_here(capsys, "predict", result.name, str(tmp_path / "missing"), "--out", str(tmp_path / "o.csv"), *common),
        "does not exist")


def test_gpu_inference_without_gpus_fails_fast(trained, ray_cluster):
    """A new CLI process joining a cluster (--address) for inference: refused, not left waiting for a GPU."""
    result, storage = trained
    proc = run_cli("evaluate", result.name, "--gpu", "--storage", storage, "--address", ray_cluster, timeout=60)
    assert_one_line_error(proc, "GPU actor(s)", "0 GPU(s)")
