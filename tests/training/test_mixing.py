"""Mixup and CutMix: soft targets that sum to 1, drawn from (seed, step) alone, the same mixed
images at any world size, and label smoothing applied to the mixed target."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from imgtrain.config import TrainConfig, rank_share
from imgtrain.training import mixing
from imgtrain.training.backend import single_process_collectives

BATCH, CLASSES = 10, 5


def cfg(**overrides) -> TrainConfig:
    return dataclasses.replace(TrainConfig(epochs=4), **overrides)


@dataclasses.dataclass
class Rank:
    """One rank of a world whose all_gather returns what every rank holds (the stacked shares
    torch.distributed's all_gather would return: here every share is known to the test)."""

    world_size: int
    rank: int
    shares: list  # per rank: (images, labels), padded as mixing pads them

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        which = 0 if t.dim() > 1 else 1
        most = max(len(s[which]) for s in self.shares)
        out = []
        for s in self.shares:
            padded = torch.zeros((most, *s[which].shape[1:]), dtype=s[which].dtype)
            padded[:len(s[which])] = s[which]
            out.append(padded)
        return torch.stack(out)


def global_batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(BATCH, 3, 8, 8, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)


def test_the_draw_is_a_function_of_seed_and_step_and_stops_for_the_last_epochs():
    c = cfg(mixup=0.4, cutmix=1.0, mix_off_epochs=1)
    assert mixing.draw(c, 7, 0, 8, 8) == mixing.draw(c, 7, 0, 8, 8)
    draws = [mixing.draw(c, step, 0, 8, 8) for step in range(40)]
    blends = [d.lam for d in draws if d.box is None]
    assert len(set(blends)) == len(blends) > 5  # a new weight every step (CutMix's are whole pixels)
    assert draws != [mixing.draw(dataclasses.replace(c, seed=1), step, 0, 8, 8) for step in range(40)]
    kinds = {d.box is None for d in draws}
    assert kinds == {True, False}  # both mixup and cutmix steps
    assert mixing.draw(c, 7, 3, 8, 8) is None  # the last epoch trains unmixed
    assert mixing.draw(cfg(), 7, 0, 8, 8) is None  # off by default
    assert all(mixing.draw(cfg(cutmix=1.0, mix_prob=0.0), s, 0, 8, 8) is None for s in range(20))
    only_cutmix = [mixing.draw(cfg(cutmix=1.0), s, 0, 8, 8) for s in range(20)]
    for d in only_cutmix:  # lam is the share of pixels left uncovered by the box
        y0, y1, x0, x1 = d.box
        assert d.lam == pytest.approx(1 - (y1 - y0) * (x1 - x0) / 64)


@pytest.mark.parametrize("kind", [dict(mixup=0.4), dict(cutmix=1.0)])
def test_targets_sum_to_one_and_follow_the_images(kind):
    x, y = global_batch()
    c = cfg(**kind)
    mix = next(m for s in range(50) if (m := mixing.draw(c, s, 0, 8, 8)) is not None and 0.1 < m.lam < 0.9)
    out, target, counted = mixing.mixed(x, y, mix, CLASSES, Rank(1, 0, [(x, y)]), BATCH)
    assert torch.allclose(target.sum(1), torch.ones(BATCH))
    mirror = torch.arange(BATCH - 1, -1, -1)
    expected = torch.nn.functional.one_hot(y, CLASSES) * mix.lam + torch.nn.functional.one_hot(y[mirror], CLASSES) * (1 - mix.lam)
    assert torch.allclose(target, expected.float())
    if mix.box is None:
        assert torch.allclose(out, x * mix.lam + x[mirror] * (1 - mix.lam))
    else:
        y0, y1, x0, x1 = mix.box
        assert torch.equal(out[:, :, y0:y1, x0:x1], x[mirror][:, :, y0:y1, x0:x1])
        outside = torch.ones(8, 8, dtype=torch.bool)
        outside[y0:y1, x0:x1] = False
        assert torch.equal(out[:, :, outside], x[:, :, outside])
    assert torch.equal(counted, y if mix.lam >= 0.5 else y[mirror])


@pytest.mark.parametrize("world", [2, 3])
def test_each_rank_mixes_its_rows_as_one_worker_mixes_them(world):
    x, y = global_batch(1)
    c = cfg(mixup=0.4, cutmix=1.0)
    for step in range(6):
        mix = mixing.draw(c, step, 0, 8, 8)
        alone = mixing.mixed(x, y, mix, CLASSES, Rank(1, 0, [(x, y)]), BATCH)
        shares = [(x[rank_share(BATCH, world, r)], y[rank_share(BATCH, world, r)]) for r in range(world)]
        for r in range(world):
            mine = rank_share(BATCH, world, r)
            out, target, counted = mixing.mixed(*shares[r], mix, CLASSES, Rank(world, r, shares), BATCH)
            assert torch.equal(out, alone[0][mine]) and torch.equal(target, alone[1][mine])
            assert torch.equal(counted, alone[2][mine])


def test_label_smoothing_applies_to_the_mixed_target_as_to_each_label():
    logits = torch.randn(6, CLASSES)
    a, b, lam = torch.tensor([0, 1, 2, 3, 4, 0]), torch.tensor([4, 3, 2, 1, 0, 1]), 0.3
    target = torch.nn.functional.one_hot(a, CLASSES) * lam + torch.nn.functional.one_hot(b, CLASSES) * (1 - lam)
    smoothed = torch.nn.CrossEntropyLoss(reduction="sum", label_smoothing=0.1)
    assert smoothed(logits, target.float()).item() == pytest.approx(
        lam * smoothed(logits, a).item() + (1 - lam) * smoothed(logits, b).item(), rel=1e-6)


def test_a_world_of_one_needs_no_collective():
    x, y = global_batch()
    mix = mixing.draw(cfg(mixup=1.0), 0, 0, 8, 8)
    backend = type("B", (), {"world_size": 1, "rank": 0, **single_process_collectives()})()
    out, _, _ = mixing.mixed(x, y, mix, CLASSES, backend, BATCH)
    assert out.shape == x.shape
