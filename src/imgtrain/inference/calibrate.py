"""A checkpoint's calibration, fitted on the data set's validation split and stored with it
(``calibrated.pt``, storage/checkpoint.py): the temperature of temperature scaling
(``temperature.py``) and, for ``--reject auto``, each out-of-distribution score's threshold that
keeps 95 % of that split (``ood.py``). Fitted at the end of training on the best checkpoint (the
driver), and by ``imgtrain calibrate RUN`` for a run trained before, or another checkpoint.

The split's images go through the checkpoint's model in this process, batch by batch, exactly as
evaluate sees them; the logits and the penultimate features are kept (float32 [images, classes +
features]), for at most IMAGES of the split, spread over it (the cost stays a few minutes on a
CPU whatever the data set's size). The ``mahalanobis`` score's class means and shared covariance
come from as many training images, spread over that split likewise (one more pass), its
threshold from the val split, which they were not fitted on. Never on the test split: the figures evaluate reports there stay unseen. Nothing is fitted, and one line says why, for a
data set without a validation split and for a multi-label model (each of its labels is decided at
its own threshold, chosen on the val split: there is no softmax to scale).

Predict, serve, evaluate and export divide the logits by the temperature before the softmax
(``calibration_record.calibration_of``); a checkpoint without one keeps T = 1.

A run in an object store is calibrated in this machine's working copy of it and the calibration
uploaded into the checkpoint there (``calibrate_stored``), the run's lock held: by ``imgtrain
calibrate RUN --storage s3://...``, and at the end of a Ray run, whose driver brings the best
checkpoint's weights down for the pass (its workers uploaded them) and deletes them after.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from imgtrain.errors import ImgtrainError
from imgtrain.inference import ood, temperature
from imgtrain.inference.calibration_record import SPLIT, Calibration
from imgtrain.inference.options import CalibrateOptions
from imgtrain.inference.preprocess import LoadedCheckpoint
from imgtrain.storage import checkpoint as ckpt

BATCH = 256
# At most this many images of the val split (the temperature, the thresholds) and as many of the
# training split (mahalanobis's class means and covariance), spread over each split
# (stream.split_sample), as evaluation sees them. One scalar and a 5 % quantile need no more; the
# pass runs in the driver, where a CPU takes about a minute per 5,000 224x224 ResNet-50 images.
IMAGES = 5_000


class NotFitted(ImgtrainError):
    """Why a checkpoint gets no calibration (no validation split, a multi-label model)."""


def split_logits(loaded: LoadedCheckpoint, data_dir, manifest: dict, split: str, device: str = "cpu",
                 limit: int = IMAGES) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(float32 logits [images, classes], int64 labels [images], float32 penultimate features
    [images, D], or None where the classifier was not found) of about ``limit`` images spread
    over a split, in this process."""
    import torch

    from imgtrain.data import stream

    logits, labels, features = [], [], []
    preprocess = loaded.preprocess
    try:
        found, hook = ood.penultimate(loaded.model)
    except (StopIteration, IndexError, AttributeError):  # a model whose classifier is not a Linear
        found, hook = None, None
    try:
        with torch.inference_mode():
            for batch in stream.split_sample(data_dir, manifest, split, preprocess.preset, BATCH, limit):
                logits.append(loaded.model(preprocess(batch["image"], device)).float().cpu().numpy())
                labels.append(np.asarray(batch["label"], np.int64))
    finally:
        if hook is not None:
            hook.remove()
    k = len(preprocess.classes)
    return (np.concatenate(logits) if logits else np.zeros((0, k), np.float32),
            np.concatenate(labels) if labels else np.zeros(0, np.int64),
            np.concatenate(found) if found else None)


def fit(logits: np.ndarray, labels: np.ndarray, features: np.ndarray | None = None,
        train: tuple | None = None) -> Calibration:
    """The temperature and each score's threshold keeping ood.KEEP of a split's images; the class
    means and covariance of the features from ``train`` ((features, labels) of training images):
    fitted on the split itself, its own images would sit closer to them than new ones, and the
    threshold would turn most new images away."""
    t = temperature.fit_temperature(logits, labels)
    fitted = ood.fit_mahalanobis(*train) if features is not None and train is not None else None
    methods = [m for m in ood.METHODS if m not in ood.FEATURE_METHODS or fitted is not None]
    return Calibration(
        temperature=t, images=len(labels),
        nll=(temperature.nll(logits, labels), temperature.nll(logits, labels, t)),
        ece=(temperature.ece(logits, labels), temperature.ece(logits, labels, t)),
        ood_thresholds={m: ood.keep_threshold(ood.scores(logits, m, t, features, fitted)) for m in methods},
        mahalanobis=fitted)


def check_fittable(loaded: LoadedCheckpoint | None, manifest: dict, data_dir) -> None:
    """Raise ``NotFitted`` (one line) where nothing can be fitted."""
    from imgtrain.data.format import is_multi_label

    if is_multi_label(manifest):
        raise NotFitted("calibration: not fitted for a multi-label model (each label is decided at its own "
                        "threshold, chosen on the val split; there is no softmax to scale)")
    if not manifest["splits"].get(SPLIT, {}).get("num_samples"):
        raise NotFitted(f"calibration: data set {data_dir} has no validation split, so nothing was fitted "
                        "(the temperature stays 1 and --reject auto has no threshold); prepare it with a val split")


