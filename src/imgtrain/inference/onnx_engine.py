"""``--engine onnxruntime``: ``predict`` and ``serve`` run an ONNX export (``imgtrain export
--format onnx``, int8 or not) with ONNX Runtime instead of PyTorch.

An export folder is recognised by its ``imgtrain.json`` (what imgtrain needs of the training
checkpoint's meta.json: the classes, image shape, normalisation and preset, and the sha256 of the
model file and of its external data, checked at every load as a checkpoint's are). The images are
converted exactly as for the PyTorch engine (``Preprocess``'s shape and preset); the model takes
them as uint8 NCHW and returns probabilities, so only the layout changes here.

``imgtrain.json`` is untrusted, as a checkpoint's meta.json is (a shared export folder is anyone's
to edit, and the sha256 table it holds is its own word): it is held to meta.json's size cap and
bounds before anything is sized by it, and every file the model reads to its folder
(``export_files.py``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from imgtrain.checkpoint import MAX_META_BYTES
from imgtrain.data.format import short_repr
from imgtrain.errors import ImgtrainError
from imgtrain.inference.export_files import external_data, inside, read_at_most
from imgtrain.inference.export_record import EXPORT_META, is_export
from imgtrain.inference.options import ENGINES
from imgtrain.inference.preprocess import LoadedCheckpoint, preprocess_of

ONNX_FILE = "model.onnx"


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


def read_record(folder) -> dict:
    """An export folder's ``imgtrain.json``, held to a checkpoint's meta.json cap and bounds
    (``preprocess.preprocess_of``) before anything is sized by it; no file is hashed here."""
    folder = Path(folder)
    path = inside(folder, EXPORT_META)
    try:
        data = read_at_most(path, MAX_META_BYTES)
    except OSError as e:
        raise ImgtrainError(f"cannot read {path}: {e.strerror or e}") from None
    if data is None:
        raise ImgtrainError(f"{path} is {path.stat().st_size:,} bytes, over the {MAX_META_BYTES:,} an {EXPORT_META} "
                            f"can be; export the model again")
    try:
        meta = json.loads(data)
    except (ValueError, RecursionError):  # UnicodeDecodeError too; arrays nested 100,000 deep
        meta = None
    if not isinstance(meta, dict) or not isinstance(meta.get("sha256"), dict):
        raise ImgtrainError(f"{path} is not an export's record; export the model again")
    preprocess_of(folder, meta, export=True)  # raises, in one line, for what is out of bounds
    return meta


def read_export(folder) -> dict:
    """An ONNX export folder's record (``read_record``), once the files its model reads are found
    inside the folder and to match the sha256 the export recorded."""
    folder = Path(folder)
    check_engine("onnxruntime", folder)
    meta = read_record(folder)
    recorded = meta["sha256"]
    model_file = inside(folder, ONNX_FILE)
    if file_sha256(model_file) != recorded.get(ONNX_FILE):
        raise ImgtrainError(f"{model_file} does not match the sha256 its export recorded (changed or "
                            f"damaged since); export the model again")
    for name, tensor in external_data(model_file).items():
        path = inside(folder, name, f"{ONNX_FILE}'s tensor {short_repr(tensor)}")
        # exports made before the table held external data: their locations are checked all the same
        if name in recorded and file_sha256(path) != recorded[name]:
            raise ImgtrainError(f"{path} does not match the sha256 its export recorded (changed or damaged "
                                f"since); export the model again")
    return meta


def load_export(folder, threads: int = 0):
    """An ONNX export folder as a ``LoadedCheckpoint`` whose model is an ``OnnxModel`` (``read_export``'s checks first)."""
    folder = Path(folder)
    meta = read_export(folder)
    preprocess = preprocess_of(folder, meta, export=True)
    return LoadedCheckpoint(OnnxModel(folder / ONNX_FILE, threads), preprocess, folder, meta)
