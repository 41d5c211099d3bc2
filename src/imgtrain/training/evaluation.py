"""Validation: the model validation runs and model.pt holds (``evaluated_model``, the same on
every rank), its loss, accuracy and macro F1 on the validation split (``evaluate``), and global
means of per-rank sums.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from imgtrain.config import TrainConfig
from imgtrain.data.tensors import to_model_input
from imgtrain.models.zoo import build_from_args, model_args
from imgtrain.training import fsdp, multilabel
from imgtrain.training.backend import Backend
from imgtrain.training.run_state import Run


THRESHOLDS = "thresholds"  # a multi-label set's: popped from the figures, stored with the checkpoint


def evaluate(
    model: nn.Module, backend: Backend, manifest: dict, label_smoothing: float = 0.0,
    memory_format: torch.memory_format = torch.contiguous_format, multi_label_loss: nn.Module | None = None,
) -> dict:
    """``val_loss``, ``val_accuracy``, ``val_f1_macro`` and ``val_samples`` on the validation
    split, each row counted once across all ranks: each rank gets its own rows (``ingest.py``)
    and the sums are all-reduced, in one collective. The plain (unwrapped) model is used, so no
    rank waits on a DDP collective for a forward pass another rank does not make.

    A multi-label set (``multi_label_loss``: its unweighted loss) gets ``multilabel.validate``'s
    figures, ``val_map`` among them, and its per-label thresholds under ``THRESHOLDS``.
    """
    if multilabel.is_multi_label(manifest):
        return _evaluate_multi_label(model, backend, manifest, multi_label_loss, memory_format)
    k = int(manifest["num_classes"])
    criterion = nn.CrossEntropyLoss(reduction="sum", label_smoothing=label_smoothing)
    sums = torch.zeros(3, dtype=torch.float64)
    # [3, K] per class: true positives, predicted, actual (never a K x K matrix: K may be large)
    counts = torch.zeros(3, k, dtype=torch.long, device=backend.device)
    for y, logits in _val_outputs(model, backend, manifest, memory_format):
        predicted = logits.argmax(1)
        sums += torch.tensor(
            [criterion(logits, y).item(), (predicted == y).sum().item(), len(y)],
            dtype=torch.float64,
        )
        counts[0] += torch.bincount(y[predicted == y], minlength=k).to(counts.device)
        counts[1] += torch.bincount(predicted, minlength=k).to(counts.device)
        counts[2] += torch.bincount(y, minlength=k).to(counts.device)
    total = backend.all_reduce_sum(torch.cat([sums, counts.flatten().cpu().double()]))
    loss, acc, n = means(total[:3])
    return {"val_loss": loss, "val_accuracy": acc, "val_f1_macro": f1_macro(total[3:].view(3, k)),
            "val_samples": n}


def _evaluate_multi_label(model: nn.Module, backend: Backend, manifest: dict, criterion: nn.Module,
                          memory_format: torch.memory_format) -> dict:
    sums = torch.zeros(2, dtype=torch.float64)  # [loss sum, samples]
    logits, targets = [], []  # this rank's rows: the mAP and the thresholds need every score
    for y, out in _val_outputs(model, backend, manifest, memory_format):
        sums += torch.tensor([criterion(out, y).item(), len(out)], dtype=torch.float64)
        logits.append(out.float().cpu())
        targets.append(y.cpu())
    figures, thresholds = multilabel.validate(backend, manifest, logits, targets, sums)
    return {**figures, THRESHOLDS: thresholds}


def _val_outputs(model: nn.Module, backend: Backend, manifest: dict, memory_format: torch.memory_format):
    """(labels, logits) of each non-empty validation batch of this rank, the model in eval mode
    and without autograd meanwhile (its mode restored after)."""
    mean, std = manifest["normalize"]["mean"], manifest["normalize"]["std"]
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for batch in backend.val_batches():
                if len(batch["label"]):
                    x = to_model_input(batch["image"], mean, std)
                    yield batch["label"], model(x.contiguous(memory_format=memory_format))
    finally:
        model.train(was_training)


def f1_macro(counts: torch.Tensor) -> float:
    """The unweighted mean of the per-class F1 scores from [true positives, predicted, actual]
    per class ([3, K]): F1 = 2 TP / (predicted + actual). Classes neither in the split nor ever
    predicted are left out, as scikit-learn's ``f1_score(average="macro")`` leaves out labels
    in neither ``y_true`` nor ``y_pred``; 0.0 without any sample."""
    tp, predicted, actual = counts.double()
    present = (predicted + actual) > 0
    if not present.any():
        return 0.0
    return (2 * tp[present] / (predicted + actual)[present]).mean().item()



def global_means(backend: Backend, sums: torch.Tensor) -> tuple[float, float, int]:
    return means(backend.all_reduce_sum(sums.clone()))


def means(total: torch.Tensor) -> tuple[float, float, int]:
    """[loss sum, correct, samples] summed over every rank -> (mean loss, accuracy, samples)."""
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

