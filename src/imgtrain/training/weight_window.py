"""--average-last K: the evaluated weights of the epochs the average may take (``WeightWindow``),
kept by rank 0 as training goes, in memory and in every checkpoint's train_state.pt, so a run
resumed anywhere, after any retention (``--num-to-keep 1`` keeps one checkpoint), averages
exactly the same weights (``averaging.save_average``); with FSDP they are the full weights
``evaluated_model`` gathers for validation anyway. Only the epochs that can still be among the
last K are kept: the last K of ``--epochs``, or, with ``--early-stop`` (which may end the run
after any epoch), the K latest. The cost: up to K copies of the model in rank 0's memory and in
the checkpoints taken while they are held.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from imgtrain.config import TrainConfig


class WeightWindow:
    """The evaluated weights of the epochs the average may take, oldest first (rank 0's; the
    other ranks hold nothing). Empty without --average-last."""

    def __init__(self, cfg: TrainConfig, rank: int, epochs: list[int] | None = None,
                 weights: list[dict] | None = None):
        self.k, self.rank = cfg.average_last, rank
        # without early stopping the run ends after epoch cfg.epochs - 1: earlier ones never count
        self.first = 0 if cfg.early_stop else cfg.epochs - cfg.average_last
        kept = [(e, w) for e, w in zip(epochs or [], weights or []) if e >= self.first][-self.k:] if self.k else []
        self.epochs = [e for e, _ in kept]
        self.weights = [w for _, w in kept]

    @classmethod
    def restored(cls, cfg: TrainConfig, saved: dict | None, rank: int) -> WeightWindow:
        """The window a checkpoint's train state holds (``state``), or an empty one."""
        if rank != 0 or not saved:
            return cls(cfg, rank)
        return cls(cfg, rank, [int(e) for e in saved["epochs"]], list(saved["weights"]))

    def add(self, epoch: int, evaluated: nn.Module) -> None:
        """Keep ``epoch``'s evaluated weights (a copy on the CPU) if the average may take them."""
        if not self.k or self.rank != 0 or epoch < self.first:
            return
        self.epochs.append(epoch)
        self.weights.append({k: v.detach().cpu().clone() for k, v in evaluated.state_dict().items()})
        del self.epochs[:-self.k], self.weights[:-self.k]

    def state(self) -> dict | None:
        """What train_state.pt keeps (tensors and plain types: loads with weights_only=True)."""
        return {"epochs": list(self.epochs), "weights": list(self.weights)} if self.weights else None

    def mean(self, names: list[str]) -> torch.Tensor:
        """The uniform average of the tensors ``names`` over the window, flattened into one
        float64 vector: summed in epoch order (the same numbers however the run was resumed)."""
        parts = []
        for name in names:
            total = torch.zeros_like(self.weights[0][name], dtype=torch.float64)
            for weights in self.weights:
                total += weights[name].double()
            parts.append((total / len(self.weights)).flatten())
        return torch.cat(parts)
