"""What one rank trains with (``Run``, built by ``loop.setup``) and where training stands
(``Resumed``: restored from a checkpoint by ``checkpointing.restore``, or fresh).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn as nn

from imgtrain.config import TrainConfig
from imgtrain.storage import checkpoint as ckpt
from imgtrain.training.accounting import Ledger
from imgtrain.training.backend import Backend
from imgtrain.training.recipe import WeightAverage

if TYPE_CHECKING:
    from imgtrain.training.weight_window import WeightWindow


@dataclass
class Resumed:
    """Where training stands: restored from a checkpoint, or fresh."""

    epoch: int = 0  # the epoch to train next (or the one a step checkpoint stopped inside)
    epoch_step: int = 0  # steps of that epoch already taken
    step: int = 0  # optimizer steps taken over the whole run
    sums: torch.Tensor | None = None  # the epoch's global [loss sum, correct, samples] so far
    elapsed_s: float = 0.0  # training time already spent in that epoch
    schedule: dict | None = None
    history: list[dict] = field(default_factory=list)  # the epoch records before this point
    restored_from: str | None = None  # the checkpoint's name
    window: dict | None = None  # --average-last's weights of the last epochs (``weight_window.WeightWindow``)
    averaged: bool = False  # restored from the average checkpoint (made after the last epoch trained)
    grad_scaler: dict | None = None  # --precision fp16: the gradient scaler's state


@dataclass
class Run:
    """Everything one rank trains with, built by ``setup``; ``step`` counts optimizer steps."""

    cfg: TrainConfig
    manifest: dict
    backend: Backend
    model: nn.Module  # DDP-wrapped or FSDP-sharded on Ray
    forward: Callable  # the model, or its compiled graph
    optimizer: torch.optim.Optimizer
    scheduler: object
    ema: WeightAverage | None  # None without --ema-decay
    criterion: nn.Module
    autocast: object
    memory_format: torch.memory_format
    steps_per_epoch: int
    total_steps: int
    step: int
    history: list[dict]  # the epoch records so far: every checkpoint carries them
    ledger: Ledger | None
    window: WeightWindow | None = None  # --average-last's last epochs' weights (set by run_loop)
    # --precision fp16: scales the loss so float16 gradients do not underflow, skips the steps
    # whose gradients overflow; None otherwise
    scaler: torch.amp.GradScaler | None = None
    distill: object = None  # --teacher: where the step's teacher logits come from (``distill.Signal``)

    @property
    def evaluated(self) -> nn.Module:
        """What validation sees and model.pt holds: the moving average, or the weights
        (sharded with FSDP: ``evaluated_model`` gathers them into a plain model)."""
        return self.ema.module if self.ema is not None else ckpt.unwrap(self.model)

    @property
    def sharded(self) -> bool:
        return self.cfg.strategy == "fsdp"

