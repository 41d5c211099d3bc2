"""The parts of a training step beyond forward, backward and update (docs/training.md, "Step
mechanics"): gradient accumulation (``--accumulate``: the pieces, and no gradient exchange
between ranks until the last), the float16 gradient scaler (``--precision fp16``), gradient
clipping (``--clip-grad-norm``) and the drop-path randomness as a function of the step.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn as nn

from imgtrain.config import TrainConfig


def pieces(n: int, *tensors: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """This rank's share of the batch in ``n`` pieces as equal as possible (sizes differ by at
    most one; views, no copy), each of ``tensors`` cut along its first dimension: images
    [B, C, H, W] and targets [B] or [B, classes] -> [(images [b_i, ...], targets [b_i, ...])]."""
    return list(zip(*(torch.tensor_split(t, n) for t in tensors)))


@contextlib.contextmanager
def gradient_sync(model: nn.Module, sync: bool):
    """Backward passes inside exchange gradients between ranks only when ``sync``: the
    accumulated gradient is reduced once, by the last piece's backward. DDP: ``no_sync()``;
    FSDP2: ``set_requires_gradient_sync(False)`` (each rank keeps its unsharded gradients until
    the reduce-scatter of the last piece); a single process has nothing to exchange."""
    if sync:
        yield
    elif hasattr(model, "set_requires_gradient_sync"):  # FSDPModule (fsdp.shard)
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    elif hasattr(model, "no_sync"):  # DistributedDataParallel
        with model.no_sync():
            yield
    else:
        yield


def grad_scaler(cfg: TrainConfig, device: torch.device, saved: dict | None) -> torch.amp.GradScaler | None:
    """With ``--precision fp16``, the loss scaler (torch's defaults: 2^16 to start, halved at an
    overflow, doubled after 2,000 steps without one), restored from the checkpoint's state.

    It works unchanged on FSDP2's DTensor gradients: DTensor's rule for the overflow check
    (``found_inf_reduce_handler``, torch 2.14) takes the maximum over the ranks, so every rank
    skips the same steps; DDP's gradients are already equal on every rank."""
    if cfg.precision != "fp16":
        return None
    scaler = torch.amp.GradScaler(device.type)
    if saved is not None:
        scaler.load_state_dict(saved)
    return scaler


def backward(loss: torch.Tensor, scaler: torch.amp.GradScaler | None) -> None:
    (loss if scaler is None else scaler.scale(loss)).backward()


def clip_gradients(model: nn.Module, optimizer, scaler, max_norm: float) -> torch.Tensor | None:
    """Clip the gradients' global L2 norm to ``max_norm`` (0: no clipping, None returned);
    returns the norm before clipping, a 0-dim tensor on the device (read only when a record is
    sent: no host sync here). With fp16 the gradients are unscaled first, so the norm is the
    true one (``scaler.step`` then does not unscale again).

    FSDP2's gradients are DTensor shards: ``clip_grad_norm_`` takes them (torch registers
    DTensor for foreach, and ``_foreach_norm`` / ``vector_norm`` have sharding rules), its
    norm a partial sum over the ranks that the clip coefficient's arithmetic reduces. The
    returned norm is made a plain tensor here, on every rank (one scalar all-reduce): rank 0
    alone reading it for a record would be a collective the other ranks never join."""
    if not max_norm:
        return None
    if scaler is not None:
        scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def optimizer_step(optimizer, scheduler, scaler) -> None:
    """The update, then the schedule. With fp16 a step whose gradients hold an inf or NaN is
    skipped by the scaler (weights and optimizer state untouched, the scale halved), and the
    schedule still advances: the LR stays a function of the step number, as in timm and
    Lightning, so a resumed run and an uninterrupted one agree whatever steps were skipped.
    The scaler reads the overflow flag back to decide (one host sync per step, torch's design;
    optimizers whose fused kernels check the flag on the device avoid it, not AdamW's default)."""
    if scaler is None:
        optimizer.step()
        scheduler.step()
        return
    scaler.step(optimizer)
    scaler.update()
    with warnings.catch_warnings():
        # torch warns when the schedule's first step comes before any optimizer step: here,
        # when the first steps overflowed, which is the scaler finding its scale
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
        scheduler.step()


def seed_step_randomness(seed: int, step: int, rank: int) -> None:
    """Seed the generators drop path (and dropout) draw from as a function of (seed, step,
    rank): on a GPU they draw from the CUDA generator, which no checkpoint holds, so a resumed
    run would drop other paths than the uninterrupted one. ``torch.manual_seed`` sets the
    CPU's and every GPU's on the host, without waiting for the GPU."""
    torch.manual_seed(((seed * 1_000_003 + step) * 65_537 + rank) % 2**63)
