"""The recipe: optimizer, moving average of the weights, one-cycle learning rate (see docs/training.md
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
    from imgtrain.models.parts import head_name

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


def weight_average(model: nn.Module, decay: float, module: nn.Module | None = None) -> WeightAverage | None:
    """Moving average of ``model``'s weights and BatchNorm statistics, or None when decay is 0.
    ``module``: the model to hold the average, of the same structure (a sharded model's own
    sharded copy: FSDP modules are not deep-copied); by default a copy of ``model``."""
    return WeightAverage(model, decay, module) if decay else None


class WeightAverage:
    """Exponential moving average of weights and buffers, updated after every optimizer step.

    The decay warms up as (1 + n) / (10 + n) until it reaches ``decay``, so that a short run
    is not dominated by the random initial weights. The same arithmetic as torch's
    ``AveragedModel(use_buffers=True)`` with a lerp, without its step count kept as a tensor:
    on a GPU that count costs two blocking host-device copies and a read back per step
    (issue 19). ``steps`` is a plain integer; the tensor lists are built once (the optimizer
    and ``load_state_dict`` update tensors in place).

    Sharded models (FSDP) work the same: their parameters are DTensors holding this rank's
    shard, and the average of two identically sharded parameters is the average of their local
    shards. DTensor has no sharding rule for ``_foreach_copy_``, so the foreach ops take the
    local shards (``to_local()``, a view), fetched at every update: FSDP may re-point a
    parameter's local tensor (lazy initialisation), which a view kept from before would miss.
    """

    def __init__(self, model: nn.Module, decay: float, module: nn.Module | None = None):
        from torch.distributed.tensor import DTensor  # here: imported only by the workers that build one

        self.module = copy.deepcopy(model) if module is None else module
        self.decay = decay
        self.steps = 0
        pairs = list(zip(self._tensors(self.module), self._tensors(model), strict=True))

        def lists(keep) -> list[tuple[list, list]]:  # [(averages, sources)]: plain tensors, then DTensors
            found = [[(a, c) for a, c in pairs if keep(a) and isinstance(a, DTensor) == sharded] for sharded in (0, 1)]
            return [tuple(map(list, zip(*group))) for group in found if group]

        self._float = lists(lambda t: t.is_floating_point())
        self._other = lists(lambda t: not t.is_floating_point())  # BatchNorm's step counters: copied

    @staticmethod
    def _tensors(model: nn.Module) -> list[torch.Tensor]:
        from torch.distributed.tensor import DTensor

        return [t if isinstance(t, DTensor) else t.detach() for t in itertools.chain(model.parameters(), model.buffers())]

    @torch.no_grad()
    def update(self) -> None:
        """Fold the model's current weights in (the first call copies them)."""
        for averages, sources in map(_local, self._other):
            torch._foreach_copy_(averages, sources)
        n = float(self.steps)
        for averages, sources in map(_local, self._float):
            if self.steps == 0:
                torch._foreach_copy_(averages, sources)
            else:
                torch._foreach_lerp_(averages, sources, 1.0 - min(self.decay, (1.0 + n) / (10.0 + n)))
        self.steps += 1


def _local(lists: tuple[list, list]) -> tuple[list, list]:
    """A group of DTensors as their local shards (views); a group of plain tensors as it is."""
    if not hasattr(lists[0][0], "to_local"):
        return lists
    return tuple([t.to_local() for t in ts] for ts in lists)


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