def calibrate_checkpoint(path: Path, data: str | None = None) -> Calibration:
    """Fit the checkpoint ``path``'s calibration on its data set's (or ``data``'s) val split and
    store it with the checkpoint. Raises ``NotFitted`` where there is nothing to fit."""
    import torch

    from imgtrain.data.format import verify_dataset
    from imgtrain.data.staging import local_data
    from imgtrain.inference.batch import check_compatible
    from imgtrain.inference.predictor import load_checkpoint

    device = "cuda" if torch.cuda.is_available() else "cpu"
    loaded = load_checkpoint(path, "best", device=device)
    data_dir = data or (loaded.meta.get("config") or {}).get("data")
    if not data_dir:
        raise ImgtrainError(f"checkpoint {loaded.path} does not say which data set it was trained on; pass --data")
    data_dir = local_data(data_dir)
    manifest = verify_dataset(data_dir)
    check_compatible(loaded, manifest, data_dir)
    check_fittable(loaded, manifest, data_dir)
    with torch.random.fork_rng(devices=[]):
        train = None
        if manifest["splits"].get("train", {}).get("num_samples"):  # mahalanobis's class means
            _, train_labels, train_features = split_logits(loaded, data_dir, manifest, "train", device)
            train = None if train_features is None else (train_features, train_labels)
        calibration = fit(*split_logits(loaded, data_dir, manifest, SPLIT, device), train=train)
    ckpt.add_file(loaded.path, ckpt.CALIBRATION_FILE, calibration.to_file())
    return calibration


def calibrate_stored(st, name: str, path: Path, data: str | None = None, keep_weights: bool = True) -> Calibration:
    """``calibrate_checkpoint`` for the checkpoint ``path`` of the working copy of the run ``name``
    in the object store ``st``, and its calibration stored there: its files brought down where
    they are not here (a Ray run's driver has the records only), calibrated.pt and meta.json
    (last) uploaded. The caller holds the run's lock. ``keep_weights`` False: the files brought
    down are deleted after (a driver's working copy keeps the records only)."""
    from imgtrain.data.format import load_manifest
    from imgtrain.data.staging import local_data
    from imgtrain.storage import mirror

    named = data or (ckpt.read_meta(path).get("config") or {}).get("data")
    if named:  # nothing to fit: said before any weights come down
        data_dir = local_data(named)
        check_fittable(None, load_manifest(data_dir), data_dir)
    fetched = mirror.pull_checkpoint(st, name, path.name)
    try:
        calibration = calibrate_checkpoint(path, data)
        mirror.push_checkpoint(st, name, path.name)
    finally:
        for rel in fetched if not keep_weights else ():
            if rel.rsplit("/", 1)[-1] not in (ckpt.META_FILE, ckpt.CALIBRATION_FILE):
                (st.local / name / rel).unlink(missing_ok=True)
    return calibration


@dataclass
class CalibrateResult:
    checkpoint: str
    calibration: Calibration

    def to_json(self) -> dict:
        c = self.calibration
        return {"checkpoint": self.checkpoint, "temperature": c.temperature, "fitted_on": c.fitted_on,
                "images": c.images, "nll": {"before": c.nll[0], "after": c.nll[1]},
                "ece": {"before": c.ece[0], "after": c.ece[1]}, "ood_keep": c.ood_keep,
                "ood_thresholds": c.ood_thresholds}


def calibrate(run, checkpoint: str = CalibrateOptions.checkpoint, storage: str = CalibrateOptions.storage,
              data: str | None = CalibrateOptions.data) -> CalibrateResult:
    """``imgtrain calibrate``: fit and store the calibration of ``run``'s checkpoint (the run's lock
    held: never while it trains). A run in an object store: in this machine's working copy, and
    uploaded into the checkpoint in the store (``calibrate_stored``)."""
    from imgtrain.ops.remote import is_remote
    from imgtrain.storage import location, ownership, runs

    if is_remote(storage) and not Path(str(run)).expanduser().exists() and checkpoint in ckpt.CHOICES:
        hint = "calibrate it once it is done (training calibrates at its end)"
        with runs.written_in_store(storage, str(run), "calibrated", hint) as run_dir:
            path = ckpt.choose(run_dir, checkpoint, run_dir.name)
            fitted = calibrate_stored(location.store(storage), run_dir.name, path, data)
        return CalibrateResult(f"{location.location(storage, run_dir.name)}/{path.name}", fitted)
    path = runs.resolve_checkpoint(run, checkpoint, storage)
    run_dir = path.parent
    if ownership.is_run(run_dir):
        with ownership.locked(run_dir, "calibrated"):
            return CalibrateResult(str(path), calibrate_checkpoint(path, data))
    return CalibrateResult(str(path), calibrate_checkpoint(path, data))
