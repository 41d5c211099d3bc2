"""What an export folder (``imgtrain export``) is known by, to those that write it (``export.py``,
``quantize.py``, the formats) and those that read it (``export_engine.py``, ``preprocess.py``): its
record's file name and its model's input and output names."""

from __future__ import annotations

from pathlib import Path

EXPORT_META = "imgtrain.json"  # what imgtrain needs of the checkpoint, and the files' sha256
INPUT_NAME, OUTPUT_NAME = "images", "probabilities"  # the exported model's input and output


def is_export(path) -> bool:
    return (Path(path) / EXPORT_META).is_file()
