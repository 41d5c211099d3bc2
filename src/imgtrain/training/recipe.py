"""The recipe: optimizer, moving average of the weights, one-cycle learning rate (see the README's
"The default recipe" and docs/NOTES.md for the measurements behind it)."""

from __future__ import annotations

import torch
import torch.nn as nn

from imgtrain.config import TrainConfig


def optimizer_for(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    params = parameter_groups(model, cfg)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=0.9, nesterov=True, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def parameter_groups(model: nn.Module, cfg: TrainConfig):
    """One group, or for fine-tuning two: the classifier's (group 0, the full LR) and the
    backbone's (group 1, ``lr_scale`` of it; LR 0 while frozen, see ``freeze``)."""
    if cfg.backbone_lr_scale == 1 and not cfg.freeze_backbone:
        return model.parameters()
    from imgtrain.checkpoint import unwrap
    from imgtrain.zoo import head_name

    net = unwrap(model)
    head = head_name(net) + "."
    named = list(net.named_parameters())
    return [{"params": [p for n, p in named if n.startswith(head)], "lr_scale": 1.0},
            {"params": [p for n, p in named if not n.startswith(head)], "lr_scale": cfg.backbone_lr_scale}]


def freeze(optimizer, frozen: bool) -> None:
    """Hold the backbone still for this step: LR 0 moves no weight under AdamW (its decay is
    LR x weight decay too) or SGD. The schedule sets the group's LR afresh at every step."""
    if frozen:
        optimizer.param_groups[1]["lr"] = 0.0


def weight_average(model: nn.Module, decay: float):
    """Moving average of weights and BatchNorm statistics, or None when decay is 0.

    The decay warms up as (1 + n) / (10 + n) until it reaches ``decay``, so that a short run
    is not dominated by the random initial weights.
    """
    if not decay:
        return None
    from torch.optim.swa_utils import AveragedModel

    @torch.no_grad()
    def update(averaged: list, current: list, num_averaged) -> None:
        if not torch.is_floating_point(averaged[0]):  # BatchNorm's step counters: just copy
            torch._foreach_copy_(averaged, current)
            return
        n = float(num_averaged)
        d = min(decay, (1.0 + n) / (10.0 + n))
        torch._foreach_lerp_(averaged, current, 1.0 - d)

    return AveragedModel(model, multi_avg_fn=update, use_buffers=True)


def one_cycle(optimizer, cfg: TrainConfig, remaining: int, saved: dict | None):
    """One-cycle LR over the run. A resumed run continues its saved cycle when that cycle has
    exactly the steps left that the run has; otherwise (more epochs than the run started with,
    another step limit) a fresh cycle covers the steps that remain."""
    remaining = max(1, remaining)
    if saved is not None and saved["total_steps"] - saved["last_epoch"] == remaining:
        # Constructing the scheduler resets every group's LR and momentum (betas) to the
        # cycle's start; the optimizer's restored values are the ones the next step must use.
        restored = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        sched = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=_peaks(optimizer, cfg), total_steps=saved["total_steps"], pct_start=cfg.warmup_fraction
        )
        sched.load_state_dict(saved)
        for group, values in zip(optimizer.param_groups, restored):
            group.update(values)
        return sched
    return torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=_peaks(optimizer, cfg), total_steps=remaining, pct_start=cfg.warmup_fraction
    )


def _peaks(optimizer, cfg: TrainConfig) -> list[float]:
    return [cfg.lr * group.get("lr_scale", 1.0) for group in optimizer.param_groups]
