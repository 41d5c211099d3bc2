"""A checkpoint's model, ready to predict: load it, preprocess images as in training, and the
``Predictor`` callable that Ray Data's ``map_batches`` (and ``serve``) run.

Everything needed to rebuild the model and preprocess its input comes from the checkpoint's
``meta.json`` (model args, the data set's classes, image shape and normalisation, the memory
format used in training), so no glue code is needed:

    model, preprocess = imgtrain.load_model("demo")          # eval mode, on the CPU
    probs = model(preprocess(images_uint8_nhwc)).softmax(1)

    ds.map_batches(Predictor, fn_constructor_kwargs={"checkpoint": path},
                   compute=ray.data.ActorPoolStrategy(size=2))   # the same, on Ray Data
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from imgtrain.data.format import short_repr
from imgtrain.errors import ImgtrainError, one_line
from imgtrain.inference import multilabel_answers as ml
from imgtrain.inference import ood
from imgtrain.inference.options import DEFAULT_TOP_K, TTA
from imgtrain.inference.preprocess import LoadedCheckpoint, preprocess_of, preset_of
from imgtrain.ops import process
from imgtrain.storage import checkpoint as ckpt
from imgtrain.storage import runs


# ---------------------------------------------------------------- loading a checkpoint


def load_checkpoint(
    run_or_checkpoint, checkpoint: str = "best", storage: str = "./runs", device: str = "cpu",
    engine: str = "torch", threads: int = 0,
) -> LoadedCheckpoint:
    """Verify the checkpoint's checksums, rebuild its model and load the weights (eval mode).
    Another ``engine`` (``onnxruntime``): an export folder it runs instead (``export_engine.load_export``)."""
    import torch

    from imgtrain.inference.export_engine import check_engine, load_export
    from imgtrain.models.zoo import build_from_args

    check_engine(engine, run_or_checkpoint)
    if engine != "torch":
        return load_export(run_or_checkpoint, engine, threads)
    path = runs.resolve_checkpoint(run_or_checkpoint, checkpoint, storage)  # verified
    meta = ckpt.read_meta(path)
    args = meta.get("model_args") or {}
    try:
        with torch.random.fork_rng(devices=[]):  # its random initial weights are overwritten: the caller's RNG is left alone
            model = build_from_args(args)
    except (ValueError, KeyError, TypeError) as e:
        raise ImgtrainError(f"checkpoint {path} holds a model imgtrain cannot build "
                            f"(model_args {short_repr(args, 300)}): {one_line(e)}") from None
    state = ckpt.load_model_state(path)
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        detail = one_line(e, 240)
        raise ImgtrainError(
            f"checkpoint {path}: the weights in {ckpt.MODEL_FILE} do not fit a {args.get('architecture')} "
            f"with {args.get('in_channels')} channel(s) and {args.get('num_classes')} classes "
            f"(another architecture or class count?): {detail}"
        ) from None
    preprocess = preprocess_of(path, meta)
    model = model.to(device).eval()
    if preprocess.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return LoadedCheckpoint(model, preprocess, path, meta)


def preprocess_preset(checkpoint_dir: Path) -> str:
    """The evaluation transform a checkpoint's (or an export's) model was validated with."""
    from imgtrain.inference.export_record import is_export
    from imgtrain.inference.export_engine import read_record

    if is_export(checkpoint_dir):
        return preset_of(read_record(checkpoint_dir))  # held to its bounds first, as a checkpoint's is
    return preset_of(ckpt.read_meta(checkpoint_dir))


def check_tta(tta: str, preset: str | None = None) -> None:
    """An unknown ``--tta`` is an error; ``flip`` on a digits model a warning: a mirrored digit is
    another shape (2, 3, 7...), and training never showed it one. ``preset``: the checkpoint's
    (``preprocess_preset``)."""
    import warnings

    from imgtrain.errors import ImgtrainWarning

    if tta not in TTA:
        raise ImgtrainError(f"--tta must be one of {', '.join(TTA)}, got {tta!r}")
    if tta == "flip" and preset == "digits":
        warnings.warn("--tta flip mirrors the images, but this model was trained with the digits preset, which "
                      "never flips them (a mirrored digit is another shape); flip is meant for photos",
                      ImgtrainWarning, stacklevel=3)


def load_model(run_or_checkpoint, checkpoint: str = "best", storage: str = "./runs", device: str = "cpu"):
    """``(model, preprocess)``: a ready ``torch.nn.Module`` in eval mode and the function that
    turns uint8 images [B, H, W, C] into its input. ``run_or_checkpoint`` is a run name (in
    ``storage``), a run directory or a checkpoint directory."""
    loaded = load_checkpoint(run_or_checkpoint, checkpoint, storage, device)
    return loaded.model, loaded.preprocess


# ---------------------------------------------------------------- the predictor


class Predictor:
    """Class probabilities and top-k predictions for batches of images.

    Directly: ``Predictor("demo")({"image": images})``; on Ray Data, as the callable class
    of ``map_batches``, one model per actor. Input batches are dicts of numpy arrays with an
    ``image`` column, uint8 [B, H, W, C]; every other column (id, path, label...) is passed
    through. Output adds ``pred_index``, ``pred_class``, ``confidence`` and, for i = 1..k,
    ``top{i}_class`` / ``top{i}_prob`` (and ``top{i}_index`` with ``indices=True``, what evaluate
    scores by: class names need not be unique). ``threads`` > 0: torch's threads while it loads
    and predicts (one actor per core, or one actor using them all); 0: the process's setting.
    ``tta="flip"``: the probabilities are the mean of the model's softmax over each image and its
    horizontal mirror image (two forward passes). A multi-label model (issue 48): a sigmoid per
    class, and the output adds ``labels`` and ``prob_<class>`` instead (``multilabel_answers.py``).

    Calibration (issue 49, ``calibrate.py``): the logits are divided by the checkpoint's
    temperature before the softmax (an export has it inside). The output adds the image's
    out-of-distribution score, ``ood_<method>`` (``ood.py``: of the plain image, whatever the
    TTA, so that a threshold means the same), and with a ``threshold`` (``rejection``) a
    ``rejected`` column: a rejected image's ``pred_class`` is ``unknown`` and its ``pred_index`` -1.
    With ``indices`` and a ``label`` column (evaluate): ``nll``, and ``uncalibrated_confidence``,
    ``uncalibrated_pred_index`` and ``uncalibrated_nll`` (T = 1) where the logits are at hand.
    ``explain=True``: the output also carries each image's Grad-CAM map of its predicted class (a
    multi-label model's most probable label) at the model's size, ``explain_map``, and the
    ``image`` itself (``explain.py``; a PyTorch checkpoint only).
    """

    def __init__(self, checkpoint, storage: str = "./runs", device: str = "cpu",
                 top_k: int = DEFAULT_TOP_K, threads: int = 0, tta: str = "none", indices: bool = False,
                 engine: str = "torch", ood_score: str = ood.DEFAULT_METHOD, threshold: float | None = None,
                 explain: bool = False):
        check_tta(tta)  # the warning for digits is the driver's, once (batch.predictions, serve)
        # Set around each call and put back after, not for good: the process may be the
        # caller's own (a notebook), which must find its setting as it left it.
        self.threads = threads
        if isinstance(checkpoint, LoadedCheckpoint):  # loaded in this process already
            self.loaded = checkpoint
        else:
            with process.torch_threads(threads):
                self.loaded = load_checkpoint(checkpoint, "best", storage, device, engine, threads)
        self.device, self.tta, self.indices = device, tta, indices
        self.top_k = max(1, min(top_k, len(self.loaded.preprocess.classes)))
        self.classes = np.asarray(self.loaded.preprocess.classes, dtype=object)
        self.multi_label = ml.is_multi_label_model(self.loaded)  # a sigmoid per class, decided at its threshold
        if self.multi_label:
            self.thresholds, _ = ml.thresholds_of(self.loaded)
            self.separator = ml.separator_of(self.loaded)
        from imgtrain.inference.calibration_record import calibration_of

        self.calibration = None if self.multi_label else calibration_of(self.loaded)
        self.exported = hasattr(self.loaded.model, "probabilities")  # an export's engine: probabilities, T inside
        self.temperature = self.calibration.temperature if self.calibration and not self.exported else 1.0
        # the export's model gives what its outputs give, whatever engine was named with a loaded one
        self.ood_score = score_method("export" if self.exported else "torch", ood_score, self.loaded.meta)
        self.threshold = threshold
        self.fitted = None  # mahalanobis's class means: its forward passes keep the penultimate features
        if self.ood_score in ood.FEATURE_METHODS and not self.multi_label and not self.exported:
            self.fitted = check_score(self.loaded.path, self.loaded.meta, self.ood_score).mahalanobis
        self.explainer = None
        if explain:
            from imgtrain.inference.explain import Explainer

            self.explainer = Explainer(self.loaded, tta, device)

    def predict_proba(self, images) -> np.ndarray:
        """uint8 [B, H, W, C] -> float32 probabilities [B, num_classes]."""
        return self._forward(images)[0]

    def predict_with_scores(self, images) -> tuple[np.ndarray, np.ndarray | None]:
        """(probabilities [B, K], out-of-distribution scores [B]; None for a multi-label model)."""
        probs, logits, features = self._forward(images)
        return probs, self._scores(probs, logits, features)

    def _scores(self, probs, logits, features) -> np.ndarray | None:
        if self.multi_label:
            return None
        if logits is None:  # an export made before its logits output: the max of its calibrated softmax
            return probs.max(axis=1).astype(np.float64)
        t = self.calibration.temperature if self.calibration else 1.0  # max-softmax's (an export's T is inside it)
        return ood.scores(logits, self.ood_score, t, features, self.fitted)

    def _forward(self, images) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """(float32 probabilities [B, K], float32 logits of the plain images [B, K] or None for an
        export without them, their penultimate features [B, D] where the score needs them)."""
        import torch

        model, preprocess = self.loaded.model, self.loaded.preprocess
        if self.exported:  # an export's engine (onnx_engine.OnnxModel): its own threads
            if hasattr(model, "outputs"):
                return (*model.outputs(preprocess.checked(images), self.tta), None)
            return model.probabilities(preprocess.checked(images), self.tta), None, None
        with process.torch_threads(self.threads), torch.inference_mode():
            x = preprocess(images, self.device)  # [B, C, H, W]
            t = self.temperature
            activation = torch.sigmoid if self.multi_label else (lambda logits: (logits / t).softmax(1))
            logits, features = self._logits(model, x)
            probs = activation(logits)
            if self.tta == "flip":  # the mirror image: W reversed, as the photos preset's training flip
                mirrored = x.flip(-1)
                if preprocess.channels_last:  # the layout the model was put in
                    mirrored = mirrored.contiguous(memory_format=torch.channels_last)
                probs = (probs + activation(model(mirrored).float())) / 2
            return probs.cpu().numpy(), logits.cpu().numpy(), features

    def _logits(self, model, x):
        """(the model's float logits, its penultimate features as numpy where the score needs them)."""
        if self.fitted is None:
            return model(x).float(), None
        found, hook = ood.penultimate(model)  # only around this pass: the model may be shared
        try:
            return model(x).float(), found[0]
        finally:
            hook.remove()

    def __call__(self, batch: dict) -> dict:
        probs, logits, features = self._forward(batch["image"])  # [B, K]
        out = self._answers(probs, logits, features, batch)
        if self.explainer is not None:  # one object per row: a DataFrame column holds no [B, H, W] array
            with process.torch_threads(self.threads):
                maps = self.explainer.maps(batch["image"], probs.argmax(1))
            out["explain_map"], out["image"] = _rows(maps), _rows(batch["image"])
        return out

    def _answers(self, probs: np.ndarray, logits, features, batch: dict) -> dict:
        if self.multi_label:  # the label set and every class's probability (multilabel_answers.py)
            out = {k: v for k, v in batch.items() if k != "image"}
            out.update(ml.prediction_columns(probs, self.thresholds, self.classes, self.separator))
            return out
        top = np.argsort(-probs, axis=1, kind="stable")[:, : self.top_k]  # [B, k]
        out = {k: v for k, v in batch.items() if k != "image"}
        out["pred_index"] = top[:, 0].astype(np.int64)
        out["pred_class"] = self.classes[top[:, 0]].astype(str)
        out["confidence"] = np.take_along_axis(probs, top[:, :1], 1)[:, 0]
        for i in range(self.top_k):
            out[f"top{i + 1}_class"] = self.classes[top[:, i]].astype(str)
            out[f"top{i + 1}_prob"] = np.take_along_axis(probs, top[:, i : i + 1], 1)[:, 0]
            if self.indices:
                out[f"top{i + 1}_index"] = top[:, i].astype(np.int64)
        scores = self._scores(probs, logits, features)
        out[ood.column(self.ood_score)] = scores
        if self.threshold is not None:
            rejected = scores < self.threshold
            out["rejected"] = rejected
            out["pred_class"] = np.where(rejected, ood.UNKNOWN, out["pred_class"]).astype(str)
            out["pred_index"] = np.where(rejected, -1, out["pred_index"]).astype(np.int64)
        if self.indices and "label" in batch:
            out.update(self._likelihood_columns(probs, logits, np.asarray(batch["label"], np.int64)))
        return out

    def _likelihood_columns(self, probs, logits, labels) -> dict:
        """evaluate's: each image's NLL as answered, and (with the logits) its figures at T = 1."""
        rows = np.arange(len(labels))
        out = {"nll": -np.log(np.maximum(probs[rows, labels].astype(np.float64), 1e-300))}
        if logits is not None:
            from imgtrain.inference.temperature import log_probabilities

            plain = log_probabilities(logits)
            out["uncalibrated_pred_index"] = plain.argmax(1).astype(np.int64)
            out["uncalibrated_confidence"] = np.exp(plain.max(1))
            out["uncalibrated_nll"] = -plain[rows, labels]
        return out


def score_method(engine: str, asked: str, record: dict | None = None) -> str:
    """The score a model gives: ``asked``, except with an export's engine (``record``: the export's
    imgtrain.json), which gives those of its logits output (``ood.LOGIT_SCORES``) and otherwise
    max-softmax: mahalanobis (no features among its outputs), and every score of an export made
    before the logits output (the calibrated probabilities only)."""
    from imgtrain.inference.export_record import has_logits

    ood.check_method(asked)
    if engine == "torch" or asked in ood.LOGIT_SCORES and has_logits(record):
        return asked
    return "max-softmax"


def check_score(path: Path, meta: dict, method: str):
    """The calibration of the checkpoint (or export) ``path``, after checking that it has what the
    score ``method`` needs (mahalanobis: the class means); None where it has none and needs none."""
    from imgtrain.data.format import is_multi_label
    from imgtrain.inference.calibration_record import calibration_at

    calibration = calibration_at(path, meta)
    if (method in ood.FEATURE_METHODS and not is_multi_label(ml.trained_on(meta))
            and (calibration is None or calibration.mahalanobis is None)):
        raise ImgtrainError(f"--ood-score {method} needs the class means calibration fits on the val split, and "
                            f"{path} has none (its data set has no val split, it was never calibrated, or its "
                            "classifier's input is wider than 4,096 features): run `imgtrain calibrate RUN`, or pick "
                            "another score")
    return calibration


def rejection(path: Path, meta: dict, method: str, reject) -> float | None:
    """The threshold ``--reject`` names for the score ``method`` (``score_method``'s) of the
    checkpoint (or export) ``path`` whose meta.json (or record) is ``meta``: None (off), a number
    as given, or ``auto``'s, stored with the checkpoint by calibration."""
    from imgtrain.data.format import is_multi_label

    value = ood.parse_reject(reject)
    if value is None:
        return None
    if is_multi_label(ml.trained_on(meta)):
        raise ImgtrainError("--reject answers 'unknown' instead of one of a single-label model's classes; this model "
                            "is multi-label (an image with no label over its threshold has none): drop --reject")
    if value != ood.REJECT_AUTO:
        return value
    calibration = check_score(path, meta, method)
    stored = (calibration.ood_thresholds if calibration else {}).get(method)
    if stored is None:
        raise ImgtrainError(f"--reject auto takes the {method} threshold that calibration stores with the checkpoint, "
                            f"and {path} has none (its data set has no val split, or it was never calibrated): "
                            "run `imgtrain calibrate RUN`, or pass a number")
    return stored

def _rows(arrays: np.ndarray) -> np.ndarray:
    """[B, ...] -> an object array of B arrays: one cell per row of a DataFrame."""
    out = np.empty(len(arrays), dtype=object)
    out[:] = list(arrays)
    return out
