"""``--format torchscript``: ``model.torchscript.pt``, traced (scripting fails on timm models): deprecated
in PyTorch, still what Triton's PyTorch backend and libtorch load."""

from __future__ import annotations

import warnings
from pathlib import Path

from imgtrain.inference.export_formats.registry import ExportFormat, register


def write(model, path: Path, example: tuple, dynamic_shapes: dict) -> None:
    import torch

    torch.jit.trace(model, example).save(str(path))  # the batch dimension stays free when traced


def load(path: Path):
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = torch.jit.load(str(path))

    def run(x):
        with torch.no_grad():
            return module(torch.from_numpy(x)).numpy()

    return run


TORCHSCRIPT = register(ExportFormat(name="torchscript", file="model.torchscript.pt", runtime="torch",
                                    write=write, load=load))
