"""Mixup and CutMix (``--mixup ALPHA``, ``--cutmix ALPHA``) on whole global batches.

Each image of the global batch is mixed with its mirror in that batch (position i with B-1-i,
as timm mixes a batch with its reverse), with one mixing weight and one CutMix box for the
global step, all drawn from (seed, step) alone: every rank draws the same numbers, and a run
gets the same mixed images at any world size and after any resume. A rank's mirrors are mostly
other ranks' rows, so the ranks gather the global batch's images and labels first (a
collective per step, only while mixing is on).

The targets are soft: weight lam on the image's own label, 1 - lam on its partner's (for CutMix
lam is the share of pixels left uncovered); the cross-entropy's label smoothing then applies to
the mixed target, as smoothing the two labels before mixing would (the mix is linear). Training
accuracy on a mixed batch counts a prediction right when it names the label with the larger
share of the image.

A multi-label set's labels are multi-hot vectors [n, classes] already: they are mixed as they
are (an image keeps each of its labels at weight lam, takes its partner's at 1 - lam, a label
both carry stays 1), and the training accuracy counts a row right when every label of 1/2 or
more of the mix is predicted and no other (``multilabel.predicted_right``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from imgtrain.config import TrainConfig, per_worker_batch_sizes, rank_share


@dataclass(frozen=True)
class Mix:
    """One global step's mixing: its weight and, for CutMix, the box (rows y0:y1, columns x0:x1)."""

    lam: float
    box: tuple[int, int, int, int] | None = None


def enabled(cfg: TrainConfig) -> bool:
    return cfg.mixup > 0 or cfg.cutmix > 0


def draw(cfg: TrainConfig, global_step: int, epoch: int, height: int, width: int) -> Mix | None:
    """The step's mixing, or None for an unmixed step (off, not drawn by --mix-prob, or in the
    last --mix-off-epochs epochs). A pure function of (seed, step) and the settings."""
    if not enabled(cfg) or epoch >= cfg.epochs - cfg.mix_off_epochs:
        return None
    apply, switch, cy, cx = np.random.default_rng([cfg.seed, global_step, 0x313]).random(4)
    if apply >= cfg.mix_prob:
        return None
    use_cutmix = cfg.cutmix > 0 and (cfg.mixup == 0 or switch < cfg.mix_switch_prob)
    alpha = cfg.cutmix if use_cutmix else cfg.mixup
    lam = float(np.random.default_rng([cfg.seed, global_step, 0xBE7A]).beta(alpha, alpha))
    if not use_cutmix:
        return Mix(lam)
    # timm's box: side sqrt(1 - lam) of each dimension, centred at a uniform point, clipped
    cut_h, cut_w = int(height * np.sqrt(1 - lam)), int(width * np.sqrt(1 - lam))
    y, x = int(cy * height), int(cx * width)
    y0, y1 = np.clip([y - cut_h // 2, y + cut_h // 2], 0, height)
    x0, x1 = np.clip([x - cut_w // 2, x + cut_w // 2], 0, width)
    covered = (y1 - y0) * (x1 - x0) / (height * width)
    return Mix(1.0 - float(covered), (int(y0), int(y1), int(x0), int(x1)))


def mixed(x: torch.Tensor, y: torch.Tensor, mix: Mix, num_classes: int, backend,
          global_batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mixed images, soft targets [n, classes], the label with the larger share) of this rank's
    rows; ``x`` [n, C, H, W] and ``y`` [n] are its share of the global batch. A multi-label
    set's ``y`` is multi-hot [n, classes]: its third item is then the soft targets again."""
    world, rank = backend.world_size, backend.rank
    partner_x, partner_y = _mirrors(x, y, backend, world, rank, global_batch)
    if mix.box is None:
        out = x * mix.lam + partner_x * (1.0 - mix.lam)
    else:
        y0, y1, x0, x1 = mix.box
        out = x.clone()
        out[:, :, y0:y1, x0:x1] = partner_x[:, :, y0:y1, x0:x1]
    multi_label = y.ndim == 2
    own = y.to(x.dtype) if multi_label else torch.nn.functional.one_hot(y, num_classes).to(x.dtype)
    other = partner_y.to(x.dtype) if multi_label else torch.nn.functional.one_hot(partner_y, num_classes).to(x.dtype)
    target = own * mix.lam + other * (1.0 - mix.lam)
    if multi_label:
        return out, target, target
    return out, target, y if mix.lam >= 0.5 else partner_y


def _mirrors(x: torch.Tensor, y: torch.Tensor, backend, world: int, rank: int,
             global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The images and labels at the mirrored positions (B-1-i) of this rank's rows."""
    share = rank_share(global_batch, world, rank)
    mirror = torch.arange(global_batch - 1 - share.start, global_batch - 1 - share.stop, -1)
    if world == 1:
        return x[mirror], y[mirror]
    sizes = per_worker_batch_sizes(global_batch, world)
    most = max(sizes)

    def gathered(t: torch.Tensor) -> torch.Tensor:  # the global batch, in position order
        padded = torch.zeros((most, *t.shape[1:]), dtype=t.dtype, device=t.device)
        padded[:len(t)] = t
        # [world, most, ...]; the backend's collectives take CPU tensors: on a GPU a copy to the
        # host and back per step, paid only while mixing is on
        every = backend.all_gather(padded.cpu())
        return torch.cat([every[r, :sizes[r]] for r in range(world)]).to(t.device)

    return gathered(x)[mirror], gathered(y)[mirror]
