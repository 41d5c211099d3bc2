"""Multi-label training (a data set whose manifest says ``multi_label``, issue 48): one sigmoid
per class, so each label is a yes/no question of its own. The loss (``MultiLabelLoss``: binary
cross-entropy, or the asymmetric loss with ``--multi-label-loss asl``), ``--class-weights
auto``'s positive weights (``positive_weights``) and the validation figures (``validate``:
``val_map`` and the thresholds stored with the checkpoint).

Batches' ``label`` is then uint8 multi-hot [B, C] (the contract in data/format.py's readers);
mixup and CutMix mix those vectors (mixing.py) and label smoothing moves each of a row's C
binary targets towards 1/2: t -> t (1 - eps) + eps / 2, what the cross-entropy's smoothing does
with two classes. Nothing here draws a random number: exact resumption is as for one label.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn

from imgtrain.config import TrainConfig
from imgtrain.data.format import eval_split, is_multi_label  # noqa: F401 (is_multi_label: the loop's test)
from imgtrain.inference import multilabel_metrics


class MultiLabelLoss(nn.Module):
    """``loss(logits [B, C], targets [B, C] in [0, 1])``: the sum over the rows of the mean over
    the C labels of each label's loss (torch's ``BCEWithLogitsLoss`` default, the mean over every
    element, times B: the loop scales summed losses itself, as for the cross-entropy).

    ``bce``: -(w t log p + (1 - t) log(1 - p)), p = sigmoid(logit), w the label's positive weight
    (1 without ``--class-weights auto``). ``asl`` (Ridnik et al., "Asymmetric Loss For
    Multi-Label Classification", ICCV 2021, their reference code's formula):
    -(w t (1 - p)^gamma_pos log p + (1 - t) p_m^gamma_neg log(1 - p_m)), with the shifted
    probability p_m = max(p - clip, 0) of the negatives: easy negatives (most of the C labels
    of an image) weigh little, and those below ``clip`` nothing. With soft targets (smoothing,
    mixing) the focusing weight is the reference's (1 - p_t)^gamma_t, p_t and gamma_t
    interpolated by t."""

    def __init__(self, kind: str = "bce", pos_weight: torch.Tensor | None = None, smoothing: float = 0.0,
                 gamma_neg: float = 4.0, gamma_pos: float = 0.0, clip: float = 0.05):
        super().__init__()
        self.kind, self.smoothing = kind, smoothing
        self.gamma_neg, self.gamma_pos, self.clip = gamma_neg, gamma_pos, clip
        self.register_buffer("pos_weight", pos_weight, persistent=False)

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits, t = logits.float(), targets.float()
        if self.smoothing:
            t = t * (1 - self.smoothing) + self.smoothing / 2
        if self.kind == "bce":
            per_label = nn.functional.binary_cross_entropy_with_logits(logits, t, pos_weight=self.pos_weight,
                                                                       reduction="none")
        else:
            per_label = self._asymmetric(logits, t)
        return per_label.mean(1).sum()

    def _asymmetric(self, logits: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        eps = 1e-8  # the reference's floor under the logarithms
        p = torch.sigmoid(logits)
        p_neg = (1 - p + self.clip).clamp(max=1) if self.clip else 1 - p  # 1 - p_m
        positive = t * torch.log(p.clamp(min=eps))
        if self.pos_weight is not None:
            positive = positive * self.pos_weight
        loss = positive + (1 - t) * torch.log(p_neg.clamp(min=eps))
        if self.gamma_neg or self.gamma_pos:
            p_t = p * t + p_neg * (1 - t)
            gamma = self.gamma_pos * t + self.gamma_neg * (1 - t)
            loss = loss * torch.pow(1 - p_t, gamma)
        return -loss


def criterion_for(cfg: TrainConfig, manifest: dict, device, weighted: bool = True) -> MultiLabelLoss:
    """The run's loss (``weighted``: with ``--class-weights auto``'s positive weights; validation's
    loss is unweighted, as for one label)."""
    return MultiLabelLoss(cfg.multi_label_loss, positive_weights(cfg, manifest, device) if weighted else None,
                          cfg.label_smoothing, cfg.asl_gamma_neg, cfg.asl_gamma_pos, cfg.asl_clip)


def validation_loss(cfg: TrainConfig, manifest: dict, device) -> MultiLabelLoss | None:
    """A multi-label set's validation loss: the training one without class weights (None for one
    label: validation's cross-entropy is evaluation.py's)."""
    return criterion_for(cfg, manifest, device, weighted=False) if is_multi_label(manifest) else None


def positive_weights(cfg: TrainConfig, manifest: dict, device) -> torch.Tensor | None:
    """``--class-weights auto`` for a multi-label set: each label's positive term weighed by its
    training split's negatives / positives (torch's ``pos_weight`` rule, so its positives weigh as
    much in total as its negatives); a label without positive training images gets 1 (it has no
    positive term to weigh)."""
    if cfg.class_weights != "auto":
        return None
    positives = torch.tensor(manifest["class_counts"]["train"], dtype=torch.float64)
    n = float(manifest["splits"]["train"]["num_samples"])
    weights = torch.where(positives > 0, (n - positives) / positives.clamp(min=1), torch.ones_like(positives))
    return weights.float().to(device)


def predicted_right(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Rows whose every label is decided right at 0.5 (logit > 0), for the training accuracy:
    targets of 1/2 or more (a mixed row's larger shares) count as positive."""
    return ((logits > 0) == (targets >= 0.5)).all(1).sum()


