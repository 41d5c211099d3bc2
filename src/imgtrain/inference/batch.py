"""Batch inference from a checkpoint alone: ``evaluate`` and ``predict`` (``predictor.py`` loads
the model). ``evaluate`` and ``predict`` run the ``Predictor`` on a Ray Data actor pool (``backend="ray"``),
or in this process (``backend="local"``, no Ray) for small inputs and debugging.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from imgtrain.errors import ImgtrainError
from imgtrain.inference.predictor import (
    DEFAULT_TOP_K,
    LoadedCheckpoint,
    Predictor,
    load_checkpoint,
)
from imgtrain.ops import process

DEFAULT_BATCH_SIZE = 500
ROW_KEY = "_row"  # input position, so outputs come back in input order whatever Ray does


# ---------------------------------------------------------------- running it over many images


@dataclass
class InferenceOptions:
    backend: str = "ray"  # ray: Ray Data actor pool; local: this process, no Ray
    batch_size: int = DEFAULT_BATCH_SIZE
    concurrency: int = 1  # actors (GPU: one GPU each)
    threads: int = 0  # torch threads per actor; 0 = this machine's cores / concurrency
    use_gpu: bool = False
    address: str | None = None  # join this Ray cluster; default: start a private one
    top_k: int = DEFAULT_TOP_K

    def validate(self) -> None:
        problems = []
        if self.backend not in ("ray", "local"):
            problems.append(f"backend must be ray or local, got {self.backend!r}")
        if self.batch_size < 1:
            problems.append(f"batch size must be at least 1, got {self.batch_size}")
        if self.concurrency < 1:
            problems.append(f"concurrency must be at least 1, got {self.concurrency}")
        if self.threads < 0:
            problems.append(f"threads must be 0 (auto) or more, got {self.threads}")
        if self.top_k < 1:
            problems.append(f"top-k must be at least 1, got {self.top_k}")
        if problems:
            raise ImgtrainError("; ".join(problems))

    def threads_per_actor(self) -> int:
        from imgtrain.ops.cluster import threads_for

        return threads_for(self.concurrency, self.threads)


def run_predictor(loaded: LoadedCheckpoint, columns: dict, images: np.ndarray, opts: InferenceOptions):
    """Predictions for ``images`` uint8 [N, H, W, C] as a pandas DataFrame in input order,
    with ``columns`` (id, path, label...: numpy arrays of length N) passed through. The
    local backend uses ``loaded`` as is; Ray actors load the checkpoint from its path."""
    import pandas as pd

    opts.validate()
    columns = {ROW_KEY: np.arange(len(images), dtype=np.int64), **columns}
    if opts.backend == "local":
        if opts.use_gpu:
            raise ImgtrainError("--gpu needs the Ray backend (GPU actors); drop --backend local")
        predictor = Predictor(loaded, top_k=opts.top_k)
        with process.torch_threads(opts.threads):  # this process's setting, put back after
            parts = [
                predictor({**{k: v[i : i + opts.batch_size] for k, v in columns.items()},
                           "image": images[i : i + opts.batch_size]})
                for i in range(0, len(images), opts.batch_size)
            ]
        frame = pd.concat([pd.DataFrame(p) for p in parts], ignore_index=True)
    else:
        frame = _run_on_ray(loaded.path, columns, images, opts)
    return frame.sort_values(ROW_KEY).drop(columns=ROW_KEY).reset_index(drop=True)


def _run_on_ray(checkpoint_dir: Path, columns: dict, images: np.ndarray, opts: InferenceOptions):
    import pandas as pd
    import pyarrow as pa

    from imgtrain.ops import cluster as cluster_mod

    with cluster_mod.ray_session(opts.address, opts.concurrency, cluster_mod.user_log_dir(), "inference.log"):
        import ray
        import ray.data
        from ray.data.extensions import ArrowTensorArray

        if opts.use_gpu:
            cluster_mod.require_gpus(opts.concurrency, "GPU actor(s)", "drop --gpu or lower --concurrency")
        table = pa.table({**{k: pa.array(v) for k, v in columns.items()},
                          "image": ArrowTensorArray.from_numpy(images)})
        # Several blocks so that every actor of the pool gets work. from_blocks computes
        # block metadata here; from_arrow would start one remote task per block for it.
        n_blocks = max(1, min(len(images) // opts.batch_size, 4 * opts.concurrency))
        step = -(-len(images) // n_blocks)
        blocks = [table.slice(i, step) for i in range(0, len(images), step)]
        ds = ray.data.from_blocks(blocks).map_batches(
            Predictor,
            fn_constructor_kwargs=dict(
                checkpoint=str(checkpoint_dir), device="cuda" if opts.use_gpu else "cpu",
                top_k=opts.top_k, threads=0 if opts.use_gpu else opts.threads_per_actor(),
            ),
            batch_size=opts.batch_size, batch_format="numpy", num_cpus=1,
            num_gpus=1 if opts.use_gpu else 0,
            compute=ray.data.ActorPoolStrategy(size=opts.concurrency),
        )
        return pd.concat(
            [pd.DataFrame(b) for b in ds.iter_batches(batch_size=None, batch_format="numpy")],
            ignore_index=True,
        )


# ---------------------------------------------------------------- evaluation


@dataclass
class EvalResult:
    accuracy: float
    num_samples: int
    classes: list[str]
    confusion_matrix: list[list[int]]  # rows: true class, columns: predicted class
    per_class: dict[str, dict]  # class -> precision, recall, f1, support
    checkpoint: str
    split: str
    data: str
    recorded_val_accuracy: float | None = None  # what training measured for this checkpoint
    predictions: object = field(default=None, repr=False)  # DataFrame: id, label, pred_*, top-k

    def to_json(self) -> dict:
        keys = ("accuracy", "num_samples", "classes", "per_class", "confusion_matrix", "checkpoint",
                "split", "data", "recorded_val_accuracy")
        return {k: getattr(self, k) for k in keys}


def confusion_matrix(labels: np.ndarray, preds: np.ndarray, num_classes: int) -> np.ndarray:
    """int64 [K, K], rows = true class, columns = predicted class."""
    return np.bincount(labels * num_classes + preds, minlength=num_classes * num_classes).reshape(
        num_classes, num_classes
    )


def per_class_scores(cm: np.ndarray, classes) -> dict[str, dict]:
    """Precision, recall and F1 per class from a confusion matrix (0 where undefined)."""
    tp = np.diag(cm).astype(float)
    predicted, actual = cm.sum(0).astype(float), cm.sum(1).astype(float)
    precision = np.divide(tp, predicted, out=np.zeros_like(tp), where=predicted > 0)
    recall = np.divide(tp, actual, out=np.zeros_like(tp), where=actual > 0)
    denom = precision + recall
    f1 = np.divide(2 * precision * recall, denom, out=np.zeros_like(tp), where=denom > 0)
    return {
        str(c): {"precision": float(precision[i]), "recall": float(recall[i]), "f1": float(f1[i]),
                 "support": int(actual[i])}
        for i, c in enumerate(classes)
    }


def evaluate(
    run, checkpoint: str = "best", storage: str = "./runs", split: str = "test",
    data: str | None = None, options: InferenceOptions | None = None,
) -> EvalResult:
    """Accuracy, per-class scores and confusion matrix of a checkpoint on a prepared split."""
    from imgtrain.data.format import read_split, verify_dataset

    opts = options or InferenceOptions()
    loaded = load_checkpoint(run, checkpoint, storage)
    data_dir = data or (loaded.meta.get("config") or {}).get("data")
    if not data_dir:
        raise ImgtrainError(f"checkpoint {loaded.path} does not say which data set it was trained on; pass --data")
    manifest = verify_dataset(data_dir)
    _check_compatible(loaded, manifest, data_dir)
    if split not in manifest["splits"]:
        raise ImgtrainError(f"data set {data_dir} has no split {split!r}; it has {', '.join(manifest['splits'])}")
    ids, images, labels = read_split(data_dir, split)
    if len(ids) == 0:
        raise ImgtrainError(f"split {split!r} of {data_dir} is empty; nothing to evaluate")
    frame = run_predictor(loaded, {"id": ids, "label": labels}, images, opts)
    k = len(loaded.preprocess.classes)
    cm = confusion_matrix(frame["label"].to_numpy(), frame["pred_index"].to_numpy(), k)
    return EvalResult(
        accuracy=float(np.trace(cm) / cm.sum()), num_samples=int(cm.sum()),
        classes=list(loaded.preprocess.classes), confusion_matrix=cm.tolist(),
        per_class=per_class_scores(cm, loaded.preprocess.classes), checkpoint=str(loaded.path),
        split=split, data=str(Path(data_dir).resolve()),
        recorded_val_accuracy=loaded.recorded_val_accuracy if split == "test" and not data else None,
        predictions=frame,
    )


def _check_compatible(loaded: LoadedCheckpoint, manifest: dict, data_dir) -> None:
    p = loaded.preprocess
    if manifest["num_classes"] != len(p.classes):
        raise ImgtrainError(
            f"data set {data_dir} has {manifest['num_classes']} classes but checkpoint {loaded.path} "
            f"predicts {len(p.classes)}; evaluate on the data set it was trained for"
        )
    if tuple(manifest["image_shape"]) != p.image_shape:
        raise ImgtrainError(
            f"data set {data_dir} holds {manifest['image_shape']} images but checkpoint {loaded.path} "
            f"takes {list(p.image_shape)} (H, W, C)"
        )


# ---------------------------------------------------------------- prediction


@dataclass
class PredictResult:
    out: Path
    num_predictions: int
    converted: int  # inputs converted to the model's size or colour mode
    image_shape_text: str  # e.g. "28x28x1"
    skipped: list[tuple[str, str]]  # (path, reason) of image files that could not be read
    predictions: object = field(default=None, repr=False)  # the DataFrame written


def predict(
    run, input: str, out, checkpoint: str = "best", storage: str = "./runs", on_error: str = "skip",
    split: str = "test", image_column: str = "image", options: InferenceOptions | None = None,
    overwrite: bool = False,
) -> PredictResult:
    """Predict every image of ``input`` (see ``imgtrain.inference.inputs``) and write ``out`` (.parquet/.csv)."""
    from imgtrain.inference.inputs import check_output, read_inputs, write_table

    opts = options or InferenceOptions()
    opts.validate()
    out = check_output(out, overwrite)  # before any work, not after it
    loaded = load_checkpoint(run, checkpoint, storage)
    shape = loaded.preprocess.image_shape
    inputs = read_inputs(input, shape, on_error=on_error, split=split, image_column=image_column)
    frame = run_predictor(loaded, inputs.columns, inputs.images, opts)
    write_table(frame, out)
    return PredictResult(out=out, num_predictions=len(frame), converted=inputs.converted,
                         image_shape_text="x".join(map(str, shape)), skipped=inputs.skipped,
                         predictions=frame)
