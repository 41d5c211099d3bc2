"""imgtrain: train image classifiers with data-parallel PyTorch on Ray.

Every CLI verb is one function here:
    imgtrain.prepare(kind, out, source=path, **options) -> dataset manifest (imgtrain data prepare)
    imgtrain.inspect_dataset(data, out) -> findings   (imgtrain data inspect)
    imgtrain.train(cfg)     -> RunResult              (imgtrain train)
    imgtrain.load_run(...)  -> RunResult              (imgtrain runs show)
    imgtrain.list_runs(...) -> list[RunResult]        (imgtrain runs list)
    imgtrain.evaluate(run)  -> EvalResult             (imgtrain evaluate)
    imgtrain.predict(run, input, out) -> PredictResult (imgtrain predict)
    imgtrain.load_model(run) -> (model, preprocess)
    imgtrain.Predictor(checkpoint)                    (for Ray Data map_batches)
    imgtrain.write_report(run) -> Path                (imgtrain report)
    imgtrain.export(run, format, out) -> ExportResult (imgtrain export)
"""

from __future__ import annotations

import importlib

from imgtrain.errors import ImgtrainError

# The rest of the API is imported when first used (PEP 562): every `imgtrain.x` module imports
# this package first, and `imgtrain --version`, `--help` or a refusal must not wait seconds for
# numpy, pyarrow, Ray and PyTorch.
_LAZY = {
    "TrainConfig": "imgtrain.config", "PrepareOptions": "imgtrain.data.options",
    "EvalResult": "imgtrain.inference.batch", "InferenceOptions": "imgtrain.inference.options",
    "evaluate": "imgtrain.inference.batch", "predict": "imgtrain.inference.batch",
    "Predictor": "imgtrain.inference.predictor", "load_model": "imgtrain.inference.predictor",
    "RunResult": "imgtrain.storage.runs", "list_runs": "imgtrain.storage.runs",
    "load_run": "imgtrain.storage.runs",
    "inspect_dataset": "imgtrain.data.inspection", "write_report": "imgtrain.inference.report",
}


def __getattr__(name: str):
    if name == "__version__":
        from importlib import metadata

        try:
            value = metadata.version("imgtrain")
        except metadata.PackageNotFoundError:  # imported from a source tree
            value = "unknown"
    elif name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    else:
        raise AttributeError(f"module 'imgtrain' has no attribute {name!r}")
    globals()[name] = value  # found once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, "__version__"})


def train(cfg: TrainConfig, display=None, overwrite: bool = False) -> RunResult:
    """Train (or resume) ``cfg.name``; ``overwrite`` replaces an existing run. See ``imgtrain.training.driver.train``."""
    from imgtrain.training.driver import train as _train

    return _train(cfg, display=display, overwrite=overwrite)


def prepare(kind: str, /, out_dir, source=None, options: PrepareOptions | None = None, progress=None, *,
            source_path=None, **option_fields) -> dict:
    """Prepare a data set directory, as ``imgtrain data prepare KIND OUT_DIR --source PATH ...``:
    the same names, ``imgtrain.prepare("folder", "data/pets", source="PHOTOS/", val_fraction=0.1)``.
    ``option_fields``: any ``PrepareOptions`` field (or pass ``options``); ``size`` also as the
    CLI's "64x64". ``source_path`` is the old name of ``source``. See ``imgtrain.data.prepare.prepare``."""
    import dataclasses

    from imgtrain.data.options import PrepareOptions, parse_size
    from imgtrain.data.prepare import prepare as _prepare

    if source_path is not None:
        if source is not None:
            raise ImgtrainError("pass source (source_path is its old name), not both")
        source = source_path
    if option_fields:
        known = {f.name for f in dataclasses.fields(PrepareOptions)}
        if unknown := sorted(set(option_fields) - known):
            raise ImgtrainError(f"prepare() has no option {', '.join(unknown)}; its options: {', '.join(sorted(known))}")
        if isinstance(option_fields.get("size"), str):
            option_fields["size"] = parse_size(option_fields["size"])
        options = dataclasses.replace(options or PrepareOptions(), **option_fields)
    return _prepare(kind, out_dir, source, options, progress)


def export(run, format: str, out, **options):
    """The checkpoint's model as ONNX, TorchScript or pt2 in the folder ``out``, with its labels,
    preprocessing and model card, verified against PyTorch. ``options``: those of ``imgtrain
    export``, with their defaults (``imgtrain.inference.options.ExportOptions``: checkpoint,
    storage, data, split, overwrite, quantize, max_accuracy_drop). See ``imgtrain.inference.export``."""
    from imgtrain.inference.export import export as _export

    return _export(run, format, out, **options)


__all__ = [
    "TrainConfig", "ImgtrainError", "RunResult", "train", "prepare", "inspect_dataset", "PrepareOptions", "load_run",
    "list_runs",
    "EvalResult", "InferenceOptions", "Predictor", "evaluate", "load_model", "predict", "write_report",
    "export",
]
