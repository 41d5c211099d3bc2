"""Stopping and selection on the local backend: the validation macro F1 (scikit-learn's), the
selection metric that ranks and keeps checkpoints, early stopping that a resumed run repeats,
and the average of the last epochs' weights as a checkpoint inference can use.

One planted case, deterministic whatever the weights learn: ``--early-stop 1`` with a minimum
change no loss can make (1000) stops every run after its second epoch."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from sklearn.metrics import f1_score

import imgtrain
from imgtrain.checkpoint_policy import POLICY
from imgtrain.errors import ImgtrainError
from imgtrain.storage import checkpoint as ckpt
from imgtrain.storage import runs
from imgtrain.training.backend import Backend, single_process_collectives
from imgtrain.training.evaluation import evaluate, f1_macro
from imgtrain.training.faults import ENV_VAR
from tests.conftest import cli_here, quiet_display, tiny_config

# 4 epochs asked, 2 trained (the planted stop), the average of both; every checkpoint kept so
# the test can read each epoch's weights, and one inside each epoch
SETTINGS = dict(backend="local", workers=1, model="tinycnn_8", epochs=4, limit_train_batches=2, deterministic=True,
                select_metric="val_loss", early_stop=1, early_stop_min_delta=1000.0, average_last=2,
                num_to_keep=100, checkpoint_every_steps=1)


@pytest.fixture(scope="module")
def stopped(tiny_cnn, tiny_data, tmp_path_factory):
    """The planted run, trained once without interruption."""
    storage = tmp_path_factory.mktemp("selection")
    return imgtrain.train(tiny_config(tiny_data, storage, "sel", **SETTINGS), display=quiet_display())


def model_state(checkpoint) -> dict:
    return torch.load(checkpoint / ckpt.MODEL_FILE, weights_only=True)


# ---------------------------------------------------------------- the macro F1


@pytest.mark.parametrize("y_true, y_pred", [
    ([0, 1, 2, 2, 1, 0, 3, 3], [0, 2, 2, 2, 1, 1, 3, 0]),
    ([0, 0, 1, 1, 2, 2], [0, 0, 0, 0, 0, 4]),  # class 4 predicted, never true; 3 in neither: left out
    ([5, 5, 5], [5, 5, 5]),
])
def test_macro_f1_is_scikit_learns_from_per_class_counts(y_true, y_pred):
    y, p = torch.tensor(y_true), torch.tensor(y_pred)
    counts = torch.stack([torch.bincount(y[p == y], minlength=8), torch.bincount(p, minlength=8),
                          torch.bincount(y, minlength=8)])
    assert f1_macro(counts) == pytest.approx(f1_score(y_true, y_pred, average="macro"))


def test_validation_reports_the_macro_f1_of_the_models_own_predictions():
    torch.manual_seed(0)
    k, model = 5, torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4 * 4, 5))
    batches = [{"image": torch.randint(0, 256, (n, 4, 4, 1), dtype=torch.uint8), "label": torch.randint(0, k, (n,))}
               for n in (7, 0, 13)]
    backend = Backend(rank=0, world_size=1, device=torch.device("cpu"), prepare_model=lambda m: m,
                      train_batches=None, val_batches=lambda: batches, restored_checkpoint=None, report=None,
                      send=None, **single_process_collectives())
    manifest = {"normalize": {"mean": [0.5], "std": [0.5]}, "num_classes": k}
    got = evaluate(model, backend, manifest)
    x = torch.cat([b["image"] for b in batches]).permute(0, 3, 1, 2).float() / 255
    with torch.no_grad():
        predicted = model((x - 0.5) / 0.5).argmax(1)
    labels = torch.cat([b["label"] for b in batches])
    assert got["val_samples"] == 20
    assert got["val_accuracy"] == pytest.approx((predicted == labels).float().mean().item())
    assert got["val_f1_macro"] == pytest.approx(f1_score(labels, predicted, average="macro"))


# ---------------------------------------------------------------- one run: stopped, selected, averaged


def test_a_run_stops_early_and_says_so(stopped, capsys):
    assert stopped.status == "finished" and [r["epoch"] for r in stopped.history] == [0, 1]
    assert all(0 <= r["val_f1_macro"] <= 1 for r in stopped.history)  # in the history, as val_accuracy
    stop = stopped.stopped_early
    assert (stop.epoch, stop.best_epoch, stop.metric) == (1, 0, "val_loss")
    status = json.loads((stopped.path / runs.STATUS_FILE).read_text())
    assert status["stopped_early"] == stop.to_json()
    shown = cli_here(capsys, "runs", "show", "sel", "--storage", str(stopped.path.parent))
    assert "stopped early after epoch 2: val_loss did not improve for 1 epoch; best epoch 1" in shown.stdout
    as_json = json.loads(cli_here(capsys, "runs", "show", "sel", "--storage", str(stopped.path.parent),
                                  "--json").stdout)
    assert as_json["stopped_early"]["best_epoch"] == 0 and as_json["select_metric"] == "val_loss"


def test_the_same_command_again_finds_the_stopped_run_complete(stopped, tmp_path, capsys):
    shutil.copytree(stopped.path, tmp_path / "sel", symlinks=True)
    again = cli_here(capsys, "train", "--name", "sel", "--storage", str(tmp_path))
    assert again.returncode == 0, again.stderr
    assert "already complete (stopped early after epoch 2: val_loss did not improve for 1 epoch after its best, " \
           "epoch 1); nothing to train" in " ".join(again.stdout.split())
    assert runs.read_run(tmp_path / "sel").to_json()["metrics"] == stopped.to_json()["metrics"]
    assert sorted(p.name for p in (tmp_path / "sel").iterdir() if POLICY.is_checkpoint(p.name)) == \
        sorted(p.name for p in stopped.path.iterdir() if POLICY.is_checkpoint(p.name))


def test_best_is_the_lowest_loss_when_the_run_selects_by_loss(stopped):
    found = ckpt.listing(stopped.path)
    losses = {path: meta["metrics"]["val_loss"] for path, meta in found}
    lowest = min((p for p in losses if losses[p] < 1e300), key=losses.get)  # step checkpoints: never evaluated
    assert stopped.best_checkpoint == lowest
    assert runs.resolve_checkpoint(str(stopped.path), "best") == lowest
    # by accuracy (the default) a step checkpoint would rank last too: the stand-in is per direction
    step = next(p for p, meta in found if "in_epoch" in meta)
    assert POLICY.for_metric("val_loss").rank_key(ckpt.read_meta(step)) < \
        min(POLICY.for_metric("val_loss").rank_key(meta) for p, meta in found if "in_epoch" not in meta)


def test_retention_by_loss_keeps_the_lowest_loss_checkpoint(tiny_cnn, tiny_data, tmp_path):
    result = imgtrain.train(tiny_config(tiny_data, tmp_path, "keep1", **dict(SETTINGS, num_to_keep=1, epochs=2,
                                                                            early_stop=0, average_last=0)),
                            display=quiet_display())
    kept = [p.name for p in sorted(result.path.iterdir()) if POLICY.is_checkpoint(p.name)]
    losses = {r["checkpoint"]: r["val_loss"] for r in result.history}
    assert set(kept) == {min(losses, key=losses.get), result.history[-1]["checkpoint"]}


def test_the_average_checkpoint_holds_the_mean_of_the_last_epochs_weights(stopped):
    average = stopped.path / POLICY.average_name(1)
    assert stopped.latest_checkpoint == average and ckpt.read_meta(average)["average"] == {"epochs": [0, 1]}
    epochs = [model_state(stopped.path / POLICY.epoch_name(e)) for e in (0, 1)]
    averaged = model_state(average)
    for name, value in averaged.items():
        mean = (epochs[0][name].double() + epochs[1][name].double()) / 2
        if "running_" in name:  # BatchNorm statistics: recomputed for the averaged weights, not averaged
            assert not torch.allclose(value.double(), mean)
        elif value.is_floating_point():
            torch.testing.assert_close(value.double(), mean, rtol=1e-6, atol=1e-7)
    assert stopped.average["epochs"] == [0, 1] and stopped.average["checkpoint"] == average.name


def test_evaluate_can_use_the_average_checkpoint(stopped):
    from imgtrain.inference.batch import InferenceOptions

    ev = imgtrain.evaluate(str(stopped.path), "average", options=InferenceOptions(backend="local"))
    assert ev.checkpoint == str(stopped.path / POLICY.average_name(1))
    assert ev.accuracy == pytest.approx(stopped.average["val_accuracy"])  # what training validated


def test_a_run_without_an_average_has_none_to_evaluate(stopped, tmp_path):
    run = tmp_path / "sel"
    shutil.copytree(stopped.path, run, symlinks=True)
    shutil.rmtree(run / POLICY.average_name(1))
    with pytest.raises(ImgtrainError, match="no averaged checkpoint.*--average-last"):
        runs.resolve_checkpoint(str(run), "average")


# ---------------------------------------------------------------- resumed runs decide and average alike


def restored(checkpoint, cfg):
    """A fresh model, optimizer and moving average restored from ``checkpoint``."""
    from imgtrain.models.zoo import build_from_args
    from imgtrain.training.checkpointing import restore
    from imgtrain.training.recipe import optimizer_for, weight_average

    model = build_from_args(ckpt.read_meta(checkpoint)["model_args"])
    optimizer, ema = optimizer_for(model, cfg), weight_average(model, cfg.ema_decay)
    resumed = restore(str(checkpoint), model, optimizer, ema, torch.device("cpu"))
    return resumed, model.state_dict(), ema.module.state_dict(), optimizer.state_dict()


def test_the_average_checkpoint_resumes_training_as_the_last_epochs_does(stopped):
    """Ray Train hands a retried or extended run its latest checkpoint: the average's. It holds
    the last epoch's training state, not the averaged weights, and says it is made already."""
    cfg = tiny_config("", "", "sel", **SETTINGS)
    from_average = restored(stopped.path / POLICY.average_name(1), cfg)
    from_epoch = restored(stopped.path / POLICY.epoch_name(1), cfg)
    assert from_average[0].averaged and not from_epoch[0].averaged
    assert (from_average[0].epoch, from_average[0].step, from_average[0].history) == \
        (from_epoch[0].epoch, from_epoch[0].step, from_epoch[0].history)
    for average_state, epoch_state in zip(from_average[1:3], from_epoch[1:3]):  # weights, moving average
        assert all(torch.equal(average_state[k], epoch_state[k]) for k in epoch_state)
    assert from_average[0].window["epochs"] == from_epoch[0].window["epochs"] == [0, 1]


