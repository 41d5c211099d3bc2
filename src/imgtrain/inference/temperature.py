"""Temperature scaling (Guo et al., 2017): one number T > 0 by which every logit is divided before
the softmax, fitted to minimise the negative log-likelihood (NLL) of a held-out split's labels.
Dividing by the same T keeps every image's most probable class, so accuracy is unchanged; only
how sure the model says it is moves (T > 1: less sure, the usual case for a network trained to a
low training loss).

The figures reported before and after: the NLL (mean over the images, natural log) and the
expected calibration error (``metrics.EvalSums``: 15 equal-width bins, the definition evaluate
has always used).
"""

from __future__ import annotations

import numpy as np

from imgtrain.inference.metrics import EvalSums

# T is held within these bounds: a split whose images the model gets all right pushes the
# optimum towards 0 (ever sharper), and a constant model's towards infinity.
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.05, 100.0


def fit_temperature(logits, labels) -> float:
    """The T minimising the mean NLL of softmax(logits / T) at ``labels``: L-BFGS on log T (so T
    stays positive), in float64, from T = 1. ``logits`` float [N, K], ``labels`` int [N]."""
    import torch

    x = torch.as_tensor(np.asarray(logits), dtype=torch.float64)
    y = torch.as_tensor(np.asarray(labels), dtype=torch.int64)
    log_t = torch.zeros((), dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([log_t], lr=1.0, max_iter=100, tolerance_grad=1e-10, tolerance_change=1e-12,
                                  line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(x / log_t.exp(), y)
        loss.backward()
        return loss

    optimizer.step(closure)
    t = float(log_t.detach().exp())
    return float(np.clip(t, MIN_TEMPERATURE, MAX_TEMPERATURE)) if np.isfinite(t) else 1.0


def log_probabilities(logits, temperature: float = 1.0) -> np.ndarray:
    """float64 [N, K]: log softmax(logits / T), computed stably."""
    z = np.asarray(logits, np.float64) / temperature
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def nll(logits, labels, temperature: float = 1.0) -> float:
    """Mean negative log-likelihood of ``labels`` under softmax(logits / T)."""
    labels = np.asarray(labels, np.int64)
    return float(-log_probabilities(logits, temperature)[np.arange(len(labels)), labels].mean())


def ece(logits, labels, temperature: float = 1.0) -> float:
    """Expected calibration error of softmax(logits / T) (``metrics.EvalSums``)."""
    probs = np.exp(log_probabilities(logits, temperature))
    sums = EvalSums(probs.shape[1])
    sums.add(labels, probs.argmax(1), probs.max(1))
    return sums.ece
