"""Multi-label training end to end on real images: 2x2 grids of scikit-learn's digits, labels the
digits shown (``tests/multilabel_digits.py``), prepared from a CSV with a split column. One run
on 2 Ray workers with the defaults shared by the checks of what it recorded, stored and
evaluates to, and of its answers: predicted (a prepared split on Ray Data, a folder of PNGs in
this process), exported to ONNX (verified by label sets) and that export served over real HTTP
(``imgtrain serve --engine onnxruntime``, joined to the session's cluster). That run loses a
Ray Train worker to a SIGKILL on the way and finishes. Exact resumption on the local backend
(interrupted inside an epoch, then resumed, with label-vector mixing and positive weights on),
and ``--sampling balanced`` refused in one line."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

import imgtrain
from imgtrain.config import TrainConfig
from imgtrain.storage import checkpoint as ckpt
from imgtrain.storage import runs
from imgtrain.training.faults import ENV_VAR
from tests.conftest import assert_one_line_error, cli_here, quiet_display
from tests.multilabel_digits import write_digit_grids

pytestmark = pytest.mark.integration

# 240 grids: 168 train (batch 16: 10 steps an epoch), 36 val, 36 test. timm's test ResNet: what is
# checked is the multi-label machinery, not what the model learns; one torch thread per worker.
SMALL = dict(model="timm:test_resnet", batch_size=16, eval_batch_size=64, threads_per_worker=1, log_every_steps=5)
RAY_RUN = dict(SMALL, workers=2, epochs=2)


@pytest.fixture(scope="module")
def grids(tmp_path_factory):
    folder = tmp_path_factory.mktemp("grids")
    table = write_digit_grids(folder / "source", count=240, seed=0)
    out = folder / "prepared"
    proc = imgtrain_cli("data", "prepare", "list", str(out), "--source", str(table), "--label-column", "labels",
                        "--multi-label", "--split-column", "split")
    assert proc.returncode == 0, proc.stderr
    return out


def imgtrain_cli(*args):
    from tests.conftest import run_cli

    return run_cli(*args)


@pytest.fixture(scope="module")
def ml_run(ray_cluster, grids, tmp_path_factory):
    """The module's one Ray run, which survives a killed worker on the way
    (``test_a_sigkilled_ray_worker_is_replaced_and_the_run_finishes``): rank 1 SIGKILLs itself
    about to train step 18, late in the second epoch, and Ray Train replaces the worker group
    once, from a step checkpoint. That a resumed run ends with the uninterrupted run's bits is
    test_resume's (Ray, killed workers) and this module's local resume test (multi-label)."""
    storage = tmp_path_factory.mktemp("ml-runs")
    cfg = TrainConfig(data=str(grids), storage=str(storage), name="grids", max_failures=1, checkpoint_every_steps=4,
                      **RAY_RUN)
    with pytest.MonkeyPatch.context() as env:
        env.setenv(ENV_VAR, "kill:1:18")
        result = imgtrain.train(cfg, display=quiet_display())
    assert result.status == "finished"
    return result


def test_two_workers_record_val_map_and_store_thresholds_chosen_on_val(ml_run):
    assert [r["world_size"] for r in ml_run.history] == [2, 2]
    for r in ml_run.history:
        assert 0.0 <= r["val_map"] <= 1.0 and r["val_samples"] == 36 and np.isfinite(r["val_loss"])
    values, chosen_on = ckpt.load_thresholds(ml_run.best_checkpoint, 10)
    assert chosen_on == "val" and values.shape == (10,) and ((values >= 0) & (values <= 1)).all()
    assert ckpt.THRESHOLDS_FILE in ckpt.verify(ml_run.best_checkpoint)["sha256"]


def test_evaluate_json_reports_the_multi_label_figures(ml_run, capsys):
    proc = cli_here(capsys, "evaluate", "grids", "--storage", str(ml_run.path.parent), "--json")
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["multi_label"] is True and got["num_samples"] == 36 and got["split"] == "test"
    for key in ("map", "f1_micro", "f1_macro", "exact_match", "hamming_loss"):
        assert 0.0 <= got[key] <= 1.0, key
    values, _ = ckpt.load_thresholds(ml_run.best_checkpoint, 10)
    assert [got["per_label"][c]["threshold"] for c in got["classes"]] == pytest.approx(values.tolist())
    assert set(got["per_label"]["0"]) == {"precision", "recall", "f1", "ap", "threshold", "support"}
    assert got["thresholds_chosen_on"] == "val"
    assert got["recorded_val_map"] == pytest.approx(ckpt.read_meta(ml_run.best_checkpoint)["metrics"]["val_map"])


def test_local_resume_inside_an_epoch_ends_with_the_uninterrupted_bits(grids, tmp_path, monkeypatch):
    settings = dict(SMALL, backend="local", workers=1, epochs=2, limit_train_batches=4, deterministic=True,
                    checkpoint_every_steps=2, mixup=0.4, cutmix=1.0, class_weights="auto", multi_label_loss="asl")

    def run(name):
        return TrainConfig(data=str(grids), storage=str(tmp_path), name=name, **settings)

    whole = imgtrain.train(run("whole"), display=quiet_display())
    monkeypatch.setenv(ENV_VAR, "raise:0:5")  # about to train step 5: inside the second epoch
    with pytest.raises(Exception, match="injected"):
        imgtrain.train(run("cut"), display=quiet_display())
    monkeypatch.delenv(ENV_VAR)
    resumed = imgtrain.train(run("cut"), display=quiet_display())
    keys = ("epoch", "step", "train_loss", "train_accuracy", "val_loss", "val_map", "val_accuracy")
    assert [[r[k] for k in keys] for r in resumed.history] == [[r[k] for k in keys] for r in whole.history]
    a, b = (ckpt.load_model_state(r.latest_checkpoint) for r in (whole, resumed))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert np.array_equal(ckpt.load_thresholds(whole.latest_checkpoint, 10)[0],
                          ckpt.load_thresholds(resumed.latest_checkpoint, 10)[0])


def test_balanced_sampling_is_refused_for_a_multi_label_set(grids, tmp_path, capsys):
    proc = cli_here(capsys, "train", "--data", str(grids), "--storage", str(tmp_path), "--name", "b",
                    "--backend", "local", "--sampling", "balanced")
    assert_one_line_error(proc, "--sampling balanced", "several labels")


def test_the_report_shows_ap_per_label_thresholds_and_the_most_wrong_images(ml_run):
    from imgtrain.inference.report import write_report

    page = write_report(str(ml_run.path)).read_text()
    for part in ('id="label-ap"', 'id="thresholds-table"', 'id="most-wrong"', "mAP re-evaluated now"):
        assert part in page, part
    assert json.loads((page_dir := ml_run.path / "report" / "evaluation.json").read_text())["multi_label"] is True, page_dir


def test_the_report_maps_where_the_model_saw_its_surest_wrong_labels(ml_run):
    from PIL import Image

    from imgtrain.inference.report import write_report

    page = write_report(str(ml_run.path)).read_text()
    assert 'id="wrong-label-maps"' in page and "No maps:" not in page
    maps = Image.open(ml_run.path / "report" / "wrong_label_maps.png")
    assert maps.width > 200 and maps.height > 200  # a grid of maps, not the line saying there are none


# ---------------------------------------------------------------- a killed Ray Train worker


def test_a_sigkilled_ray_worker_is_replaced_and_the_run_finishes(ml_run):
    """Ray Train restarts from the newest checkpoint it had registered (step checkpoints every 4
    steps, the first epoch's at step 10: which one depends on when Ray Train saw its report)."""
    assert (ml_run.path / ".faults" / "kill-1-18-1").is_file()  # the fault really fired
    starts = [r["step"] for r in runs.read_metrics(ml_run.path) if r["kind"] == "start"]
    assert len(starts) == 2 and starts[1] in (10, 12, 16), starts  # one restart, from a checkpoint
    assert [r["epoch"] for r in ml_run.history] == [0, 1]  # each epoch once, none lost
    assert ckpt.load_thresholds(ml_run.latest_checkpoint, 10)[1] == "val"


# ---------------------------------------------------------------- its answers: predict, export, serve


@pytest.fixture(scope="module")
def torch_predictor(ml_run):
    from imgtrain.inference.predictor import Predictor

    return Predictor(ml_run.best_checkpoint)


def test_predict_writes_the_label_sets_and_every_probability_for_a_split_and_a_folder(
        ml_run, grids, torch_predictor, tmp_path):
    """A prepared split on Ray Data's actor pool (the default backend), and the source's PNG
    files in this process: ``labels`` is the classes at or over the checkpoint's thresholds,
    joined by a space; ``prob_<class>`` the model's sigmoids."""
    import pandas as pd

    from imgtrain.inference.batch import predict
    from imgtrain.inference.options import InferenceOptions

    classes = [str(d) for d in range(10)]
    thresholds, _ = ckpt.load_thresholds(ml_run.best_checkpoint, 10)
    columns = ["labels", *[f"prob_{c}" for c in classes]]

    split = predict(ml_run.best_checkpoint, str(grids), tmp_path / "split.parquet",
                    options=InferenceOptions(backend="ray", batch_size=16)).predictions
    ids, images, targets = _test_split(grids)
    assert list(split.columns) == ["id", "true_labels", *columns] and split["id"].tolist() == ids.tolist()
    probs = torch_predictor.predict_proba(images)
    assert np.allclose(split[columns[1:]].to_numpy(), probs, atol=1e-6)
    assert split["labels"].tolist() == [" ".join(c for c, on in zip(classes, row) if on) for row in probs >= thresholds]
    assert split["true_labels"].tolist() == [" ".join(c for c, on in zip(classes, row) if on) for row in targets]

    source = grids.parent / "source" / "images"
    files = predict(ml_run.best_checkpoint, str(source), tmp_path / "files.csv",
                    options=InferenceOptions(backend="local")).out
    table = pd.read_csv(files, keep_default_na=False)  # "" is an image without a label
    assert list(table.columns) == ["path", *columns] and len(table) == 240
    assert set(table["labels"]) <= {" ".join(c for c, on in zip(classes, row) if on)
                                    for row in table[columns[1:]].to_numpy() >= thresholds}


@pytest.fixture(scope="module")
def exported(ml_run, tmp_path_factory):
    from imgtrain.inference.export import export

    return export(ml_run.best_checkpoint, "onnx", tmp_path_factory.mktemp("ml-export") / "onnx")


def test_the_onnx_export_holds_sigmoids_and_the_thresholds_verified_by_label_sets(ml_run, grids, exported,
                                                                                    torch_predictor):
    from imgtrain.inference.predictor import Predictor

    thresholds, _ = ckpt.load_thresholds(ml_run.best_checkpoint, 10)
    v = exported.verification
    assert v.images == 36 and v.agreement >= 0.999 and "label sets identical" in v.line()
    folder = exported.out
    written = json.loads((folder / "thresholds.json").read_text())
    assert written["chosen_on"] == "val" and list(written["thresholds"].values()) == thresholds.tolist()
    assert json.loads((folder / "imgtrain.json").read_text())["thresholds"] == thresholds.tolist()
    assert "sigmoid" in json.loads((folder / "preprocessing.json").read_text())["output"]["meaning"]
    card = (folder / "MODEL_CARD.md").read_text()
    assert "10 labels (multi-label)" in card and "mAP" in card and "| label | AP | threshold |" in card
    assert exported.test_metrics["multi_label"] and 0 <= exported.test_metrics["map"] <= 1
    # ONNX Runtime's answers are PyTorch's: sigmoids (not a softmax: they need not sum to 1)
    onnx = Predictor(folder, engine="onnxruntime")
    assert onnx.multi_label and np.array_equal(onnx.thresholds, thresholds)
    images = _test_split(grids)[1]
    assert np.allclose(onnx.predict_proba(images), torch_predictor.predict_proba(images), atol=1e-5)


def _test_split(grids) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, images uint8 [n, H, W, C] as evaluation sees them, multi-hot labels) of the test split."""
    from imgtrain.data import stream
    from imgtrain.data.format import load_manifest

    manifest = load_manifest(grids)
    batches = list(stream.split_batches(grids, manifest, "test", manifest["preset"], 64))
    return tuple(np.concatenate([b[k] for b in batches]) for k in ("id", "image", "label"))


def test_serve_of_the_export_answers_the_label_list_over_http(ray_cluster, ml_run, grids, exported,
                                                               torch_predictor, tmp_path):
    """The real ``imgtrain serve --engine onnxruntime`` of the export, joined to the session's
    cluster through Serve's proxy (no Ray start of its own): a PNG posted to /predict is answered
    with the labels at or over their thresholds, most probable first, and every probability, the
    label set PyTorch's checkpoint gives."""
    from ray import serve

    from tests.integration.test_serve import png_bytes, request, serving

    grid = _test_split(grids)[1][0]
    probs = torch_predictor.predict_proba(grid[None])[0]
    thresholds = torch_predictor.thresholds
    expected = sorted((c for c in range(10) if probs[c] >= thresholds[c]), key=lambda c: -probs[c])
    try:
        with serving(Path(ml_run.path).parent, tmp_path, "--ingress", "proxy", "--address", ray_cluster,
                     "--engine", "onnxruntime", run=str(exported.out)) as (proc, port, _, stderr):
            status, health = request(port, "/healthz")
            assert status == 200 and health["multi_label"] is True
            assert list(health["thresholds"].values()) == pytest.approx(thresholds.tolist())
            status, answer = request(port, "/predict", png_bytes(grid), "image/png")
            assert status == 200, answer
            assert set(answer) == {"labels", "probabilities"}
            assert [a["label"] for a in answer["labels"]] == [str(c) for c in expected]
            assert [a["probability"] for a in answer["labels"]] == pytest.approx(probs[expected].tolist(), abs=1e-5)
            assert list(answer["probabilities"].values()) == pytest.approx(probs.tolist(), abs=1e-5)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=60) == 0, stderr.read_text()
    finally:  # a server killed mid-test leaves Serve in the session's cluster: not for the tests after
        serve.shutdown()


def test_what_has_no_meaning_for_a_multi_label_model_is_refused_in_one_line(ml_run, tmp_path, capsys):
    storage, name = str(ml_run.path.parent), ml_run.path.name
    proc = cli_here(capsys, "predict", name, str(tmp_path), "--storage", storage, "--out", str(tmp_path / "p.csv"),
                    "--top-k", "5", "--backend", "local")
    assert_one_line_error(proc, "--top-k", "multi-label")
    proc = cli_here(capsys, "export", name, "--storage", storage, "--out", str(tmp_path / "x"), "--quantize", "int8")
    assert_one_line_error(proc, "--quantize int8", "multi-label")