def validate(backend, manifest: dict, logits: list[torch.Tensor], targets: list[torch.Tensor],
             sums: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """The validation figures of a multi-label set from this rank's logits and targets (its
    rows), gathered over every rank (a collective): ``val_map``, and the exact-match ratio
    (``val_accuracy``) and macro F1 at 0.5; with the F1-best threshold per label chosen on the
    val split (a global 0.5 when training validates on test: thresholds are never tuned on
    it). ``sums``: this rank's [loss sum, samples]. The figures are of the set of rows alone,
    not of their order, so they are the same at every world size."""
    k = int(manifest["num_classes"])
    probs = torch.cat(logits).float().sigmoid().cpu() if logits else torch.zeros(0, k)
    truth = torch.cat(targets).to(torch.uint8).cpu() if targets else torch.zeros(0, k, dtype=torch.uint8)
    probs, truth = _gathered(backend, probs), _gathered(backend, truth)
    loss, n = backend.all_reduce_sum(sums.cpu().double()).tolist()
    scores, labels = probs.numpy(), truth.numpy()
    half = np.full(k, multilabel_metrics.DEFAULT_THRESHOLD, np.float32)
    at_half = multilabel_metrics.set_scores(scores, labels, half)
    thresholds = multilabel_metrics.best_f1_thresholds(scores, labels) if eval_split(manifest) == "val" else half
    figures = {
        "val_loss": loss / max(n, 1), "val_accuracy": at_half["exact_match"], "val_f1_macro": at_half["f1_macro"],
        "val_map": multilabel_metrics.mean_average_precision(multilabel_metrics.average_precision(scores, labels)),
        "val_samples": int(n),
    }
    return figures, torch.from_numpy(thresholds)


def _gathered(backend, rows: torch.Tensor) -> torch.Tensor:
    """Every rank's rows, rank by rank (ranks hold different numbers: padded to the largest)."""
    if backend.world_size == 1:
        return rows
    counts = backend.all_gather(torch.tensor([len(rows)])).flatten().tolist()
    padded = torch.zeros((max(counts), *rows.shape[1:]), dtype=rows.dtype)
    padded[:len(rows)] = rows
    every = backend.all_gather(padded)
    return torch.cat([every[r, :counts[r]] for r in range(backend.world_size)])
