"""Multi-label training's pieces without a run: the losses against a hand computation, the
positive weights' rule, mixup on label vectors (the same targets at any world size), the
training accuracy's rule, the settings refused and ``--sampling balanced`` refused for a
multi-label data set."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from imgtrain.config import TrainConfig, rank_share, validate
from imgtrain.errors import ImgtrainError
from imgtrain.training import mixing, multilabel
from imgtrain.training.backend import single_process_collectives
from imgtrain.training.driver import _label_problem

LOGITS = torch.tensor([[2.0, -1.0, 0.5], [-3.0, 0.0, 1.5]])
TARGETS = torch.tensor([[1, 0, 1], [0, 1, 0]], dtype=torch.uint8)


def sigmoid(z: float) -> float:
    return 1 / (1 + math.exp(-z))


def by_hand(per_label) -> float:
    """The loss's reduction: the mean over the labels of a row, summed over the rows."""
    return sum(sum(per_label(z, t, c) for c, (z, t) in enumerate(zip(zs, ts))) / len(zs)
               for zs, ts in zip(LOGITS.tolist(), TARGETS.tolist()))


def test_binary_cross_entropy_by_hand_with_positive_weights_and_smoothing():
    weights = [2.0, 1.0, 0.5]

    def bce(z, t, c, w=None, eps=0.0):
        t = t * (1 - eps) + eps / 2
        p = sigmoid(z)
        return -((w[c] if w else 1.0) * t * math.log(p) + (1 - t) * math.log(1 - p))

    assert multilabel.MultiLabelLoss("bce")(LOGITS, TARGETS).item() == pytest.approx(by_hand(bce))
    weighted = multilabel.MultiLabelLoss("bce", torch.tensor(weights))(LOGITS, TARGETS).item()
    assert weighted == pytest.approx(by_hand(lambda z, t, c: bce(z, t, c, weights)))
    smoothed = multilabel.MultiLabelLoss("bce", smoothing=0.2)(LOGITS, TARGETS).item()
    assert smoothed == pytest.approx(by_hand(lambda z, t, c: bce(z, t, c, eps=0.2)))


def test_asymmetric_loss_by_hand_and_binary_cross_entropy_without_focusing_or_margin():
    def asl(z, t, c, gamma_neg=4.0, gamma_pos=0.0, clip=0.05):
        p = sigmoid(z)
        p_m = max(p - clip, 0.0)
        return -(t * (1 - p) ** gamma_pos * math.log(p) + (1 - t) * p_m ** gamma_neg * math.log(1 - p_m))

    got = multilabel.MultiLabelLoss("asl")(LOGITS, TARGETS).item()  # the defaults: 4, 0, 0.05
    assert got == pytest.approx(by_hand(asl), rel=1e-6)
    focused = multilabel.MultiLabelLoss("asl", gamma_neg=2.0, gamma_pos=1.0, clip=0.1)(LOGITS, TARGETS).item()
    assert focused == pytest.approx(by_hand(lambda z, t, c: asl(z, t, c, 2.0, 1.0, 0.1)), rel=1e-6)
    plain = multilabel.MultiLabelLoss("asl", gamma_neg=0.0, gamma_pos=0.0, clip=0.0)(LOGITS, TARGETS).item()
    assert plain == pytest.approx(multilabel.MultiLabelLoss("bce")(LOGITS, TARGETS).item(), rel=1e-6)
    # an easy negative below the margin costs nothing
    assert multilabel.MultiLabelLoss("asl")(torch.tensor([[-5.0]]), torch.tensor([[0]])).item() == 0.0


def test_positive_weights_are_negatives_over_positives():
    manifest = {"class_counts": {"train": [10, 40, 0]}, "splits": {"train": {"num_samples": 50}}}
    cfg = TrainConfig(class_weights="auto")
    assert multilabel.positive_weights(cfg, manifest, "cpu").tolist() == [4.0, 0.25, 1.0]
    assert multilabel.positive_weights(TrainConfig(), manifest, "cpu") is None


class Rank:
    """One rank of a world whose all_gather returns every rank's share of the global batch."""

    def __init__(self, world_size: int, rank: int, images: torch.Tensor, labels: torch.Tensor, batch: int):
        self.world_size, self.rank = world_size, rank
        self.shares = {tuple(images.shape[1:]): images, tuple(labels.shape[1:]): labels}
        self.batch = batch

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        whole = self.shares[tuple(t.shape[1:])]
        parts = [whole[rank_share(self.batch, self.world_size, r)] for r in range(self.world_size)]
        out = torch.zeros((self.world_size, len(t), *t.shape[1:]), dtype=t.dtype)
        for r, part in enumerate(parts):
            out[r, :len(part)] = part
        return out


def test_mixup_mixes_the_label_vectors_alike_at_any_world_size():
    batch, classes = 6, 4
    g = torch.Generator().manual_seed(0)
    images = torch.rand(batch, 1, 4, 4, generator=g)
    labels = (torch.rand(batch, classes, generator=g) < 0.5).to(torch.uint8)
    mix = mixing.Mix(0.7)
    one = Rank(1, 0, images, labels, batch)
    _, target, counted = mixing.mixed(images, labels, mix, classes, one, batch)
    mirror = labels.flip(0).float()
    assert torch.allclose(target, 0.7 * labels.float() + 0.3 * mirror)
    assert torch.equal(counted, target)  # a multi-label row is counted from its mixed vector
    parts = []
    for r in range(2):
        share = rank_share(batch, 2, r)
        parts.append(mixing.mixed(images[share], labels[share], mix, classes, Rank(2, r, images, labels, batch),
                                  batch)[1])
    assert torch.equal(torch.cat(parts), target)
    box = mixing.Mix(0.75, (0, 2, 0, 2))  # CutMix: a quarter of each image is its partner's
    _, boxed, _ = mixing.mixed(images, labels, box, classes, one, batch)
    assert torch.allclose(boxed, 0.75 * labels.float() + 0.25 * mirror)


