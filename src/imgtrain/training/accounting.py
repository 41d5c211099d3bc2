"""What a rank keeps account of while it trains: its figures between progress records, its
step and data-wait times over an epoch, and (``--ledger``) the ids of the rows it trained on."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch


class StepWindow:
    """This rank's running figures between two progress records."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        # loss and correct stay tensors on the device until a record is sent: reading them at
        # every step would make the host wait for the GPU at every step
        self.samples, self.loss_sum, self.correct, self.wait, self.busy, self.n = 0, 0.0, 0, 0.0, 0.0, 0
        self.norm_sum, self.norms = 0.0, 0  # --clip-grad-norm: the finite norms before clipping, and how many

    def add(self, samples: int, mean_loss, correct, wait: float, total: float, grad_norm=None) -> None:
        if grad_norm is not None:  # an fp16 step that overflowed has an infinite norm: left out
            self.norm_sum += grad_norm.nan_to_num(0.0, posinf=0.0)
            self.norms += grad_norm.isfinite()
        self.samples += samples
        self.loss_sum += mean_loss
        self.correct += correct
        self.wait += wait
        self.busy += total
        self.n += 1

    def step_record(self, epoch: int, step: int, lr: float, world: int, scaler=None) -> dict:
        """Rank 0's view of the last steps: loss, accuracy, throughput of the whole group; with
        --clip-grad-norm the mean gradient norm before clipping, with fp16 the loss scale."""
        record = {
            "kind": "step", "epoch": epoch, "step": step, "loss": float(self.loss_sum) / max(self.n, 1),
            "accuracy": float(self.correct) / max(self.samples, 1), "lr": lr,
            "images_per_s": self.samples * world / max(self.busy, 1e-9),
            "data_wait_fraction": self.wait / max(self.busy, 1e-9), "time": time.time(),
        }
        if isinstance(self.norms, torch.Tensor):  # None when every step of the window overflowed
            record["grad_norm"] = float(self.norm_sum) / int(self.norms) if int(self.norms) else None
        if scaler is not None:
            record["loss_scale"] = scaler.get_scale()
        return record

    def rank_record(self, rank: int, epoch: int, step: int) -> dict:
        """Where this rank's time went over the last steps: is it starved by data?"""
        n = max(self.n, 1)
        return {
            "kind": "rank", "rank": rank, "epoch": epoch, "step": step, "steps": self.n,
            "step_time_s": self.busy / n, "data_wait_s": self.wait / n,
            "data_wait_fraction": self.wait / max(self.busy, 1e-9), "time": time.time(),
        }


class EpochTiming:
    """This rank's step and data-wait seconds over an epoch, gathered from every rank at its end."""

    def __init__(self):
        self.wait, self.busy, self.n = 0.0, 0.0, 0

    def add(self, wait: float, total: float) -> None:
        self.wait, self.busy, self.n = self.wait + wait, self.busy + total, self.n + 1

    def gather(self, backend) -> dict:
        """Per-rank mean step and data-wait times (a collective: every rank calls it, at the
        epoch-end synchronisation that already exists, so no step waits for it)."""
        table = backend.all_gather(torch.tensor([self.busy, self.wait, self.n], dtype=torch.float64))  # [world, 3]
        steps = table[:, 2].clamp(min=1)
        step_time, wait = (table[:, 0] / steps).tolist(), (table[:, 1] / steps).tolist()
        return {
            "rank_step_time_s": step_time, "rank_data_wait_s": wait,
            # the slowest-fed rank sets the pace: DDP waits for it at every step
            "data_wait_fraction": max(w / max(t, 1e-9) for w, t in zip(wait, step_time)),
        }


class Ledger:
    """Appends the ids of the rows this rank trains on, one line per step (``--ledger``).

    Every line names its worker group (``group``: an id rank 0 draws and shares, and
    ``group_step``: the global step the group started from). When a group dies, the steps it
    trained after its last checkpoint are trained again by the next group, whose lines for
    those steps supersede the dead group's: their updates never reached a checkpoint.
    """

    def __init__(self, backend, start_step: int):
        mine = torch.tensor([int.from_bytes(os.urandom(6), "little")], dtype=torch.int64)
        group = int(backend.broadcast(mine).item())  # rank 0's draw, on every rank
        directory = Path(backend.run_dir) / "ledger"
        directory.mkdir(parents=True, exist_ok=True)
        self.file = open(directory / f"rank-{backend.rank}.jsonl", "a")
        self.fixed = {"rank": backend.rank, "world_size": backend.world_size, "group": group,
                      "group_step": start_step, "group_started": time.time()}

    def write(self, epoch: int, epoch_step: int, step: int, ids: torch.Tensor) -> None:
        line = dict(self.fixed, epoch=epoch, epoch_step=epoch_step, step=step, ids=ids.tolist())
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()
