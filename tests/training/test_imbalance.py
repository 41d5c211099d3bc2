"""Imbalanced data: --class-weights auto weighs the loss by inverse class frequency, and
--sampling balanced draws class-balanced epochs that stay a function of (seed, epoch), so a
resumed run trains exactly as an uninterrupted one (with mixup and CutMix on as well)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.utils.class_weight import compute_class_weight

import imgtrain
from imgtrain.config import TrainConfig
from imgtrain.data.order import epoch_order, epoch_permutation
from imgtrain.storage import checkpoint as ckpt
from imgtrain.training.faults import ENV_VAR as FAULT_ENV
from imgtrain.training.faults import InjectedFault
from imgtrain.models import registry
from imgtrain.training.loop import class_weights
from tests.conftest import quiet_display
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


@pytest.fixture(scope="module")
def imbalanced_photos(tmp_path_factory):
    """A streamed (encoded) data set with 48, 12 and 4 training photos per class."""
    from imgtrain.data.options import PrepareOptions
    from imgtrain.data.prepare import prepare
    from tests.integration.test_streamed import make_photos

    root = tmp_path_factory.mktemp("imbalanced")
    make_photos(root / "src", per_class=60, size=16)
    for c, keep in ((1, 15), (2, 5), (3, 0)):
        for path in sorted((root / "src" / f"class{c}").iterdir())[keep:]:
            path.unlink()
    (root / "src" / "class3").rmdir()
    manifest = prepare("folder", root / "data", root / "src", PrepareOptions(size=(16, 16), test_fraction=0.2))
    assert manifest["storage"] == "encoded" and manifest["class_counts"]["train"] == [48, 12, 4]
    return root / "data", manifest


def streamed_epoch(data, manifest, world: int, epoch: int = 0, first_step: int = 0, **settings):
    """The (ids, labels) the ranks of a world train on, global batch by global batch, as
    --backend local streams them."""
    from imgtrain.training.ingest import streamed_train_batches

    cfg = TrainConfig(data=str(data), batch_size=8, seed=3, **{"sampling": "balanced", **settings})
    per_rank = [list(streamed_train_batches(cfg, manifest, rank, world, "cpu", "local")(epoch, first_step))
                for rank in range(world)]
    ranks_in_step_order = [batch for step in zip(*per_rank) for batch in step]
    return tuple(torch.cat([batch[key] for batch in ranks_in_step_order]) for key in ("id", "label"))


def test_balanced_epochs_of_a_streamed_data_set_are_balanced_and_the_same_at_any_world_size(imbalanced_photos):
    data, manifest = imbalanced_photos
    ids, labels = streamed_epoch(data, manifest, world=1)
    assert len(ids) == 64  # 8 whole global batches: as many rows as the split has
    shares = torch.bincount(labels, minlength=3).double() / len(labels)
    assert torch.all((shares - 1 / 3).abs() < 0.15), shares  # 75 %, 19 %, 6 % drawn as about thirds
    assert len(set(ids[labels == 2].tolist())) <= 4 < int((labels == 2).sum())  # the rare photos repeat
    assert torch.equal(torch.cat(streamed_epoch(data, manifest, world=2)), torch.cat((ids, labels)))
    # resumed after global step 4, a world of 2 trains on the rest of the very same epoch
    tail_ids, _ = streamed_epoch(data, manifest, world=2, first_step=4)
    assert torch.equal(tail_ids, ids[32:])
    assert not torch.equal(streamed_epoch(data, manifest, world=1, epoch=1)[0], ids)
    # the default stays the shuffle: each row once
    shuffled, _ = streamed_epoch(data, manifest, world=1, sampling="shuffle")
    assert len(set(shuffled.tolist())) == len(shuffled) == 64


