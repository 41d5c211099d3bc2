"""Out-of-distribution scores: how much an image looks like what the model was trained on, one
number per image, higher meaning more like the training data; and the rule that rejects an image
whose score is below a threshold (answered ``unknown``).

The scores (every one from the model's logits f, one row per image):

- ``energy`` (the default; Liu et al., 2020): logsumexp(f), the negative free energy at
  temperature 1; it separates better than the softmax's maximum because it keeps the logits' scale
- ``max-logit`` (Hendrycks et al., 2022): max(f)
- ``max-softmax`` (Hendrycks & Gimpel, 2017): the largest class probability, softmax(f / T) with
  the checkpoint's temperature: the ``confidence`` predict and serve answer
- ``mahalanobis`` (Lee et al., 2018): minus the squared Mahalanobis distance of the image's
  penultimate features (the classifier's input) to the nearest class mean, with one covariance
  shared by the classes (shrunk towards its mean variance: a val split has fewer images than
  features); means and covariance fitted on training images by the calibration (``fit_mahalanobis``).
  The logit scores see only what the classifier makes of the features, and on digits they hardly
  tell natural photos from digits (``bench/calibration_ood.py``); the features do.

``--reject auto`` takes the threshold that keeps ``KEEP`` (95 %) of the validation split's images
(``keep_threshold``), stored with the checkpoint by the calibration pass (``calibrate.py``).
``evaluate --ood DIR`` reports the AUROC of the score (the test split positive, the folder's images
negative) and the false-positive rate at 95 % true-positive rate: the share of the folder's
images kept at the threshold that keeps 95 % of the test split.
"""

from __future__ import annotations

import numpy as np

from imgtrain.errors import ImgtrainError
from imgtrain.inference.options import OOD_METHODS as METHODS

DEFAULT_METHOD = METHODS[0]
FEATURE_METHODS = ("mahalanobis",)  # need the penultimate features and what calibration fitted
LOGIT_SCORES = tuple(m for m in METHODS if m not in FEATURE_METHODS)  # an export's logits output gives these
SHRINK = 0.1  # the shared covariance + SHRINK x its mean variance on the diagonal
MAX_FEATURES = 4096  # wider features: not fitted (the whitening matrix is features^2 floats)
KEEP = 0.95  # the share of the validation split --reject auto keeps (and FPR95's true-positive rate)
UNKNOWN = "unknown"  # what a rejected image is answered
REJECT_AUTO = "auto"


def column(method: str) -> str:
    """predict's column of the score: ``ood_energy``, ``ood_max_logit``, ``ood_max_softmax``."""
    return "ood_" + method.replace("-", "_")


def scores(logits, method: str = DEFAULT_METHOD, temperature: float = 1.0, features=None,
           fitted: dict | None = None) -> np.ndarray:
    """float64 [N]: ``method``'s score of each row of ``logits`` [N, K] (module docstring);
    ``mahalanobis`` takes the ``features`` [N, D] and what ``fit_mahalanobis`` ``fitted``."""
    if method == "mahalanobis":
        if features is None or fitted is None:
            raise ImgtrainError("--ood-score mahalanobis needs the class means that calibration fits on the val split, "
                                "and this checkpoint has none: run `imgtrain calibrate RUN`, or pick another score")
        return mahalanobis(features, fitted["whitening"], fitted["means"])
    f = np.asarray(logits, np.float64)
    if method == "max-logit":
        return f.max(axis=1)
    if method == "energy":
        top = f.max(axis=1)
        return top + np.log(np.exp(f - top[:, None]).sum(axis=1))
    if method == "max-softmax":
        z = f / temperature
        z = z - z.max(axis=1, keepdims=True)
        return 1.0 / np.exp(z).sum(axis=1)  # the top class's exp(0) over the sum
    raise ImgtrainError(f"--ood-score must be one of {', '.join(METHODS)}, got {method!r}")