def test_a_run_killed_before_averaging_averages_the_same_weights_from_its_checkpoint(stopped, tiny_data, tmp_path):
    """Only the last epoch's checkpoint left (as --num-to-keep 1 with a worse last epoch would
    leave, after a crash before the average): the window it carries gives the same average."""
    run = tmp_path / "sel"
    shutil.copytree(stopped.path, run, symlinks=True)
    for path, _ in ckpt.listing(run):
        if path.name != POLICY.epoch_name(1):
            shutil.rmtree(path)
    again = imgtrain.train(tiny_config(tiny_data, tmp_path, "sel", **SETTINGS), display=quiet_display())
    assert again.history == stopped.history and again.stopped_early == stopped.stopped_early
    redone, original = model_state(run / POLICY.average_name(1)), model_state(stopped.path / POLICY.average_name(1))
    assert all(torch.equal(redone[k], original[k]) for k in original)


def test_a_run_that_failed_inside_an_epoch_stops_at_the_same_epoch_when_resumed(stopped, tiny_data, tmp_path,
                                                                               monkeypatch):
    cfg = tiny_config(tiny_data, tmp_path, "sel", **SETTINGS)
    monkeypatch.setenv(ENV_VAR, "raise:0:3")  # about to train step 3: inside the second epoch
    with pytest.raises(Exception, match="injected"):
        imgtrain.train(cfg, display=quiet_display())
    monkeypatch.delenv(ENV_VAR)
    resumed = imgtrain.train(cfg, display=quiet_display())
    key = ("epoch", "step", "train_loss", "val_loss", "val_accuracy", "val_f1_macro")
    assert [[r[k] for k in key] for r in resumed.history] == [[r[k] for k in key] for r in stopped.history]
    assert resumed.stopped_early == stopped.stopped_early
    redone = model_state(resumed.path / POLICY.average_name(1))
    original = model_state(stopped.path / POLICY.average_name(1))
    assert all(torch.equal(redone[k], original[k]) for k in original)


# ---------------------------------------------------------------- settings


def test_average_last_longer_than_the_run_is_one_line(tiny_data, tmp_path, capsys):
    from tests.conftest import assert_one_line_error

    proc = cli_here(capsys, "train", "--data", str(tiny_data), "--storage", str(tmp_path), "--name", "x",
                    "--backend", "local", "--epochs", "2", "--average-last", "3")
    assert_one_line_error(proc, "--average-last 3", "--epochs 2")


def test_defaults_keep_todays_selection():
    from imgtrain.config import TrainConfig

    cfg = TrainConfig()
    assert (cfg.select_metric, cfg.early_stop, cfg.early_stop_min_delta, cfg.average_last) == \
        ("val_accuracy", 0, 0.0, 0)
    assert POLICY.for_metric(cfg.select_metric) == POLICY
    assert dataclasses.replace(POLICY.for_metric("val_loss"), metric="val_accuracy", mode="max", unevaluated=-1.0) \
        == POLICY
