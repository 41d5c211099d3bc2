"""The formats ``imgtrain export --format NAME`` writes, by name, and the engines ``predict`` and
``serve`` run an export with (``--engine NAME``). Each format is an ``ExportFormat``, declared
and registered by its own module in this package (the package's ``__init__.py`` imports them, in
the order messages list them); ``export.py`` does everything formats share (the model with its
preprocessing inside, verification, the sidecar files, the swap into place) and asks the format
how to write, load back and quantize its file. Describing the formats imports neither torch nor
any exporter: each format imports its own when it is used."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from imgtrain.errors import ImgtrainError

if TYPE_CHECKING:  # the signatures only: describing the formats imports neither
    import numpy as np
    import torch


@dataclass(frozen=True)
class ExportFormat:
    name: str
    """What ``--format`` calls it."""
    file: str
    """The model file's name in the export folder."""
    runtime: str
    """What loads it back for the verification, as the model card names it ("onnxruntime", "torch")."""
    write: Callable[[torch.nn.Module, Path, tuple, dict], None]
    """(the model, uint8 [B, C, H, W] -> probabilities; the file; an example batch as a tuple of
    arguments; ``torch.export``'s ``dynamic_shapes``, the batch dimension free) -> the file written.
    An exception is the exporter refusing this model: ``export`` says so in one line."""
    load: Callable[[Path], Callable[[np.ndarray], np.ndarray]]
    """file -> the model loaded back by its own runtime, uint8 NCHW numpy -> probabilities [B, K]:
    what the verification compares with PyTorch."""
    summary: str = ""
    """What loads it, in a few words, where its name does not say (``--format``'s help)."""
    needs: tuple[str, ...] = ()
    """Modules beyond the base install that writing and loading it import, found before anything is loaded."""
    extra: str = ""
    """``pip install 'imgtrain[EXTRA]'`` installs them."""
    side_files: Callable[[Path], dict[str, str]] | None = None
    """model file -> {name of a file beside it that the model reads: what reads it} (ONNX's
    external data): their sha256 go in the record, and every load holds them inside the folder."""
    quantize: Callable[..., dict] | None = None
    """``--quantize int8``: (model file, data dir, manifest, split, loaded checkpoint, float32
    test metrics, max accuracy drop, --out) -> what it measured, the file replaced; None: refused."""
    engine: str = ""
    """The ``--engine`` of predict, evaluate and serve that runs its export folders; "": none does."""
    open: Callable[[Path, int], Any] | None = None
    """(model file, threads; the folder checked) -> a model whose ``probabilities(images, tta)``
    takes uint8 [B, H, W, C] and returns float32 [B, K]: what the engine runs (and, where it has
    it, ``outputs(images, tta)``: those and the logits of the plain images, or None)."""
    logits: bool = False
    """The exported model also outputs the logits before the temperature (``export_record.LOGITS_NAME``,
    its second output; a single-label model's): what its engine's out-of-distribution scores take.
    ``write`` then gets a model returning (probabilities, logits)."""

    def missing(self) -> list[str]:
        """The modules of ``needs`` not installed."""
        return [m for m in self.needs if importlib.util.find_spec(m) is None]


FORMATS: dict[str, ExportFormat] = {}
"""Every registered format, in the order of registration (the order messages list them)."""
ENGINES: dict[str, ExportFormat | None] = {"torch": None}
"""Every ``--engine``: ``torch`` runs a run or checkpoint, each other one the export format that declares it."""


def register(spec: ExportFormat) -> ExportFormat:
    if spec.name in FORMATS:
        raise ValueError(f"export format {spec.name!r} is registered twice")
    if spec.engine and (spec.engine in ENGINES or spec.open is None):
        raise ValueError(f"export format {spec.name!r}: engine {spec.engine!r} is taken or has no open()")
    FORMATS[spec.name] = spec
    if spec.engine:
        ENGINES[spec.engine] = spec
    return spec


def get(name: str) -> ExportFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ImgtrainError(f"--format must be one of {', '.join(FORMATS)}, got {name!r}") from None


def require(spec: ExportFormat) -> None:
    """Fail in one line, before any model is loaded, when what the format needs is not installed."""
    missing = spec.missing()
    if missing:
        raise ImgtrainError(f"--format {spec.name} needs {', '.join(missing)}: pip install 'imgtrain[{spec.extra}]'")


def quantizable() -> list[str]:
    """The formats ``--quantize int8`` takes."""
    return [spec.name for spec in FORMATS.values() if spec.quantize is not None]


def help_text() -> str:
    """``--format``'s help: "onnx (ONNX Runtime, TensorRT, Triton), torchscript or pt2 (torch.export)"."""
    names = [f"{spec.name} ({spec.summary})" if spec.summary else spec.name for spec in FORMATS.values()]
    return f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]
