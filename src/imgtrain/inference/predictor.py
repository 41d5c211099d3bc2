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
    ``explain=True``: the output also carries each image's Grad-CAM map of its predicted class (a
    multi-label model's most probable label) at the model's size, ``explain_map``, and the
    ``image`` itself (``explain.py``; a PyTorch checkpoint only).
    """

    def __init__(self, checkpoint, storage: str = "./runs", device: str = "cpu",
                 top_k: int = DEFAULT_TOP_K, threads: int = 0, tta: str = "none", indices: bool = False,
                 engine: str = "torch", explain: bool = False):
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
        self.explainer = None
        if explain:
            from imgtrain.inference.explain import Explainer

            self.explainer = Explainer(self.loaded, tta, device)

    def predict_proba(self, images) -> np.ndarray:
        """uint8 [B, H, W, C] -> float32 probabilities [B, num_classes]."""
        import torch

        model, preprocess = self.loaded.model, self.loaded.preprocess
        if hasattr(model, "probabilities"):  # an export's engine (onnx_engine.OnnxModel): its own threads
            return model.probabilities(preprocess.checked(images), self.tta)
        with process.torch_threads(self.threads), torch.inference_mode():
            x = preprocess(images, self.device)  # [B, C, H, W]
            activation = torch.sigmoid if self.multi_label else (lambda logits: logits.softmax(1))
            probs = activation(model(x).float())
            if self.tta == "flip":  # the mirror image: W reversed, as the photos preset's training flip
                mirrored = x.flip(-1)
                if preprocess.channels_last:  # the layout the model was put in
                    mirrored = mirrored.contiguous(memory_format=torch.channels_last)
                probs = (probs + activation(model(mirrored).float())) / 2
            return probs.cpu().numpy()

    def __call__(self, batch: dict) -> dict:
        probs = self.predict_proba(batch["image"])  # [B, K]
        out = self._answers(probs, batch)
        if self.explainer is not None:  # one object per row: a DataFrame column holds no [B, H, W] array
            with process.torch_threads(self.threads):
                maps = self.explainer.maps(batch["image"], probs.argmax(1))
            out["explain_map"], out["image"] = _rows(maps), _rows(batch["image"])
        return out

    def _answers(self, probs: np.ndarray, batch: dict) -> dict:
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
        return out


def _rows(arrays: np.ndarray) -> np.ndarray:
    """[B, ...] -> an object array of B arrays: one cell per row of a DataFrame."""
    out = np.empty(len(arrays), dtype=object)
    out[:] = list(arrays)
    return out
