"""evaluate's new figures and ``--tta flip`` on the session's real trained model (``local_run``:
read only, in this process, no Ray): the probabilities with TTA are the mean of the two passes,
and evaluate, predict, the report and serve's replica use them."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pandas as pd
import pytest
from sklearn.metrics import f1_score, precision_recall_fscore_support, top_k_accuracy_score

from imgtrain.data.format import read_split
from imgtrain.errors import ImgtrainWarning
from imgtrain.inference import batch, report
from imgtrain.inference.predictor import Predictor
from tests.conftest import assert_one_line_error, cli_here, copy_run

LOCAL = batch.InferenceOptions(backend="local")


@pytest.fixture(scope="module")
def test_images(local_run):
    _, images, labels = read_split(local_run.config["data"], "test")
    return images, labels  # uint8 [100, 28, 28, 1], int64 [100]


def test_tta_flip_is_the_mean_of_the_softmax_of_the_image_and_of_its_mirror_image(local_run, test_images):
    images = test_images[0][:20]
    plain = Predictor(local_run.best_checkpoint)
    mirrored = plain.predict_proba(np.ascontiguousarray(images[:, :, ::-1]))  # W reversed: [B, H, W, C]
    flipped = Predictor(local_run.best_checkpoint, tta="flip").predict_proba(images)
    assert np.allclose(flipped, (plain.predict_proba(images) + mirrored) / 2, atol=1e-6)
    assert np.abs(flipped - plain.predict_proba(images)).max() > 1e-3  # the flip did change something
    assert np.allclose(flipped.sum(axis=1), 1, atol=1e-5)


def test_evaluate_figures_are_scikit_learns_on_the_real_predictions(local_run, test_images):
    images, labels = test_images
    ev = batch.evaluate(str(local_run.path), options=LOCAL)
    probs = Predictor(local_run.best_checkpoint).predict_proba(images)
    preds = probs.argmax(axis=1)
    assert ev.predictions["pred_index"].tolist() == preds.tolist()  # the data set's rows, in their order
    assert ev.top5_accuracy == pytest.approx(top_k_accuracy_score(labels, probs, k=5, labels=np.arange(10)))
    for average in ("macro", "weighted"):
        p, r, f, _ = precision_recall_fscore_support(labels, preds, average=average, zero_division=0)
        assert getattr(ev, f"{average}_avg") == pytest.approx({"precision": p, "recall": r, "f1": f})
    hit, confidence = preds == labels, probs.max(axis=1)
    which = np.clip(np.ceil(confidence * 15).astype(int) - 1, 0, 14)
    ece = sum(abs(hit[which == m].mean() - confidence[which == m].mean()) * (which == m).mean()
              for m in range(15) if (which == m).any())
    assert ev.ece == pytest.approx(ece, abs=1e-6)
    # the rows evaluate keeps are the ones it always kept: top-3, no index columns
    assert [c for c in ev.predictions.columns if c.startswith("top")] == [
        f"top{i}_{what}" for i in (1, 2, 3) for what in ("class", "prob")]


def test_evaluate_and_predict_accept_tta_flip_and_say_it_is_meant_for_photos(local_run, test_images, tmp_path,
                                                                              capsys):
    images, labels = test_images
    flipped = Predictor(local_run.best_checkpoint, tta="flip").predict_proba(images)
    storage = str(local_run.path.parent)
    proc = cli_here(capsys, "evaluate", local_run.name, "--storage", storage, "--backend", "local",
                    "--tta", "flip", "--json")
    assert proc.returncode == 0, proc.stderr
    assert "warning: --tta flip" in proc.stderr and "digits preset" in proc.stderr  # a digits model
    got = json.loads(proc.stdout)
    assert got["tta"] == "flip"
    assert got["accuracy"] == pytest.approx(np.mean(flipped.argmax(axis=1) == labels))
    assert got["macro_avg"]["f1"] == pytest.approx(f1_score(labels, flipped.argmax(axis=1), average="macro",
                                                            zero_division=0))
    assert len(got["calibration"]) == 15 and sum(b["count"] for b in got["calibration"]) == 100

    out = tmp_path / "preds.csv"
    proc = cli_here(capsys, "predict", local_run.name, local_run.config["data"], "--storage", storage,
                    "--backend", "local", "--tta", "flip", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    written = pd.read_csv(out).sort_values("id")
    assert np.allclose(written["confidence"], flipped.max(axis=1)[np.argsort(read_split(
        local_run.config["data"], "test")[0])], atol=1e-6)

    err = assert_one_line_error(cli_here(capsys, "evaluate", local_run.name, "--storage", storage,
                                         "--backend", "local", "--tta", "rotate"), "tta", "none, flip")
    assert "rotate" in err
    # serve refuses it before starting Ray
    assert_one_line_error(cli_here(capsys, "serve", local_run.name, "--storage", storage, "--tta", "rotate"),
                          "--tta must be one of none, flip")


def test_evaluate_prints_the_new_figures(local_run, capsys):
    proc = cli_here(capsys, "evaluate", local_run.name, "--storage", str(local_run.path.parent),
                    "--backend", "local")
    assert proc.returncode == 0, proc.stderr
    assert "top-5 accuracy" in proc.stdout and "expected calibration error" in proc.stdout
    assert "macro avg" in proc.stdout and "weighted avg" in proc.stdout
    assert "warning" not in proc.stderr


def test_serve_replicas_predict_with_the_tta_they_were_given(local_run, test_images):
    # ModelServer's forward passes are its Predictor's predict_proba. The class as written, outside
    # Serve: @serve.ingress wraps it in a subclass whose (async) __init__ starts the HTTP app, so
    # the class under it is built directly. The real server: tests/integration/test_serve.py.
    from imgtrain.inference.options import Limits
    from imgtrain.inference.routes import ModelServer

    wrapper = ModelServer.func_or_class
    written = next(c for c in wrapper.__mro__[1:] if c.__name__ == "ModelServer")
    images = test_images[0][:4]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ImgtrainWarning)  # a replica does not warn: the driver did, once
        replica = written(str(local_run.best_checkpoint), Limits(), 1, False, "flip")
    assert replica.healthz()["tta"] == "flip"
    want = Predictor(local_run.best_checkpoint, tta="flip").predict_proba(images)
    assert np.allclose(replica._predict_proba(images)[:, :-1], want, atol=1e-6)  # the last column: the OOD score


def test_the_report_shows_the_new_figures_and_the_recorded_val_f1_macro(local_run, tmp_path, monkeypatch):
    run = copy_run(local_run, tmp_path) / local_run.name
    history = run / "metrics.jsonl"  # planted values, to find them in the page
    records = [json.loads(line) for line in history.read_text().splitlines()]
    for r in records:
        if r.get("kind") == "epoch":
            r["val_f1_macro"] = 0.25 + r["epoch"] / 4
    history.write_text("".join(json.dumps(r) + "\n" for r in records))
    drawn, figure = [], report._figure
    monkeypatch.setattr(report, "_figure", lambda *size: drawn.append(figure(*size)) or drawn[-1])

    page = report.write_report(str(run))
    legends = {t.get_text() for fig in drawn for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()}
    assert {"val accuracy", "val macro F1", "perfect calibration"} <= legends
    text = page.read_text()
    assert "<th>val_<wbr>f1_<wbr>macro</th>" in text and "<td>0.5000</td>" in text  # epoch 2's
    for shown in ('id="reliability-diagram"', 'id="averages-table"', "top-5 accuracy", "expected calibration error"):
        assert shown in text
    ev = json.loads((page.parent / report.EVAL_FILE).read_text())
    assert 0 < ev["top5_accuracy"] <= 1 and ev["ece"] >= 0 and set(ev["macro_avg"]) == {"precision", "recall", "f1"}
    assert (page.parent / "reliability_diagram.png").stat().st_size > 10_000

    older = copy_run(local_run, tmp_path / "older") / local_run.name  # a run from before val_f1_macro
    history = older / "metrics.jsonl"
    records = [json.loads(line) for line in history.read_text().splitlines()]
    history.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "val_f1_macro"}) + "\n" for r in records))
    assert "val_f1_macro" not in report.write_report(str(older)).read_text()  # no empty column
