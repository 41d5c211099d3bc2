"""The recipe: optimizer and its parameter groups, moving average of the weights, learning-rate
schedule (see docs/training.md "The default recipe" and "Schedules and optimizers", and
docs/NOTES.md for the measurements behind it)."""

from __future__ import annotations

import copy
import fnmatch
import itertools
import math
from typing import Callable

import torch
import torch.nn as nn

from imgtrain.config import TrainConfig
from imgtrain.errors import ImgtrainError

# timm's optimizers for large global batches, which (as timm's own factory does) leave biases
# and normalisation weights undecayed; AdamW and SGD keep decaying every parameter, as before.
TIMM_OPTIMIZERS = ("lamb", "lars")


def optimizer_for(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    params = parameter_groups(model, cfg)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.momentum > 0,
                               weight_decay=cfg.weight_decay)
    if cfg.optimizer == "lamb":  # timm's defaults otherwise: betas (0.9, 0.999), its own clipping at norm 1
        return _timm_optim(cfg).Lamb(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "lars":
        return _timm_optim(cfg).Lars(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def _timm_optim(cfg: TrainConfig):
    try:
        import timm.optim
    except ImportError:
        raise ImgtrainError(f"--optimizer {cfg.optimizer} is timm's: pip install 'imgtrain[timm]'") from None
    return timm.optim


def parameter_groups(model: nn.Module, cfg: TrainConfig):
    """All parameters in one group, as they always were, unless the recipe needs more: then
    the classifier's groups first (the full LR; the LR logged is group 0's), then the others',
    deepest first. Each group says its ``lr_scale`` (of --lr: --backbone-lr-scale outside the
    classifier, times ``layer_decay ** (top - depth)``) and whether it is ``backbone`` (LR 0
    while frozen, see ``freeze``); for lamb/lars biases and norms get ``weight_decay`` 0."""
    split_decay = cfg.optimizer in TIMM_OPTIMIZERS
    if cfg.backbone_lr_scale == 1 and not cfg.freeze_backbone and not cfg.layer_decay and not split_decay:
        return model.parameters()
    from imgtrain.storage.checkpoint import unwrap
    from imgtrain.models.parts import head_name

    net = unwrap(model)
    head = head_name(net) + "."
    depth = _layer_ids(net, cfg) if cfg.layer_decay else {}
    top = max(depth.values(), default=0)
    # timm's as its factory's: its models name parameters not to decay (ViT's cls_token, pos_embed)
    undecayed = set(net.no_weight_decay()) if split_decay and hasattr(net, "no_weight_decay") else set()
    groups = {}
    for name, p in net.named_parameters():
        backbone = not name.startswith(head)
        below = top - depth.get(name, top) if backbone else 0  # layers below the top (the classifier's)
        decays = not (split_decay and (p.ndim <= 1 or name.endswith(".bias")
                                       or any(fnmatch.fnmatch(name, pattern) for pattern in undecayed)))
        key = (backbone, below, not decays)  # sorted: the classifier first, then from the top down
        if key not in groups:
            scale = (cfg.backbone_lr_scale if backbone else 1.0) * (cfg.layer_decay ** below if below else 1.0)
            groups[key] = {"params": [], "lr_scale": scale, "backbone": backbone}
            if not decays:
                groups[key]["weight_decay"] = 0.0
        groups[key]["params"].append(p)
    return [groups[key] for key in sorted(groups)]


def _layer_ids(net: nn.Module, cfg: TrainConfig) -> dict[str, int]:
    from imgtrain.models.parts import layer_ids

    try:
        return layer_ids(net)
    except ValueError as e:
        raise ImgtrainError(f"--layer-decay: {cfg.model}: {e}; drop --layer-decay or choose another model "
                            "(any timm:NAME model works)") from None


def freeze(optimizer, frozen: bool) -> None:
    """Hold the backbone still for this step: LR 0 moves no weight under AdamW (its decay is
    LR x weight decay too), SGD, LAMB or LARS. The schedule sets the groups' LR afresh at every
    step. (A checkpoint written before groups said ``backbone`` has two: the classifier's and
    the backbone's.)"""
    if frozen:
        for i, group in enumerate(optimizer.param_groups):
            if group.get("backbone", i > 0):
                group["lr"] = 0.0


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


def schedule_for(optimizer, cfg: TrainConfig, step: int, total_steps: int, steps_per_epoch: int,
                 saved: dict | None):
    """The run's LR schedule, stepped once per optimizer step, positioned at ``step`` (the steps
    trained so far). onecycle: torch's OneCycleLR, continued from ``saved`` (below). The others:
    the LR is a pure function of the step (``lr_multiplier``), so a resumed run's LRs are the
    uninterrupted run's, computed the same way, whatever the checkpoint holds."""
    if cfg.schedule == "onecycle":
        warmup = round(cfg.warmup_epochs * steps_per_epoch) if cfg.warmup_epochs else None
        return one_cycle(optimizer, cfg, total_steps - step, saved, warmup)
    for group, peak in zip(optimizer.param_groups, _peaks(optimizer, cfg)):
        group["initial_lr"] = peak  # the scheduler's base LR: what the multiplier scales
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(cfg, total_steps, steps_per_epoch),
                                             last_epoch=step - 1)


def lr_multiplier(cfg: TrainConfig, total_steps: int, steps_per_epoch: int) -> Callable[[int], float]:
    """step -> the share of each group's peak LR that step trains with (cosine, step, constant).

    A linear warm-up over the first W = round(warmup_epochs x steps per epoch) steps,
    (step + 1) / (W + 1), so that step W is the first at the peak; then cosine falls from the
    peak at step W to ``min_lr`` at step ``total_steps`` (the end of training; the last step
    trains just above it), step multiplies by ``decay_rate`` at every ``decay_epochs``-th epoch
    boundary (counted from the start, warm-up included, as timm's), constant stays at the peak.
    A run resumed with more epochs follows the longer run's curve from the step it reached."""
    warmup = round(cfg.warmup_epochs * steps_per_epoch)
    floor = cfg.min_lr / cfg.lr
    decay_every = cfg.decay_epochs * steps_per_epoch

    def multiplier(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if cfg.schedule == "cosine":
            progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
            return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
        if cfg.schedule == "step":
            return cfg.decay_rate ** (step // decay_every)
        return 1.0

    return multiplier


def one_cycle(optimizer, cfg: TrainConfig, remaining: int, saved: dict | None, warmup_steps: int | None = None):
    """One-cycle LR over the run. A resumed run continues its saved cycle when that cycle has
    exactly the steps left that the run has; otherwise (more epochs than the run started with,
    another step limit) a fresh cycle covers the steps that remain. Its warm-up: ``warmup_steps``
    (--warmup-epochs, when set) or --warmup-fraction of the cycle."""
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
    pct_start = cfg.warmup_fraction
    if warmup_steps is not None:
        # OneCycleLR peaks at step pct_start x total - 1: here step W, the first after the warm-up,
        # as in the other schedules (a warm-up of one step would divide by zero in OneCycleLR).
        # A warm-up of no step, or too long for a fresh cycle of a resumed run, starts at the peak.
        warmup = min(warmup_steps, remaining - 2)
        pct_start = (warmup + 1) / remaining if warmup > 0 else 0.0
    return torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=_peaks(optimizer, cfg), total_steps=remaining, pct_start=pct_start
    )


def _peaks(optimizer, cfg: TrainConfig) -> list[float]:
    return [cfg.lr * group.get("lr_scale", 1.0) for group in optimizer.param_groups]
