"""Validation: the model validation runs and model.pt holds (``evaluated_model``, the same on
every rank), its loss and accuracy on the validation split (``evaluate``), and global means of
per-rank sums.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from imgtrain.config import TrainConfig
from imgtrain.data.tensors import to_model_input
from imgtrain.models.zoo import build_from_args, model_args
from imgtrain.training import fsdp
from imgtrain.training.backend import Backend
from imgtrain.training.run_state import Run


def evaluate(
    model: nn.Module, backend: Backend, manifest: dict, label_smoothing: float = 0.0,
    memory_format: torch.memory_format = torch.contiguous_format,
):
    """Loss and accuracy on the validation split, each row counted once across all ranks: each
    rank gets its own rows (``ingest.py``) and the sums are all-reduced. The plain (unwrapped)
    model is used, so no rank waits on a DDP collective for a forward pass another rank does
    not make.
    """
    mean, std = manifest["normalize"]["mean"], manifest["normalize"]["std"]
    criterion = nn.CrossEntropyLoss(reduction="sum", label_smoothing=label_smoothing)
    sums = torch.zeros(3, dtype=torch.float64)
    was_training = model.training
    model.eval()
    with torch.inference_mode():
        for batch in backend.val_batches():
            if not len(batch["label"]):
                continue
            x = to_model_input(batch["image"], mean, std)
            y = batch["label"]
            logits = model(x.contiguous(memory_format=memory_format))
            sums += torch.tensor(
                [criterion(logits, y).item(), (logits.argmax(1) == y).sum().item(), len(y)],
                dtype=torch.float64,
            )
    model.train(was_training)
    loss, acc, n = global_means(backend, sums)
    return loss, acc, n



def global_means(backend: Backend, sums: torch.Tensor) -> tuple[float, float, int]:
    total = backend.all_reduce_sum(sums.clone())
    n = int(total[2].item())
    return total[0].item() / max(n, 1), total[1].item() / max(n, 1), n



def evaluated_model(run: Run) -> nn.Module:
    """The plain model that validation runs and model.pt holds (the moving average, or the
    weights), with rank 0's BatchNorm statistics on every rank. A collective: all ranks call it.

    With FSDP a full, unsharded copy gathered from the shards (for the time of validation and
    saving). FSDP2 leaves buffers alone, so each rank's running statistics follow its own
    batches; DDP broadcasts rank 0's before every forward pass, which leaves rank 0's own as
    they were. Taking rank 0's wherever they are seen (here, for validation and every saved
    file) therefore gives what DDP gives, with no collective per step. The trained model's are
    taken too: DCP saves one copy of a tensor every rank holds, not necessarily rank 0's."""
    if not run.sharded:
        _buffers_from_rank0(run.evaluated, run.backend)
        return run.evaluated
    for module in (run.model, run.ema.module) if run.ema is not None else (run.model,):
        _buffers_from_rank0(module, run.backend)
    plain = plain_model(run.cfg, run.manifest)
    plain.load_state_dict(fsdp.full_state(run.evaluated))
    return plain.to(run.backend.device, memory_format=run.memory_format)


def plain_model(cfg: TrainConfig, manifest: dict) -> nn.Module:
    """The run's architecture with throwaway weights (they are overwritten), built without
    touching the global RNG that dropout and the checkpoint's RNG state use."""
    with torch.random.fork_rng(devices=[]):
        return build_from_args(model_args(manifest, cfg.model, cfg.stem))


def _buffers_from_rank0(model: nn.Module, backend: Backend) -> None:
    """Give every rank rank 0's BatchNorm statistics (a collective: all ranks call it).

    Parameters are identical on all ranks, but each rank's last forward pass updated its
    running statistics with its own batch. Validation and the saved model.pt must use the
    same statistics, or a later evaluation of the checkpoint would not reproduce the
    recorded accuracy.
    """
    if backend.world_size == 1:
        return
    buffers = [b for b in model.buffers() if b.is_floating_point()]
    flat = backend.broadcast(torch.cat([b.detach().flatten().cpu() for b in buffers]))
    offset = 0
    with torch.no_grad():
        for b in buffers:
            b.copy_(flat[offset : offset + b.numel()].view_as(b))
            offset += b.numel()

