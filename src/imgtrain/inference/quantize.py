"""``imgtrain export --format onnx --quantize int8``: ONNX Runtime's static quantization of the
verified float32 export, kept only if it costs at most ``--max-accuracy-drop`` of accuracy.

Static, not dynamic: dynamic quantization turns convolutions into ConvInteger, which ONNX
Runtime's CPU kernels ran 10x slower than float32 on the demo's ResNet-18, while static QDQ
(int8 weights per output channel, uint8 activations with ranges calibrated on training images)
ran 1.5x faster at the same test accuracy (BENCHMARKS.md). Calibration uses the first
CALIBRATION_IMAGES images of the training split with the evaluation transform: prepared files
are in a seeded random order, so they are a sample of every class.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np

from imgtrain.errors import ImgtrainError

CALIBRATION_IMAGES = 512
BATCH = 64


def quantize_int8(model_file: Path, data_dir: Path, manifest: dict, split: str, loaded, fp32: dict,
                  max_drop: float, out: Path) -> dict:
    """Replace ``model_file`` (float32 ONNX) by its int8 quantization; returns what it measured."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    from imgtrain.inference.export_record import INPUT_NAME

    class Calibration(CalibrationDataReader):
        def __init__(self):
            self.batches = _batches(data_dir, manifest, "train", loaded, CALIBRATION_IMAGES)

        def get_next(self):
            batch = next(self.batches, None)
            return None if batch is None else {INPUT_NAME: batch[0]}

    prepared, int8 = model_file.with_suffix(".prepared.onnx"), model_file.with_suffix(".int8.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quant_pre_process(str(model_file), str(prepared))  # shapes inferred, graph folded: what it quantizes best
        quantize_static(str(prepared), str(int8), Calibration(), quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    prepared.unlink()
    measured = _measure(model_file, int8, data_dir, manifest, split, loaded)
    drop = fp32["accuracy"] - measured["accuracy"]
    if drop > max_drop:
        int8.unlink()
        raise ImgtrainError(f"int8 quantization costs {drop:.2%} of {split} accuracy ({fp32['accuracy']:.2%} -> "
                            f"{measured['accuracy']:.2%}), more than --max-accuracy-drop {max_drop:.2%}; nothing "
                            f"was written to {out}: export without --quantize, or allow more")
    os.replace(int8, model_file)
    return {**measured, "fp32_accuracy": fp32["accuracy"], "accuracy_drop": drop, "max_accuracy_drop": max_drop,
            "calibration_images": min(CALIBRATION_IMAGES, manifest["splits"]["train"]["num_samples"]),
            "method": "ONNX Runtime quantize_static: QDQ, int8 weights per channel, uint8 activations, "
                      "min-max calibration"}


def _batches(data_dir: Path, manifest: dict, split: str, loaded, limit: int = 0):
    """(uint8 NCHW images, labels) of the split's first ``limit`` rows (all with 0), in file order."""
    from imgtrain.data import stream

    for batch in stream.split_batches(data_dir, manifest, split, loaded.preprocess.preset, BATCH, limit):
        yield np.ascontiguousarray(batch["image"].transpose(0, 3, 1, 2)), batch["label"]


def _measure(fp32_file: Path, int8_file: Path, data_dir: Path, manifest: dict, split: str, loaded) -> dict:
    """The int8 model's accuracy on the split, and how often its top-1 is the float32 model's."""
    import onnxruntime

    sessions = [onnxruntime.InferenceSession(str(f), providers=["CPUExecutionProvider"])
                for f in (fp32_file, int8_file)]
    images = hits = agree = 0
    max_diff = 0.0
    for x, labels in _batches(data_dir, manifest, split, loaded):
        fp32, int8 = (s.run(None, {s.get_inputs()[0].name: x})[0] for s in sessions)
        images += len(x)
        hits += int((int8.argmax(1) == labels).sum())
        agree += int((int8.argmax(1) == fp32.argmax(1)).sum())
        max_diff = max(max_diff, float(np.abs(int8 - fp32).max()))
    return {"accuracy": hits / max(images, 1), "agreement_with_fp32": agree / max(images, 1),
            "max_prob_diff_vs_fp32": max_diff, "images": images}
