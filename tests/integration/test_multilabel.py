"""Multi-label training end to end on real images: 2x2 grids of scikit-learn's digits, labels the
digits shown (``tests/multilabel_digits.py``), prepared from a CSV with a split column. One run
on 2 Ray workers with the defaults shared by the checks of what it recorded, stored and
evaluates to; exact resumption on the local backend (interrupted inside an epoch, then resumed:
the uninterrupted run's bits), with label-vector mixing and positive weights on; and
``--sampling balanced`` refused in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import imgtrain
from imgtrain.config import TrainConfig
from imgtrain.storage import checkpoint as ckpt
from imgtrain.training.faults import ENV_VAR
from tests.conftest import assert_one_line_error, cli_here, quiet_display
from tests.multilabel_digits import write_digit_grids

pytestmark = pytest.mark.integration

# 240 grids: 168 train (batch 16: 10 steps an epoch), 36 val, 36 test. timm's test ResNet: what is
# checked is the multi-label machinery, not what the model learns; one torch thread per worker.
SMALL = dict(model="timm:test_resnet", batch_size=16, eval_batch_size=64, threads_per_worker=1, log_every_steps=5)


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
def ray_run(ray_cluster, grids, tmp_path_factory):
    storage = tmp_path_factory.mktemp("ml-runs")
    cfg = TrainConfig(data=str(grids), storage=str(storage), name="grids", workers=2, epochs=2, **SMALL)
    result = imgtrain.train(cfg, display=quiet_display())
    assert result.status == "finished"
    return result


def test_two_workers_record_val_map_and_store_thresholds_chosen_on_val(ray_run):
    assert [r["world_size"] for r in ray_run.history] == [2, 2]
    for r in ray_run.history:
        assert 0.0 <= r["val_map"] <= 1.0 and r["val_samples"] == 36 and np.isfinite(r["val_loss"])
    values, chosen_on = ckpt.load_thresholds(ray_run.best_checkpoint, 10)
    assert chosen_on == "val" and values.shape == (10,) and ((values >= 0) & (values <= 1)).all()
    assert ckpt.THRESHOLDS_FILE in ckpt.verify(ray_run.best_checkpoint)["sha256"]


def test_evaluate_json_reports_the_multi_label_figures(ray_run, capsys):
    proc = cli_here(capsys, "evaluate", "grids", "--storage", str(ray_run.path.parent), "--json")
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["multi_label"] is True and got["num_samples"] == 36 and got["split"] == "test"
    for key in ("map", "f1_micro", "f1_macro", "exact_match", "hamming_loss"):
        assert 0.0 <= got[key] <= 1.0, key
    values, _ = ckpt.load_thresholds(ray_run.best_checkpoint, 10)
    assert [got["per_label"][c]["threshold"] for c in got["classes"]] == pytest.approx(values.tolist())
    assert set(got["per_label"]["0"]) == {"precision", "recall", "f1", "ap", "threshold", "support"}
    assert got["thresholds_chosen_on"] == "val"
    assert got["recorded_val_map"] == pytest.approx(ckpt.read_meta(ray_run.best_checkpoint)["metrics"]["val_map"])


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


def test_the_report_shows_ap_per_label_thresholds_and_the_most_wrong_images(ray_run):
    from imgtrain.inference.report import write_report

    page = write_report(str(ray_run.path)).read_text()
    for part in ('id="label-ap"', 'id="thresholds-table"', 'id="most-wrong"', "mAP re-evaluated now"):
        assert part in page, part
    assert json.loads((page_dir := ray_run.path / "report" / "evaluation.json").read_text())["multi_label"] is True, page_dir
