"""Which training rows each rank takes at each step: one global order, whatever the world size.

Epoch ``e`` visits the training split in a seeded random permutation ``perm_e``. Global step
``k`` of that epoch trains on rows ``perm_e[k*B:(k+1)*B]`` (``B`` the global batch), cut
between the ranks by ``per_worker_batch_sizes``. The order depends only on the seed and the
epoch, never on the number of workers, so a run that stops after step ``k`` restarts at row
``(k+1)*B`` of the same permutation with any world size: no row of the epoch is replayed,
none is skipped.

Augmentation draws its random numbers the same way: one seeded draw per global step for
the whole global batch, each rank taking its rows' share. A sample gets the same
transformation at the same step with 1 worker or 8.
"""

from __future__ import annotations

import torch

from imgtrain.config import rank_share

AUGMENT_PARAMS = 4  # random numbers per image: rotation, scale, x and y shift


def epoch_permutation(num_rows: int, seed: int, epoch: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_rows, generator=generator)


def epoch_order(labels: torch.Tensor, seed: int, epoch: int, balanced: bool = False) -> torch.Tensor:
    """The rows epoch ``epoch`` visits, in order: a permutation of them, or with ``balanced``
    (``--sampling balanced``) as many rows drawn with replacement, each class equally likely
    (a row of a class with n rows has probability 1 / (classes present x n)): rare classes are
    seen several times an epoch, frequent ones partly. Either way a function of (seed, epoch)
    alone, so exact resume and the world-size rule hold."""
    if not balanced:
        return epoch_permutation(len(labels), seed, epoch)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    weights = 1.0 / torch.bincount(labels)[labels].double()
    return torch.multinomial(weights, len(labels), replacement=True, generator=generator)


def rank_rows(perm: torch.Tensor, step: int, global_batch: int, world_size: int, rank: int) -> torch.Tensor:
    """Row positions this rank trains on at ``step`` (0-based within the epoch)."""
    share = rank_share(global_batch, world_size, rank)
    base = step * global_batch
    return perm[base + share.start : base + share.stop]


def augment_draw(seed: int, global_step: int, global_batch: int, world_size: int, rank: int) -> torch.Tensor:
    """Uniform [-1, 1) numbers [local batch, AUGMENT_PARAMS] for this rank's rows at this step."""
    generator = torch.Generator().manual_seed(seed * 7_919 + global_step * 104_729 + 1)
    draw = torch.rand(global_batch, AUGMENT_PARAMS, generator=generator).mul_(2).sub_(1)
    return draw[rank_share(global_batch, world_size, rank)]


def epoch_augment_draws(seed: int, first_global_step: int, steps: int, global_batch: int, world_size: int,
                        rank: int) -> torch.Tensor:
    """``augment_draw`` of ``steps`` consecutive global steps: [steps, local batch, AUGMENT_PARAMS]."""
    return torch.stack([augment_draw(seed, first_global_step + k, global_batch, world_size, rank)
                        for k in range(steps)])


def sort_by_id(ids: torch.Tensor, *columns: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The canonical row order both ingests share: ascending id (ids are unique per data set),
    whatever order the files or Ray Data blocks delivered the rows in."""
    index = torch.argsort(ids)
    return (ids[index], *(c[index] for c in columns))


def ordered_batches(rows: tuple[torch.Tensor, ...], seed: int, global_batch: int, steps: int,
                    world_size: int, rank: int, device: torch.device | str = "cpu", on_device: bool = False,
                    balanced: bool = False):
    """``train_batches(epoch, first_step)`` over rows (ids, images, labels) held in memory, in
    ``epoch_order``; images and labels are moved to ``device``, ids stay on the CPU.

    ``on_device``: images and labels are moved to the device once, here, and every batch is
    gathered there. Otherwise each batch is gathered on the host, pinned when the device is a
    GPU, and copied without blocking, so the copy overlaps the previous step's kernels.
    """
    ids, images, labels = rows
    host_labels = labels  # the epoch's order is drawn on the CPU, wherever the rows are
    device = torch.device(device)
    if on_device:
        images, labels = images.to(device), labels.to(device)
    pin = device.type == "cuda" and not on_device

    def to_device(t: torch.Tensor) -> torch.Tensor:
        return (t.pin_memory() if pin else t).to(device, non_blocking=True)

    def train_batches(epoch: int, first_step: int):
        perm = epoch_order(host_labels, seed, epoch, balanced)
        perm_there = perm.to(images.device)  # once per epoch, not one index copy per step
        for step in range(first_step, steps):
            index = rank_rows(perm, step, global_batch, world_size, rank)
            there = rank_rows(perm_there, step, global_batch, world_size, rank)
            yield {"id": ids[index], "image": to_device(images[there]), "label": to_device(labels[there])}

    return train_batches
