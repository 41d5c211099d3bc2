"""``--engine onnxruntime``: ``predict`` and ``serve`` run an ONNX export (``imgtrain export
--format onnx``, int8 or not) with ONNX Runtime instead of PyTorch.

An export folder is recognised by its ``imgtrain.json`` (what imgtrain needs of the training
checkpoint's meta.json: the classes, image shape, normalisation and preset, and the model file's
sha256, checked at every load as a checkpoint's are). The images are converted exactly as for
the PyTorch engine (``Preprocess``'s shape and preset); the model takes them as uint8 NCHW and
returns probabilities, so only the layout changes here.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from imgtrain.errors import ImgtrainError

ENGINES = ("torch", "onnxruntime")
EXPORT_META = "imgtrain.json"
ONNX_FILE = "model.onnx"


def is_export(path) -> bool:
    return (Path(path) / EXPORT_META).is_file()


def check_engine(engine: str, target) -> None:
    """An unknown engine, or a model the engine cannot run, in one line."""
    if engine not in ENGINES:
        raise ImgtrainError(f"--engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    exported = is_export(target)
    if engine == "torch" and exported:
        raise ImgtrainError(f"{target} is an exported model, not a run or checkpoint; pass --engine onnxruntime")
    if engine == "onnxruntime" and not (exported and (Path(target) / ONNX_FILE).is_file()):
        raise ImgtrainError(f"--engine onnxruntime runs an ONNX export folder, and {target} is not one; make one "
                            f"with: imgtrain export RUN --format onnx --out DIR")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class OnnxModel:
    """An ONNX export in an ONNX Runtime session: uint8 images [B, H, W, C] -> probabilities."""

    def __init__(self, path: Path, threads: int = 0):
        try:
            import onnxruntime
        except ImportError:
            raise ImgtrainError("--engine onnxruntime needs ONNX Runtime: pip install 'imgtrain[export]'") from None
        options = onnxruntime.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        self.session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.input = self.session.get_inputs()[0].name

    def probabilities(self, images, tta: str = "none") -> np.ndarray:
        x = np.ascontiguousarray(np.asarray(images).transpose(0, 3, 1, 2))  # NHWC -> NCHW
        probs = self.session.run(None, {self.input: x})[0]
        if tta == "flip":  # the mirror image, W reversed, as the PyTorch engine does
            probs = (probs + self.session.run(None, {self.input: np.ascontiguousarray(x[..., ::-1])})[0]) / 2
        return probs.astype(np.float32, copy=False)


def read_export(folder) -> dict:
    """An ONNX export folder's record (``imgtrain.json``), once its model file is found to match
    the sha256 the export recorded."""
    folder = Path(folder)
    check_engine("onnxruntime", folder)
    try:
        meta = json.loads((folder / EXPORT_META).read_text())
        recorded = meta["sha256"][ONNX_FILE]
    except (OSError, ValueError, KeyError, TypeError):
        raise ImgtrainError(f"{folder / EXPORT_META} is not an export's record; export the model again") from None
    if file_sha256(folder / ONNX_FILE) != recorded:
        raise ImgtrainError(f"{folder / ONNX_FILE} does not match the sha256 its export recorded (changed or "
                            f"damaged since); export the model again")
    return meta


def load_export(folder, threads: int = 0):
    """An ONNX export folder as a ``LoadedCheckpoint`` whose model is an ``OnnxModel`` (``read_export``'s checks first)."""
    from imgtrain.inference.predictor import LoadedCheckpoint, preprocess_of

    folder = Path(folder)
    meta = read_export(folder)
    return LoadedCheckpoint(OnnxModel(folder / ONNX_FILE, threads), preprocess_of(folder, meta), folder, meta)
