"""What an export folder (``imgtrain export``) is known by, to those that write it (``export.py``,
``quantize.py``, the formats) and those that read it (``export_engine.py``, ``preprocess.py``): its
record's file name and its model's input and output names."""

from __future__ import annotations

from pathlib import Path

EXPORT_META = "imgtrain.json"  # what imgtrain needs of the checkpoint, and the files' sha256
INPUT_NAME, OUTPUT_NAME = "images", "probabilities"  # the exported model's input and output
# A second output, the logits before the temperature, of a single-label export whose format an
# engine runs (ONNX): the out-of-distribution scores other than max-softmax take them. The record
# lists its outputs (OUTPUTS_KEY); an export made before has the probabilities only.
LOGITS_NAME = "logits"
OUTPUTS_KEY = "outputs"


def is_export(path) -> bool:
    return (Path(path) / EXPORT_META).is_file()


def has_logits(record: dict | None) -> bool:
    """Whether the export whose record (imgtrain.json) is ``record`` outputs its logits too."""
    outputs = (record or {}).get(OUTPUTS_KEY)
    return isinstance(outputs, list) and LOGITS_NAME in outputs