def test_a_row_is_right_when_every_label_is():
    logits = torch.tensor([[1.0, -1.0], [1.0, 1.0], [-1.0, -2.0]])
    assert multilabel.predicted_right(logits, torch.tensor([[1, 0], [1, 0], [0, 0]])).item() == 2
    assert multilabel.predicted_right(logits, torch.tensor([[0.7, 0.3], [0.5, 0.6], [0.2, 0.1]])).item() == 3


def test_asymmetric_loss_settings_need_the_asymmetric_loss():
    validate(TrainConfig(name="x", multi_label_loss="asl", asl_gamma_neg=2.0))
    with pytest.raises(ImgtrainError, match="--asl-gamma-neg is the asymmetric loss's"):
        validate(TrainConfig(name="x", asl_gamma_neg=2.0))


def test_balanced_sampling_is_refused_for_a_multi_label_set_and_val_map_for_a_single_label_one():
    multi, single = {"multi_label": True}, {}
    assert "--sampling balanced" in _label_problem(TrainConfig(sampling="balanced"), multi)
    assert _label_problem(TrainConfig(sampling="balanced"), single) is None
    assert _label_problem(TrainConfig(select_metric="val_map"), multi) is None
    assert "multi-label figure" in _label_problem(TrainConfig(select_metric="val_map"), single)


def test_validation_figures_and_thresholds_of_one_rank():
    manifest = {"num_classes": 2, "splits": {"train": {}, "val": {}}}
    backend = dataclasses.make_dataclass("B", [("world_size", int)])(1)
    backend.all_reduce_sum = single_process_collectives()["all_reduce_sum"]
    logits = [torch.tensor([[3.0, -2.0], [1.0, 0.5]]), torch.tensor([[-1.0, 2.0]])]
    targets = [torch.tensor([[1, 0], [0, 1]], dtype=torch.uint8), torch.tensor([[0, 1]], dtype=torch.uint8)]
    figures, thresholds = multilabel.validate(backend, manifest, logits, targets, torch.tensor([3.0, 3.0]))
    assert figures["val_map"] == pytest.approx(1.0) and figures["val_samples"] == 3 and figures["val_loss"] == 1.0
    assert figures["val_accuracy"] == pytest.approx(2 / 3)  # row 2 calls label 0 at 0.5
    # halfway between the lowest score called positive and the next lower one
    assert thresholds.tolist() == pytest.approx([(sigmoid(3.0) + sigmoid(1.0)) / 2, (sigmoid(0.5) + sigmoid(-2.0)) / 2])
    no_val = {"num_classes": 2, "splits": {"train": {}, "test": {}}}
    assert multilabel.validate(backend, no_val, logits, targets, torch.zeros(2))[1].tolist() == [0.5, 0.5]


def test_thresholds_are_stored_with_the_checkpoint_verified_and_held_to_their_bounds(tmp_path):
    from imgtrain.storage import checkpoint as ckpt

    kept = {"thresholds": torch.tensor([0.25, 0.5, 0.875]), "chosen_on": "val"}
    d = ckpt.save(tmp_path / "c", {"w": torch.zeros(1)}, {}, {}, thresholds=kept)
    assert ckpt.THRESHOLDS_FILE in ckpt.verify(d)["sha256"]
    values, chosen_on = ckpt.load_thresholds(d, 3)
    assert values.tolist() == [0.25, 0.5, 0.875] and chosen_on == "val"
    with pytest.raises(ckpt.CheckpointError, match="does not hold 4 thresholds"):
        ckpt.load_thresholds(d, 4)
    torch.save({"thresholds": torch.tensor([0.25, 0.5, 1.5])}, d / ckpt.THRESHOLDS_FILE)
    with pytest.raises(ckpt.CheckpointError, match="fails its sha256"):
        ckpt.verify(d)
    with pytest.raises(ckpt.CheckpointError, match="between 0 and 1"):
        ckpt.load_thresholds(d, 3)
    assert ckpt.load_thresholds(ckpt.save(tmp_path / "none", {}, {}, {}), 3) == (None, None)


def test_trains_last_line_names_a_multi_label_runs_map_and_a_single_label_runs_accuracy():
    from types import SimpleNamespace

    from imgtrain.cli import _finished_line

    def run(**record):
        best = {"epoch": 1, "val_accuracy": 0.25, "val_split": "val", **record}
        return SimpleNamespace(name="g", best_record=best, config={"storage": None})

    assert _finished_line(run(val_map=0.8123)) == \
        "finished g: best checkpoint epoch 2, validation mAP 0.8123; run `imgtrain evaluate g` for the test split"
    assert _finished_line(run()) == \
        "finished g: best checkpoint epoch 2, validation accuracy 25.00%; run `imgtrain evaluate g` for the test split"