def fit_mahalanobis(features, labels, shrink: float = SHRINK) -> dict | None:
    """{"whitening": W [D, D], "means": the class means whitened [K', D]} (float32; the classes
    present only) with W W^T the inverse of the shared covariance; None above MAX_FEATURES."""
    f, labels = np.asarray(features, np.float64), np.asarray(labels, np.int64)
    if f.ndim != 2 or f.shape[1] > MAX_FEATURES or not len(f):
        return None
    present = np.unique(labels)
    means = np.stack([f[labels == k].mean(axis=0) for k in present])
    centred = f - means[np.searchsorted(present, labels)]
    cov = centred.T @ centred / len(f)
    cov += shrink * max(np.trace(cov) / len(cov), 1e-12) * np.eye(len(cov))
    values, vectors = np.linalg.eigh(cov)
    whitening = vectors / np.sqrt(values)  # (f W)(f W)^T distances are Mahalanobis ones
    return {"whitening": whitening.astype(np.float32), "means": (means @ whitening).astype(np.float32)}


def mahalanobis(features, whitening, means) -> np.ndarray:
    """float64 [N]: minus the squared Mahalanobis distance to the nearest class mean."""
    f = np.asarray(features, np.float64)
    w, m = np.asarray(whitening, np.float64), np.asarray(means, np.float64)
    if f.ndim != 2 or f.shape[1] != w.shape[0]:
        raise ImgtrainError(f"the model's features ({f.shape[-1]}) do not match the {w.shape[0]} the stored class means "
                            "were fitted on; run `imgtrain calibrate RUN` again")
    z = f @ w
    squared = (z * z).sum(axis=1)[:, None] - 2 * z @ m.T + (m * m).sum(axis=1)[None, :]
    return -np.maximum(squared, 0).min(axis=1)


def penultimate(model):
    """(a list the model's penultimate features [B, D] are appended to at each forward pass, the
    hook's handle): the input of its classifier (``models.parts.head_name``), flattened."""
    from imgtrain.models.parts import head_name

    found = []
    head = model.get_submodule(head_name(model))
    handle = head.register_forward_hook(lambda module, args, output: found.append(
        args[0].detach().flatten(1).float().cpu().numpy()))
    return found, handle


def keep_threshold(values, keep: float = KEEP) -> float:
    """The largest threshold t with at least ``keep`` of ``values`` at or over it: the
    ceil(keep * n)-th largest value."""
    ordered = np.sort(np.asarray(values, np.float64))
    if not len(ordered):
        raise ValueError("no scores to take a threshold from")
    kept = int(np.ceil(keep * len(ordered) - 1e-9))
    return float(ordered[len(ordered) - max(kept, 1)])


def auroc(inside, outside) -> float:
    """The area under the ROC curve of telling ``inside`` (positive) from ``outside`` by the
    score: the probability that an inside image scores higher than an outside one, ties half
    (the Mann-Whitney U statistic, as scikit-learn's ``roc_auc_score``)."""
    inside, outside = np.asarray(inside, np.float64), np.asarray(outside, np.float64)
    both = np.concatenate([inside, outside])
    _, where, counts = np.unique(both, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    average_rank = ends - (counts - 1) / 2.0  # 1-based ranks, ties averaged
    rank_sum = average_rank[where[: len(inside)]].sum()
    return float((rank_sum - len(inside) * (len(inside) + 1) / 2) / (len(inside) * len(outside)))


def fpr_at_tpr(inside, outside, tpr: float = KEEP) -> float:
    """The share of ``outside`` at or over the threshold that keeps ``tpr`` of ``inside``."""
    return float(np.mean(np.asarray(outside, np.float64) >= keep_threshold(inside, tpr)))


def parse_reject(value) -> float | str | None:
    """``--reject``: None (off), ``auto``, or a number (the threshold itself)."""
    if value is None or value == REJECT_AUTO:
        return value
    try:
        threshold = float(value)
    except (TypeError, ValueError):
        threshold = float("nan")
    if not np.isfinite(threshold):
        raise ImgtrainError(f"--reject must be auto or a number (a threshold on the score), got {value!r}")
    return threshold


def check_method(method: str) -> None:
    if method not in METHODS:
        raise ImgtrainError(f"--ood-score must be one of {', '.join(METHODS)}, got {method!r}")
