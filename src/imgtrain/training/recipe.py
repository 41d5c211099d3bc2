"""The recipe: optimizer, moving average of the weights, one-cycle learning rate (see the README's
"The default recipe" and docs/NOTES.md for the measurements behind it)."""

from __future__ import annotations

import copy
import itertools

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


def set_batchnorm_momentum(model: nn.Module, momentum: float) -> None:
    """Give every BatchNorm layer the run's momentum (0: keep the model's own). Running
    statistics are only used in evaluation, so a saved model loads the same either way."""
    if momentum:
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.momentum = momentum


def weight_average(model: nn.Module, decay: float) -> WeightAverage | None:
    """Moving average of ``model``'s weights and BatchNorm statistics, or None when decay is 0."""
    return WeightAverage(model, decay) if decay else None


class WeightAverage:
    """Exponential moving average of weights and buffers, updated after every optimizer step.

    The decay warms up as (1 + n) / (10 + n) until it reaches ``decay``, so that a short run
    is not dominated by the random initial weights. The same arithmetic as torch's
    ``AveragedModel(use_buffers=True)`` with a lerp, without its step count kept as a tensor:
    on a GPU that count costs two blocking host-device copies and a read back per step
    (issue 19). ``steps`` is a plain integer; the tensor lists are built once (the optimizer
    and ``load_state_dict`` update tensors in place).
    """

    def __init__(self, model: nn.Module, decay: float):
        self.module = copy.deepcopy(model)
        self.decay = decay
        self.steps = 0
        pairs = list(zip(self._tensors(self.module), self._tensors(model), strict=True))
        self._float = ([a for a, _ in pairs if a.is_floating_point()], [c for a, c in pairs if a.is_floating_point()])
        # BatchNorm's step counters: copied, not averaged
        self._other = ([a for a, _ in pairs if not a.is_floating_point()],
                       [c for a, c in pairs if not a.is_floating_point()])

    @staticmethod
    def _tensors(model: nn.Module) -> list[torch.Tensor]:
        return [t.detach() for t in itertools.chain(model.parameters(), model.buffers())]

    @torch.no_grad()
    def update(self) -> None:
        """Fold the model's current weights in (the first call copies them)."""
        if self._other[0]:
            torch._foreach_copy_(*self._other)
        if self.steps == 0:
            torch._foreach_copy_(*self._float)
        else:
            n = float(self.steps)
            torch._foreach_lerp_(*self._float, 1.0 - min(self.decay, (1.0 + n) / (10.0 + n)))
        self.steps += 1


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
