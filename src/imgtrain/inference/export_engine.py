"""``--engine NAME`` other than ``torch``: ``predict``, ``evaluate`` and ``serve`` run an export folder
(``imgtrain export``) with the engine its format declares (``export_formats``): ``onnxruntime``
runs ``--format onnx`` exports, int8 or not.

An export folder is recognised by its ``imgtrain.json`` (what imgtrain needs of the training
checkpoint's meta.json: the classes, image shape, normalisation and preset, and the sha256 of the
model file and of the files beside it that the model reads, checked at every load as a
checkpoint's are). The images are converted exactly as for the PyTorch engine (``Preprocess``'s
shape and preset); the engine's model takes them as uint8 and returns probabilities.

``imgtrain.json`` is untrusted, as a checkpoint's meta.json is (a shared export folder is anyone's
to edit, and the sha256 table it holds is its own word): it is held to meta.json's size cap and
bounds before anything is sized by it, and every file the model reads to its folder
(``export_files.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

from imgtrain.errors import ImgtrainError
from imgtrain.inference.export_files import inside, read_at_most
from imgtrain.inference.export_formats import ENGINES, ExportFormat
from imgtrain.inference.export_record import EXPORT_META, is_export
from imgtrain.inference.preprocess import LoadedCheckpoint, preprocess_of
from imgtrain.ops.files import sha256_file
from imgtrain.storage.checkpoint import MAX_META_BYTES


def check_engine(engine: str, target) -> None:
    """An unknown engine, or a model the engine cannot run, in one line."""
    if engine not in ENGINES:
        raise ImgtrainError(f"--engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    exported = is_export(target)
    if engine == "torch" and exported:
        others = " or ".join(name for name in ENGINES if name != "torch")
        raise ImgtrainError(f"{target} is an exported model, not a run or checkpoint; pass --engine {others}")
    spec = ENGINES[engine]
    if spec is not None and not (exported and (Path(target) / spec.file).is_file()):
        raise ImgtrainError(f"--engine {engine} runs an export folder of --format {spec.name}, and {target} is not "
                            f"one; make one with: imgtrain export RUN --format {spec.name} --out DIR")


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


def read_export(folder, engine: str) -> tuple[dict, ExportFormat]:
    """The record (``read_record``) of an export folder that ``engine`` runs, and its format, once
    the files its model reads are found inside the folder and to match the sha256 the export recorded."""
    folder = Path(folder)
    check_engine(engine, folder)
    spec = ENGINES[engine]
    meta = read_record(folder)
    recorded = meta["sha256"]
    model_file = inside(folder, spec.file)
    if sha256_file(model_file) != recorded.get(spec.file):
        raise ImgtrainError(f"{model_file} does not match the sha256 its export recorded (changed or "
                            f"damaged since); export the model again")
    for name, reader in (spec.side_files(model_file) if spec.side_files else {}).items():
        path = inside(folder, name, f"{spec.file}'s {reader}")
        # exports made before the table held these files: their locations are checked all the same
        if name in recorded and sha256_file(path) != recorded[name]:
            raise ImgtrainError(f"{path} does not match the sha256 its export recorded (changed or damaged "
                                f"since); export the model again")
    return meta, spec


def load_export(folder, engine: str, threads: int = 0) -> LoadedCheckpoint:
    """An export folder as a ``LoadedCheckpoint`` whose model is the engine's (``read_export``'s checks first)."""
    folder = Path(folder)
    meta, spec = read_export(folder, engine)
    preprocess = preprocess_of(folder, meta, export=True)
    return LoadedCheckpoint(spec.open(folder / spec.file, threads), preprocess, folder, meta)
