"""The global sample order: the same rows at the same step whatever the number of workers."""

import torch

from imgtrain.data.order import augment_draw, epoch_permutation, rank_rows


def rows_per_step(perm, steps, batch, world):
    return [torch.cat([rank_rows(perm, k, batch, world, r) for r in range(world)]) for k in range(steps)]


def test_every_world_size_trains_the_same_rows_at_each_step():
    perm = epoch_permutation(1000, seed=3, epoch=2)
    one = rows_per_step(perm, 7, 128, 1)
    for world in (2, 3, 5):
        assert all(torch.equal(a, b) for a, b in zip(one, rows_per_step(perm, 7, 128, world)))
    seen = torch.cat(one)
    assert len(seen) == 7 * 128 and len(set(seen.tolist())) == len(seen)  # no row twice in an epoch


def test_the_order_changes_with_epoch_and_seed_but_is_reproducible():
    a = epoch_permutation(500, 0, 0)
    assert torch.equal(a, epoch_permutation(500, 0, 0))
    assert not torch.equal(a, epoch_permutation(500, 0, 1))
    assert not torch.equal(a, epoch_permutation(500, 1, 0))
    assert sorted(a.tolist()) == list(range(500))


def test_augmentation_numbers_follow_the_row_not_the_rank():
    whole = augment_draw(0, 17, 10, 1, 0)
    split = torch.cat([augment_draw(0, 17, 10, 3, r) for r in range(3)])
    assert torch.equal(whole, split)
    assert not torch.equal(whole, augment_draw(0, 18, 10, 1, 0))
    assert whole.min() >= -1 and whole.max() < 1
