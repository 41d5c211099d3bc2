"""Imbalanced data: --class-weights auto weighs the loss by inverse class frequency, and
--sampling balanced draws class-balanced epochs that stay a function of (seed, epoch), so a
resumed run trains exactly as an uninterrupted one (with mixup and CutMix on as well)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.utils.class_weight import compute_class_weight

import imgtrain
from imgtrain import checkpoint as ckpt
from imgtrain.config import TrainConfig
from imgtrain.data.order import epoch_order, epoch_permutation
from imgtrain.training.faults import ENV_VAR as FAULT_ENV
from imgtrain.training.faults import InjectedFault
from imgtrain.models import registry
from imgtrain.training.loop import class_weights
from tests.conftest import assert_one_line_error, cli_here, quiet_display
from tests.test_model_registry import TINY_CNNS

# 256 rows / batch 64 = 4 steps per epoch, 8 in all; a step checkpoint after steps 2 and 6. The
# tests' tiny CNN (one BatchNorm layer): the order, the weights and the mixing are what is tested.
SETTINGS = dict(backend="local", model="tinycnn_8", epochs=2, batch_size=64, eval_batch_size=50, log_every_steps=2,
                checkpoint_every_steps=2, deterministic=True, threads_per_worker=1,
                sampling="balanced", class_weights="auto", ledger=True, mixup=0.4, cutmix=1.0, label_smoothing=0.1)


def test_auto_class_weights_are_scikit_learns_balanced_weights():
    labels = np.repeat([0, 1, 3], [600, 60, 6])  # class 2 has no training image
    manifest = {"class_counts": {"train": np.bincount(labels, minlength=4).tolist()}}
    weights = class_weights(TrainConfig(class_weights="auto"), manifest, "cpu")
    expected = compute_class_weight("balanced", classes=np.array([0, 1, 3]), y=labels)
    np.testing.assert_allclose(weights[[0, 1, 3]].numpy(), expected, rtol=1e-6)
    assert weights[2] == 0
    assert class_weights(TrainConfig(), manifest, "cpu") is None


def test_balanced_epochs_are_balanced_reproducible_and_new_each_epoch():
    labels = torch.from_numpy(np.repeat([0, 1, 2], [1000, 100, 10]))
    order = epoch_order(labels, seed=0, epoch=0, balanced=True)
    assert len(order) == len(labels)
    shares = torch.bincount(labels[order], minlength=3).double() / len(order)
    assert torch.all((shares - 1 / 3).abs() < 0.05), shares  # a 100:1 split drawn as thirds
    assert torch.equal(order, epoch_order(labels, seed=0, epoch=0, balanced=True))
    assert not torch.equal(order, epoch_order(labels, seed=0, epoch=1, balanced=True))
    assert not torch.equal(order, epoch_order(labels, seed=1, epoch=0, balanced=True))
    # the default stays the permutation every run so far was trained with
    assert torch.equal(epoch_order(labels, 0, 0), epoch_permutation(len(labels), 0, 0))


@pytest.fixture
def tiny_cnn(monkeypatch):
    monkeypatch.setattr(registry, "_FAMILIES", list(registry._FAMILIES))
    registry.register(TINY_CNNS)


def test_a_balanced_weighted_mixed_run_resumes_to_the_uninterrupted_runs_bits(tiny_cnn, tiny_data, tmp_path,
                                                                              monkeypatch):
    def config(name: str) -> TrainConfig:
        return TrainConfig(data=str(tiny_data), storage=str(tmp_path), name=name, **SETTINGS)

    reference = imgtrain.train(config("ref"), display=quiet_display())
    monkeypatch.setenv(FAULT_ENV, "raise:0:3")  # epoch 0, after the step-2 checkpoint
    with pytest.raises(InjectedFault):
        imgtrain.train(config("cut"), display=quiet_display())
    monkeypatch.delenv(FAULT_ENV)
    resumed = imgtrain.train(config("cut"), display=quiet_display())
    assert resumed.status == "finished"
    a, b = ckpt.load_model_state(resumed.latest_checkpoint), ckpt.load_model_state(reference.latest_checkpoint)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert list(resumed.metrics["train_loss"]) == list(reference.metrics["train_loss"])


def test_balanced_sampling_of_a_streamed_data_set_is_refused_in_seconds(tmp_path, capsys):
    from imgtrain.data.options import PrepareOptions
    from imgtrain.data.prepare import prepare
    from tests.integration.test_streamed import make_photos

    make_photos(tmp_path / "src", per_class=3)
    prepare("folder", tmp_path / "data", tmp_path / "src", PrepareOptions(size=(16, 16)))
    proc = cli_here(capsys, "train", "--data", str(tmp_path / "data"), "--storage", str(tmp_path), "--name", "b",
                    "--backend", "local", "--batch-size", "4", "--sampling", "balanced")
    assert_one_line_error(proc, "--sampling balanced", "--class-weights auto")
    assert not (tmp_path / "b").exists()
