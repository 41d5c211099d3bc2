"""``--format pt2``: ``model.pt2``, ``torch.export``'s program (``torch.export.load(path).module()``)."""

from __future__ import annotations

import warnings
from pathlib import Path

from imgtrain.inference.export_formats.registry import ExportFormat, register


def write(model, path: Path, example: tuple, dynamic_shapes: dict) -> None:
    import torch

    torch.export.save(torch.export.export(model, example, dynamic_shapes=dynamic_shapes), path)


def load(path: Path):
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = torch.export.load(path).module()

    def run(x):
        with torch.no_grad():
            return module(torch.from_numpy(x)).numpy()

    return run


PT2 = register(ExportFormat(name="pt2", file="model.pt2", runtime="torch", write=write, load=load,
                            summary="torch.export"))
