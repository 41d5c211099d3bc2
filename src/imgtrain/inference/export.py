"""``imgtrain export``: a checkpoint's model as a file that ONNX Runtime, TorchScript or
``torch.export`` loads without imgtrain, verified on the test split before the command succeeds.
What is the same for every format is here; how each format is written, loaded back and quantized
is its own module's (``export_formats``).

What is exported (``Exportable``) takes uint8 images [B, C, H, W] at the training size and
returns class probabilities [B, K]: the scaling to [0, 1], the normalisation and the softmax are
inside it, so a deployment only has to resize and lay out its images (``preprocessing.json``
says how). The batch dimension is dynamic. A format that an engine of imgtrain runs (ONNX) also
outputs the logits before the temperature, second (``logits``): its engine scores images out of
distribution by them as the checkpoint does (energy, max-logit).

The folder written: the model file, ``labels.json`` (class names by output index),
``preprocessing.json``, ``verification.json``, ``MODEL_CARD.md`` (``model_card.py``) and
``imgtrain.json`` (what ``predict``/``serve --engine onnxruntime`` need, and the sha256 of the
model file and of its external data). It is assembled in a hidden folder beside ``--out`` and
renamed into place once verified, so a failed export leaves no half-written model where a
deployment could pick it up.

Verification runs the test split (or ``--split``) through both the PyTorch model and the
exported one, loaded back by its own runtime: the top-1 classes must agree on at least
``AGREEMENT_MIN`` of the images; the largest probability difference is reported beside it.
The same pass measures the test metrics the model card states.

A multi-label model (issue 48) is exported with a sigmoid per class instead of the softmax, its
decision thresholds beside it (``thresholds.json``, and a copy in ``imgtrain.json`` for
imgtrain's engines), and verified by label sets: each image's classes at or over their
thresholds must be PyTorch's on at least ``AGREEMENT_MIN`` of the images.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from imgtrain.data.images import EVAL_CROP
from imgtrain.errors import ImgtrainError, one_line
from imgtrain.inference import export_formats
from imgtrain.inference import multilabel_answers as ml
from imgtrain.inference.metrics import TOP_K, EvalSums
from imgtrain.inference.ood import LOGIT_SCORES
from imgtrain.inference.export_formats import ExportFormat
from imgtrain.inference.export_record import EXPORT_META, INPUT_NAME, LOGITS_NAME, OUTPUT_NAME, OUTPUTS_KEY, is_export
from imgtrain.inference.calibration_record import EXPORT_OOD, EXPORT_TEMPERATURE, calibration_of
from imgtrain.inference.options import ExportOptions
from imgtrain.inference.predictor import load_checkpoint
from imgtrain.inference.preprocess import LoadedCheckpoint
from imgtrain.ops.files import sha256_file, swap_in_folder

AGREEMENT_MIN = 0.999  # top-1 (multi-label: label set) agreement with PyTorch below this fails the export
THRESHOLDS_FILE = "thresholds.json"  # a multi-label export's decision thresholds, by class
VERIFY_BATCH = 256


def exportable(loaded: LoadedCheckpoint, logits: bool = False):
    """The model with its preprocessing and softmax inside: uint8 [B, C, H, W] -> float [B, K]
    (a multi-label model's: a sigmoid per class instead of the softmax). The logits are divided
    by the checkpoint's temperature (calibrate.py; 1 without one) before the softmax. ``logits``
    (a single-label model's): it returns (the probabilities, the logits before the temperature);
    ``outputs`` names what it returns."""
    import torch

    class Exportable(torch.nn.Module):
        def __init__(self, model, mean, std, multi_label, temperature, with_logits):
            super().__init__()
            self.model, self.multi_label, self.with_logits = model, multi_label, with_logits
            self.outputs = (OUTPUT_NAME, LOGITS_NAME) if with_logits else (OUTPUT_NAME,)
            self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1))
            self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1))
            self.register_buffer("temperature", torch.tensor(temperature, dtype=torch.float32))

        def forward(self, images):
            x = (images.float() / 255.0 - self.mean) / self.std
            logits = self.model(x).float()
            if self.multi_label:
                return logits.sigmoid()
            probs = (logits / self.temperature).softmax(1)
            return (probs, logits) if self.with_logits else probs

    p = loaded.preprocess
    multi_label = ml.is_multi_label_model(loaded)
    calibration = None if multi_label else calibration_of(loaded)
    model = loaded.model.to(memory_format=torch.contiguous_format)  # the runtimes take NCHW
    return Exportable(model, p.mean, p.std, multi_label, calibration.temperature if calibration else 1.0,
                      logits and not multi_label).eval()


@dataclass
class Verification:
    split: str
    images: int = 0
    agreeing: int = 0  # same top-1 class as PyTorch
    max_prob_diff: float = 0.0  # largest |p_exported - p_torch| over every image and class

    @property
    def agreement(self) -> float:
        return self.agreeing / max(self.images, 1)

    @property
    def passed(self) -> bool:
        return self.images > 0 and self.agreement >= AGREEMENT_MIN

    def line(self) -> str:
        return (f"verified on the {self.split} split: top-1 identical to PyTorch on {self.agreeing:,} of "
                f"{self.images:,} images ({self.agreement:.2%}, at least {AGREEMENT_MIN:.1%} needed); "
                f"largest probability difference {self.max_prob_diff:.2e}")


class LabelSetVerification(Verification):
    """A multi-label model's: ``agreeing`` counts the images whose label set (every class's
    probability against its threshold) is the one PyTorch gives."""

    def line(self) -> str:
        return (f"verified on the {self.split} split: label sets identical to PyTorch's on {self.agreeing:,} of "
                f"{self.images:,} images ({self.agreement:.2%}, at least {AGREEMENT_MIN:.1%} needed); "
                f"largest probability difference {self.max_prob_diff:.2e}")


@dataclass
class ExportResult:
    out: Path
    format: str
    model_file: Path
    checkpoint: str
    verification: Verification
    test_metrics: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        v = self.verification
        return {"out": str(self.out), "format": self.format, "model_file": str(self.model_file),
                "checkpoint": self.checkpoint, "verification": {**asdict(v), "agreement": v.agreement},
                "test_metrics": self.test_metrics}


def export(run, fmt: str, out, checkpoint: str = ExportOptions.checkpoint, storage: str = ExportOptions.storage,
           data: str | None = ExportOptions.data, split: str = ExportOptions.split,
           overwrite: bool = ExportOptions.overwrite, quantize: str = ExportOptions.quantize,
           max_accuracy_drop: float = ExportOptions.max_accuracy_drop) -> ExportResult:
    """Export ``run``'s checkpoint as ``fmt`` into the folder ``out`` and verify it (module
    docstring). ``quantize="int8"`` (ONNX): ONNX Runtime's static int8 quantization, refused when
    it costs more than ``max_accuracy_drop`` of accuracy on the split (``quantize.py``)."""
    spec = export_formats.get(fmt)
    if quantize not in ("none", "int8") or (quantize == "int8" and spec.quantize is None):
        takes = " or ".join(export_formats.quantizable())
        raise ImgtrainError(f"--quantize must be none, or int8 with --format {takes}; got {quantize!r} with {fmt}")
    if not 0 <= max_accuracy_drop <= 1:
        raise ImgtrainError(f"--max-accuracy-drop is a fraction of the images in [0, 1], got {max_accuracy_drop}")
    export_formats.require(spec)
    out = Path(out)
    if out.is_symlink():  # --overwrite would replace the link, or what it points to
        raise ImgtrainError(f"--out {out} is a symbolic link; give the folder itself")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not overwrite:
            raise ImgtrainError(f"{out} exists and is not an empty folder; pass --overwrite or another --out")
        if not is_export(out):  # --overwrite replaces an earlier export, never a folder of the user's
            raise ImgtrainError(f"{out} is not an earlier export (no {EXPORT_META}); --overwrite replaces only "
                                f"those: pass another --out")
    loaded = load_checkpoint(run, checkpoint, storage)
    multi_label = ml.is_multi_label_model(loaded)
    if multi_label and quantize == "int8":
        raise ImgtrainError("--quantize int8 is kept or refused by the test accuracy it costs, which a multi-label "
                            "model does not have; export it without --quantize")
    data_dir, manifest = _test_data(loaded, data, split)
    model = exportable(loaded, logits=spec.logits)
    out.parent.mkdir(parents=True, exist_ok=True)
    # a folder of its own: two exports to one --out at once never write into each other's
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        model_file = staging / spec.file
        _write(model, spec, model_file, loaded.preprocess.image_shape)
        verify = _verify_label_sets if multi_label else _verify
        verification, test_metrics = verify(model, _load(fmt, model_file), data_dir, manifest, split, loaded)
        if not verification.passed:
            raise ImgtrainError(f"the exported model disagrees with PyTorch: {verification.line()}; "
                                f"nothing was written to {out}")
        if quantize == "int8":
            test_metrics["int8"] = spec.quantize(model_file, data_dir, manifest, split, loaded, test_metrics,
                                                 max_accuracy_drop, out)
        _write_sidecars(staging, spec, loaded, manifest, verification, test_metrics, model.outputs)
        try:
            swap_in_folder(staging, out)  # readers (serve) find the old export or the new one, whole
        except FileExistsError:
            raise ImgtrainError(f"another export wrote {out} at the same time; it is there, whole: run this again "
                                "to replace it with this one") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return ExportResult(out, fmt, out / spec.file, str(loaded.path), verification, test_metrics)


def _test_data(loaded: LoadedCheckpoint, data: str | None, split: str) -> tuple[Path, dict]:
    from imgtrain.data.format import verify_dataset
    from imgtrain.inference.batch import check_compatible
    from imgtrain.data.staging import local_data

    data_dir = data or (loaded.meta.get("config") or {}).get("data")
    if not data_dir:
        raise ImgtrainError(f"checkpoint {loaded.path} does not say which data set it was trained on; pass --data "
                            "(the export is verified on its test split)")
    data_dir = local_data(data_dir)
    manifest = verify_dataset(data_dir)
    check_compatible(loaded, manifest, data_dir)
    if not manifest["splits"].get(split, {}).get("num_samples"):
        raise ImgtrainError(f"data set {data_dir} has no images in a split {split!r} to verify the export on; "
                            f"pass --split (it has {', '.join(manifest['splits'])})")
    return Path(data_dir), manifest


# ---------------------------------------------------------------- writing and loading: the format's


def _write(model, spec: ExportFormat, path: Path, image_shape) -> None:
    import torch

    h, w, c = image_shape
    example = (torch.zeros(2, c, h, w, dtype=torch.uint8),)
    any_batch = {"images": {0: torch.export.Dim("batch", min=1, max=1 << 16)}}
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the exporters' deprecation and tracer chatter
            spec.write(model, path, example, any_batch)
    except ImgtrainError:
        raise
    except Exception as e:  # an exporter's refusal of this model: say which
        raise ImgtrainError(f"PyTorch could not export this model as {spec.name} ({one_line(e, 240)}); "
                            f"try another --format") from None


def _load(fmt: str, path: Path):
    """The exported model loaded back by its own runtime: uint8 numpy [B, C, H, W] -> numpy [B, K]."""
    return export_formats.get(fmt).load(path)


# ---------------------------------------------------------------- verification


def _verify(model, exported, data_dir: Path, manifest: dict, split: str,
            loaded: LoadedCheckpoint) -> tuple[Verification, dict]:
    """Both models on every image of the split, batch by batch (memory: one batch); the test
    metrics of the PyTorch model."""
    result, sums = Verification(split), EvalSums(len(loaded.preprocess.classes))
    for batch, ours, theirs in _both_outputs(model, exported, data_dir, manifest, split, loaded):
        result.images += len(ours)
        result.agreeing += int((ours.argmax(1) == theirs.argmax(1)).sum())
        result.max_prob_diff = max(result.max_prob_diff, float(np.abs(ours - theirs).max()))
        top = np.argsort(-ours, axis=1, kind="stable")[:, :TOP_K]
        sums.add(batch["label"], top, ours[np.arange(len(ours)), top[:, 0]])
    return result, _metrics(sums, loaded.preprocess.classes)


def _verify_label_sets(model, exported, data_dir: Path, manifest: dict, split: str,
                       loaded: LoadedCheckpoint) -> tuple[Verification, dict]:
    """A multi-label model's ``_verify``: label sets compared at the checkpoint's thresholds, and
    its multi-label test figures (``multilabel_eval.label_figures``); the split's probabilities are
    kept for the average precision, float32 [n, classes], as ``evaluate`` keeps them."""
    from imgtrain.inference.multilabel_eval import label_figures

    thresholds, chosen_on = ml.thresholds_of(loaded)
    result, scores, targets = LabelSetVerification(split), [], []
    for batch, ours, theirs in _both_outputs(model, exported, data_dir, manifest, split, loaded):
        result.images += len(ours)
        result.agreeing += int((ml.decide(ours, thresholds) == ml.decide(theirs, thresholds)).all(1).sum())
        result.max_prob_diff = max(result.max_prob_diff, float(np.abs(ours - theirs).max()))
        scores.append(ours)
        targets.append(np.asarray(batch["label"], np.uint8))
    figures = label_figures(np.concatenate(scores), np.concatenate(targets), thresholds, loaded.preprocess.classes)
    return result, {"multi_label": True, "images": result.images, **figures, "thresholds_chosen_on": chosen_on}


def _both_outputs(model, exported, data_dir: Path, manifest: dict, split: str, loaded: LoadedCheckpoint):
    """(batch, the PyTorch model's outputs, the export's) for every batch of the split."""
    import torch

    from imgtrain.data import stream

    for batch in stream.split_batches(data_dir, manifest, split, loaded.preprocess.preset, VERIFY_BATCH):
        x = np.ascontiguousarray(batch["image"].transpose(0, 3, 1, 2))  # NHWC -> NCHW
        with torch.no_grad():
            ours = model(torch.from_numpy(x))
        yield batch, (ours[0] if isinstance(ours, tuple) else ours).numpy(), np.asarray(exported(x))


def _metrics(sums: EvalSums, classes) -> dict:
    precision, recall, f1, support = sums.class_scores()
    return {"accuracy": sums.accuracy, "top5_accuracy": sums.top5_accuracy, "images": sums.n,
            "macro_avg": sums.averages()["macro"], "ece": sums.ece,
            "per_class": {str(c): {"precision": float(precision[i]), "recall": float(recall[i]),
                                   "f1": float(f1[i]), "support": int(support[i])} for i, c in enumerate(classes)}}


def _write_sidecars(folder: Path, spec: ExportFormat, loaded: LoadedCheckpoint, manifest: dict,
                    verification: Verification, test_metrics: dict, outputs=(OUTPUT_NAME,)) -> None:
    from imgtrain.inference.model_card import model_card

    p = loaded.preprocess
    h, w, c = p.image_shape
    multi_label = ml.is_multi_label_model(loaded)
    (folder / "labels.json").write_text(json.dumps(list(p.classes), indent=1) + "\n")
    calibration = None if multi_label else calibration_of(loaded)
    t = calibration.temperature if calibration else 1.0
    meaning = (f"each class's own probability (a sigmoid), in labels.json's order; the image's labels are the classes "
               f"whose probability is at least their threshold in {THRESHOLDS_FILE}" if multi_label
               else f"class probabilities (softmax of the logits divided by the temperature {t:.6g}), in labels.json's "
                    "order")
    preprocessing = {
        "input": {"name": INPUT_NAME, "dtype": "uint8", "layout": "NCHW", "shape": ["batch", c, h, w],
                  "channels": "grayscale" if c == 1 else "RGB", "range": [0, 255]},
        "output": {"name": OUTPUT_NAME, "dtype": "float32", "shape": ["batch", len(p.classes)],
                   "meaning": meaning},
        **({"logits": {"name": LOGITS_NAME, "dtype": "float32", "shape": ["batch", len(p.classes)],
                       "meaning": "the model's logits before the temperature, the second output: the energy "
                                  "(logsumexp) and max-logit out-of-distribution scores come from them"}}
           if LOGITS_NAME in outputs else {}),
        "inside_the_model": {"scale": "x / 255", "normalize": {"mean": list(p.mean), "std": list(p.std)},
                             **({} if multi_label else {"temperature": t})},
        "before_the_model": _resize_rule(p.preset, h, w),
    }
    (folder / "preprocessing.json").write_text(json.dumps(preprocessing, indent=2) + "\n")
    check = {**asdict(verification), "agreement": verification.agreement, "required": AGREEMENT_MIN,
             "int8": test_metrics.get("int8")}
    (folder / "verification.json").write_text(json.dumps(check, indent=2) + "\n")
    # what imgtrain's own engines need to run the export (export_engine.load_export)
    meta = {key: loaded.meta.get(key) for key in ("model_args", "data", "epoch", "metrics", "imgtrain_version",
                                                  "torch_version")}
    config = loaded.meta.get("config") or {}
    meta["config"] = {k: config.get(k) for k in ("name", "data", "preset", "model")}
    model_file = folder / spec.file
    # the files beside it that the model reads (ONNX's external data), checked at load as it is
    beside = spec.side_files(model_file) if spec.side_files else {}
    hashes = {name: sha256_file(folder / name) for name in (spec.file, *beside)}
    meta.update(format=spec.name, checkpoint=str(loaded.path), quantized=test_metrics.get("int8") is not None,
                sha256=hashes, **{OUTPUTS_KEY: list(outputs)})
    if multi_label:  # the decision rule beside the model: for a deployment, and for imgtrain's engines (the record)
        thresholds, chosen_on = ml.thresholds_of(loaded)
        (folder / THRESHOLDS_FILE).write_text(json.dumps(
            {"rule": "a class is one of the image's labels when its probability is at least its threshold",
             "chosen_on": chosen_on, "thresholds": dict(zip(p.classes, thresholds.tolist()))}, indent=1) + "\n")
        meta.update({ml.EXPORT_THRESHOLDS: thresholds.tolist(), ml.EXPORT_CHOSEN_ON: chosen_on})
    if not multi_label:  # for imgtrain's engines (calibrate.calibration_at): T, and --reject auto's thresholds
        meta[EXPORT_TEMPERATURE] = t
        stored = calibration.ood_thresholds if calibration else {}
        scored = [m for m in stored if m == "max-softmax" or LOGITS_NAME in outputs and m in LOGIT_SCORES]
        meta[EXPORT_OOD] = {"method": "max-softmax", "keep": calibration.ood_keep if calibration else None,
                            "threshold": stored.get("max-softmax"),  # what exports before the logits output read
                            "thresholds": {m: stored[m] for m in scored}}
    (folder / EXPORT_META).write_text(json.dumps(meta, indent=1) + "\n")
    (folder / "MODEL_CARD.md").write_text(model_card(spec.name, spec.file, spec.runtime, loaded, manifest,
                                                     verification.line(), test_metrics, calibration))


def _resize_rule(preset: str, h: int, w: int) -> str:
    """What imgtrain's evaluation does to an image before the model (``images.conform_image``)."""
    if preset == "photos":
        return (f"apply the EXIF orientation and convert to RGB; take the centre region that keeps "
                f"{EVAL_CROP:.1%} of the shorter side at the {h}x{w} aspect ratio and resize it to {h}x{w} "
                f"with PIL's bilinear filter; then HWC -> CHW")
    return (f"apply the EXIF orientation and convert to 8-bit grayscale; resize to {h}x{w} with PIL's "
            f"bilinear filter when the size differs; then add the channel axis")
