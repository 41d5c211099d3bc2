"""``Backend``: what the training loop needs from where it runs, a Ray Train worker
(``ray_worker.py``) or this process (``local_backend.py``): how batches arrive, the collectives
between ranks, where checkpoints go and where records are sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ContextManager, Iterable

import torch
import torch.nn as nn

from imgtrain.training import faults
from imgtrain.training.health import Progress

Batch = dict  # {"id": int64 [B], "image": uint8 [B, H, W, C], "label": int64 [B]} on the device


@dataclass
class Backend:
    """What the loop needs from where it runs (a Ray Train worker, or this process)."""

    rank: int
    world_size: int
    device: torch.device
    prepare_model: Callable[[nn.Module], nn.Module]  # DDP or FSDP on Ray; the device alone locally
    # (epoch, first step) -> this rank's batches for the steps of the epoch from that one on
    train_batches: Callable[[int, int], Iterable[Batch]]
    val_batches: Callable[[], Iterable[Batch]]  # this rank's rows of the validation split
    # Collectives every rank calls together (identities with one rank); CPU tensors in and out.
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor]
    broadcast: Callable[[torch.Tensor], torch.Tensor]  # rank 0's tensor, on every rank
    all_gather: Callable[[torch.Tensor], torch.Tensor]  # [*shape] -> [world, *shape], by rank
    restored_checkpoint: Callable[[], ContextManager[str | None]]  # directory of the checkpoint to resume
    report: Callable[[dict, str | None, str], None]  # (metrics, checkpoint dir or None, dir name)
    send: Callable[[dict], None]  # progress / history record to the driver (fire and forget)
    # Names of damaged checkpoints left in the run directory: new ones must not reuse them, or
    # Ray Train's retention, deleting the damaged one by path, would delete its replacement.
    damaged: list[str] = field(default_factory=list)
    progress: Progress = field(default_factory=Progress)
    run_dir: Path | None = None  # for the sample ledger and injected faults
    staging: Path | None = None  # where save() writes a checkpoint first (None: the system's temporary folder)
    fault: faults.Fault | None = None
    augment_in_step: bool = True  # False: the batches arrive augmented (a streamed data set)
    # this rank's share of the training images that calibrate BatchNorm, preprocessed as for
    # evaluation (--bn-calibration); None: no calibration
    calibration_batches: Callable[[], Iterable[Batch]] | None = None
    # --distill-mode cached: where the teacher's logits of the training rows are (teacher_cache.Ref's dict)
    teacher_logits: dict | None = None


def single_process_collectives() -> dict:
    """The collectives of a world of one: nothing to exchange."""
    return {"all_reduce_sum": lambda t: t, "broadcast": lambda t: t, "all_gather": lambda t: t.unsqueeze(0)}

