"""imgtrain: train image classifiers with data-parallel PyTorch on Ray.

Every CLI verb is one function here:
    imgtrain.prepare(source, out, path, PrepareOptions(...)) -> dataset manifest (imgtrain data prepare)
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

from imgtrain.config import TrainConfig
from imgtrain.data.options import PrepareOptions
from imgtrain.errors import ImgtrainError
from imgtrain.inference.batch import EvalResult, InferenceOptions, evaluate, predict
from imgtrain.inference.predictor import Predictor, load_model
from imgtrain.runs import RunResult, list_runs, load_run, package_version

__version__ = package_version("imgtrain") or "unknown"  # "unknown": imported from a source tree


def train(cfg: TrainConfig, display=None, overwrite: bool = False) -> RunResult:
    """Train (or resume) ``cfg.name``; ``overwrite`` replaces an existing run. See ``imgtrain.training.driver.train``."""
    from imgtrain.training.driver import train as _train

    return _train(cfg, display=display, overwrite=overwrite)


def prepare(source: str, out_dir, source_path=None, options: PrepareOptions | None = None, progress=None) -> dict:
    """Prepare a data set directory. See ``imgtrain.data.prepare.prepare``."""
    from imgtrain.data.prepare import prepare as _prepare

    return _prepare(source, out_dir, source_path, options, progress)


def inspect_dataset(data_dir, out=None, workers: int = 0, threshold: int | None = None, seed: int = 0,
                    progress=None) -> dict:
    """A look at a prepared data set: the findings, and their page written to ``out``. See
    ``imgtrain.data.inspection.inspect_dataset``."""
    from imgtrain.data.inspection import inspect_dataset as _inspect

    return _inspect(data_dir, out, workers, threshold, seed, progress)


def write_report(run, checkpoint: str = "best", storage: str = "./runs"):
    """Plots and a self-contained HTML page in the run's report/ folder. See ``imgtrain.inference.report``."""
    from imgtrain.inference.report import write_report as _write_report

    return _write_report(run, checkpoint=checkpoint, storage=storage)


def export(run, format: str, out, checkpoint: str = "best", storage: str = "./runs", **options):
    """The checkpoint's model as ONNX, TorchScript or pt2 in the folder ``out``, with its labels,
    preprocessing and model card, verified against PyTorch. See ``imgtrain.inference.export``."""
    from imgtrain.inference.export import export as _export

    return _export(run, format, out, checkpoint=checkpoint, storage=storage, **options)


__all__ = [
    "TrainConfig", "ImgtrainError", "RunResult", "train", "prepare", "inspect_dataset", "PrepareOptions", "load_run",
    "list_runs",
    "EvalResult", "InferenceOptions", "Predictor", "evaluate", "load_model", "predict", "write_report",
    "export",
]
