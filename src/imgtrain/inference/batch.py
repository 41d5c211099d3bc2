"""Batch inference from a checkpoint alone: ``evaluate`` and ``predict`` (``predictor.py`` loads
the model). ``evaluate`` and ``predict`` run the ``Predictor`` on a Ray Data actor pool (``backend="ray"``),
or in this process (``backend="local"``, no Ray) for small inputs and debugging. Their options
(the CLI's too) are declared in ``options.py``.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from imgtrain.errors import ImgtrainError
from imgtrain.inference.inputs import CONVERTED_KEY, ERROR_KEY, ROW_KEY, read_task
from imgtrain.inference.metrics import TOP_K, EvalSums, class_scores
from imgtrain.inference.options import DEFAULT_TOP_K, ON_ERROR, EvaluateOptions, InferenceOptions, PredictOptions
from imgtrain.inference.predictor import Predictor, check_score, check_tta, load_checkpoint, rejection, score_method
from imgtrain.inference.preprocess import LoadedCheckpoint
from imgtrain.ops import process

# evaluate's confusion matrix is the dense K x K list of lists (rows: true class) up to this many
# classes; above, only the pairs that occur (``confusion_json``). A checkpoint's K is its owner's
# choice, up to limits.MAX_CLASSES = 100,000: dense, 80 GB.
DENSE_CONFUSION_MAX_CLASSES = 1_000


# ---------------------------------------------------------------- running it over many images


def predictions(loaded: LoadedCheckpoint, inputs, opts: InferenceOptions, on_error: str = "skip",
                indices: bool = False, threshold: float | None = None, explain: bool = False):
    """Predictions for every row of ``inputs`` (``inputs.list_inputs``), as pandas DataFrames of
    at most a few thousand rows, in input order: the carried columns (path, or id and label),
    pred_* and top-k. Images are read, converted and predicted task by task, never all held:
    here (``backend="local"``) or on Ray Data's tasks and actor pool. Rows that cannot be used
    are left out and reported to ``skipped(name, reason)``; with ``on_error="fail"`` the first
    one raises. ``indices``: top{i}_index columns too (``Predictor``); ``threshold``: the
    out-of-distribution score under which an image is rejected (``predictor.rejection``);
    ``explain``: each row's map and image (``Predictor``)."""
    opts.validate()
    if opts.backend == "local" and opts.use_gpu:
        raise ImgtrainError("--gpu needs the Ray backend (GPU actors); drop --backend local")
    check_tta(opts.tta, loaded.preprocess.preset)
    batches = _local_batches if opts.backend == "local" else _ray_batches
    for frame in batches(loaded, inputs, opts, indices, threshold, explain):
        bad = frame[ERROR_KEY] != ""
        if bad.any():
            first = frame[bad].iloc[0]
            name = first.get("path", f"row {first[ROW_KEY]}")
            if on_error == "fail":
                raise ImgtrainError(f"input {name} {first[ERROR_KEY]}; remove it or pass --on-error skip")
            yield frame[bad]  # the caller lists them
        yield frame[~bad]


def _local_batches(loaded: LoadedCheckpoint, inputs, opts: InferenceOptions, indices: bool, threshold: float | None,
                   explain: bool):
    import pandas as pd

    predictor = Predictor(loaded, top_k=opts.top_k, tta=opts.tta, indices=indices, ood_score=opts.ood_score,
                          threshold=threshold, explain=explain)
    shape, preset = loaded.preprocess.image_shape, loaded.preprocess.preset
    with process.torch_threads(opts.threads):  # this process's setting, put back after
        for task in inputs.tasks:
            rows = read_task({"task": [json.dumps(task)]}, shape, preset)
            for i in range(0, len(rows[ROW_KEY]), opts.batch_size):
                yield pd.DataFrame(predictor({k: v[i:i + opts.batch_size] for k, v in rows.items()}))


def _ray_batches(loaded: LoadedCheckpoint, inputs, opts: InferenceOptions, indices: bool, threshold: float | None,
                 explain: bool):
    """Reading tasks (CPUs) feeding a pool of Predictor actors, order kept, output streamed."""
    import pandas as pd

    from imgtrain import cluster as cluster_mod

    with cluster_mod.ray_session(opts.address, opts.concurrency + 1, cluster_mod.user_log_dir(), "inference.log"):
        import ray.data
        from ray.data import ExecutionResources

        if opts.use_gpu:
            cluster_mod.require_gpus(opts.concurrency, "GPU actor(s)", "drop --gpu or lower --concurrency")
        shape, preset = loaded.preprocess.image_shape, loaded.preprocess.preset
        ds = ray.data.from_items([{"task": json.dumps(t)} for t in inputs.tasks], override_num_blocks=len(inputs.tasks))
        ds = ds.map_batches(read_task, fn_kwargs={"shape": shape, "preset": preset}, batch_size=1, num_cpus=1)
        ds = ds.map_batches(
            Predictor,
            fn_constructor_kwargs=dict(
                checkpoint=str(loaded.path), device="cuda" if opts.use_gpu else "cpu",
                top_k=opts.top_k, threads=0 if opts.use_gpu else opts.threads_per_actor(),
                tta=opts.tta, indices=indices, engine=opts.engine, ood_score=opts.ood_score, threshold=threshold,
                explain=explain,
            ),
            batch_size=opts.batch_size, batch_format="numpy", num_cpus=1, num_gpus=1 if opts.use_gpu else 0,
            compute=ray.data.ActorPoolStrategy(size=opts.concurrency),
        )
        ds.context.execution_options.preserve_order = True  # rows come back in input order
        ds.context.execution_options.resource_limits = ExecutionResources(object_store_memory=256 << 20)
        with warnings.catch_warnings():  # a small input has fewer tasks than actors: no news
            warnings.filterwarnings("ignore", message="The minimum number of concurrent actors")
            for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
                # --explain's maps and images come back as [B, H, W] arrays: one cell per row
                yield pd.DataFrame({k: list(v) if v.ndim > 1 else v for k, v in batch.items()})


# ---------------------------------------------------------------- evaluation


@dataclass
class EvalResult:
    accuracy: float
    num_samples: int
    classes: list[str]
    confusion_matrix: list[list[int]] | dict  # rows: true class, columns: predicted class (confusion_json)
    per_class: dict[str, dict]  # class -> precision, recall, f1, support
    checkpoint: str
    split: str
    data: str
    recorded_val_accuracy: float | None = None  # what training measured for this checkpoint
    recorded_split: str | None = None  # the split it measured it on (val, or test without one)
    top5_accuracy: float | None = None  # None with 5 classes or fewer (n/a)
    macro_avg: dict = field(default_factory=dict)  # precision, recall, f1: metrics.py says how
    weighted_avg: dict = field(default_factory=dict)
    ece: float | None = None  # expected calibration error, metrics.ECE_BINS equal-width bins
    calibration: list = field(default_factory=list)  # per bin: lower, upper, count, confidence, accuracy
    tta: str = "none"
    label_issues: dict | None = None  # --label-issues N: training images to check (label_issues.py)
    nll: float | None = None  # mean negative log-likelihood of the labels, as answered (calibrated)
    # the checkpoint's temperature, the split it was fitted on, ECE and NLL here before (T = 1) and after
    temperature_scaling: dict = field(default_factory=dict)
    ood_score: str = "energy"  # the out-of-distribution score's method (--ood-score)
    ood: dict | None = None  # --ood DIR: AUROC and FPR at 95 % TPR of the score, this split against DIR
    predictions: object = field(default=None, repr=False)  # DataFrame: id, label, pred_*, top-k
    confusion: np.ndarray | None = field(default=None, repr=False)  # confusion_counts: [E, 3]

    def to_json(self) -> dict:
        keys = ("accuracy", "top5_accuracy", "num_samples", "classes", "per_class", "macro_avg", "weighted_avg",
                "ece", "calibration", "confusion_matrix", "checkpoint", "split", "data", "recorded_val_accuracy",
                "recorded_split", "tta", "nll", "temperature_scaling", "ood_score")
        out = {k: getattr(self, k) for k in keys}
        if self.label_issues is not None:
            out["label_issues"] = self.label_issues
        if self.ood is not None:
            out["ood"] = self.ood
        return out

    def calibration_line(self) -> str:
        """One line: the temperature, and ECE and NLL on this split before and after it."""
        t = self.temperature_scaling
        if t.get("temperature") is None:
            return f"no temperature scaling: {t.get('why', 'none stored')} (ECE {self.ece:.4f}, NLL {_fig(self.nll)})"
        before, after = t["ece"], t["nll"]
        return (f"temperature scaling T = {t['temperature']:.4f} (fitted on {t['fitted_on'] or 'another'} split): "
                f"{self.split} ECE {_fig(before['before'])} -> {_fig(before['after'])}, "
                f"NLL {_fig(after['before'])} -> {_fig(after['after'])}")

    def ood_line(self) -> str:
        o, inside, outside = self.ood, self.ood["in_distribution"], self.ood["out_of_distribution"]
        return (f"out-of-distribution ({o['method']} score): {inside['split']} split ({inside['images']:,} images) "
                f"against {outside['images']:,} images of {outside['folder']}: AUROC {o['auroc']:.4f}, "
                f"FPR at 95% TPR {o['fpr_at_95_tpr']:.4f}")


def _fig(value) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def confusion_counts(labels: np.ndarray, preds: np.ndarray, num_classes: int) -> np.ndarray:
    """int64 [E, 3]: (true class, predicted class, count) of each pair that occurs, sorted by true
    then predicted class. Memory follows the samples, never K x K."""
    codes = np.asarray(labels, np.int64) * num_classes + np.asarray(preds, np.int64)  # < K^2 = 10^10
    pairs, counts = np.unique(codes, return_counts=True)
    return np.stack([pairs // num_classes, pairs % num_classes, counts], axis=1)


def confusion_json(counts: np.ndarray, num_classes: int) -> list[list[int]] | dict:
    """``evaluate --json``'s ``confusion_matrix``: the dense [K, K] list of lists (rows: true class)
    up to DENSE_CONFUSION_MAX_CLASSES classes; above, ``{"shape": [K, K], "entries": [[true,
    predicted, count], ...]}`` listing only the pairs that occur, every other cell being 0."""
    if num_classes <= DENSE_CONFUSION_MAX_CLASSES:
        return dense_confusion(counts, num_classes).tolist()
    return {"shape": [num_classes, num_classes], "entries": counts.tolist()}


def dense_confusion(counts: np.ndarray, num_classes: int) -> np.ndarray:
    """int64 [K, K] of ``confusion_counts``; for a K known to be small."""
    cm = np.zeros((num_classes, num_classes), np.int64)
    cm[counts[:, 0], counts[:, 1]] = counts[:, 2]
    return cm


def per_class_scores(counts: np.ndarray, classes) -> dict[str, dict]:
    """Precision, recall and F1 per class from ``confusion_counts`` (0 where undefined)."""
    k, (true, pred, n) = len(classes), counts.T
    hit = true == pred
    tp, predicted, actual = (np.bincount(c, w, minlength=k) for c, w in ((true[hit], n[hit]), (pred, n), (true, n)))
    return per_class_json(class_scores(tp, predicted - tp, actual - tp), classes)


def per_class_json(scores, classes) -> dict[str, dict]:
    """``evaluate --json``'s ``per_class`` from ``metrics.class_scores``."""
    precision, recall, f1, support = scores
    return {
        str(c): {"precision": float(precision[i]), "recall": float(recall[i]), "f1": float(f1[i]),
                 "support": int(support[i])}
        for i, c in enumerate(classes)
    }


def evaluate(
    run, checkpoint: str = EvaluateOptions.checkpoint, storage: str = EvaluateOptions.storage,
    split: str = EvaluateOptions.split, data: str | None = EvaluateOptions.data, options: InferenceOptions | None = None,
    label_issues: int = EvaluateOptions.label_issues, ood: str | None = EvaluateOptions.ood,
) -> EvalResult:  # a multi-label checkpoint's: multilabel_eval.MultiLabelEvalResult
    """Accuracy, top-5 accuracy, per-class and averaged scores, calibration and confusion matrix
    of a checkpoint on a prepared split (``metrics.py`` defines them); the temperature scaling's
    ECE and NLL before and after; with ``ood`` (a folder of images of none of the classes) the
    AUROC and FPR at 95 % TPR of the out-of-distribution score, the split against the folder."""
    from imgtrain.data.format import eval_split, verify_dataset
    from imgtrain.inference.inputs import list_inputs
    from imgtrain.data.staging import local_data

    opts = options or InferenceOptions()
    # an ONNX Runtime session takes its threads when it is made: the local backend's, here
    loaded = load_checkpoint(run, checkpoint, storage, engine=opts.engine, threads=opts.threads)
    data_dir = data or (loaded.meta.get("config") or {}).get("data")
    if not data_dir:
        raise ImgtrainError(f"checkpoint {loaded.path} does not say which data set it was trained on; pass --data")
    data_dir = local_data(data_dir)  # one in an object store: copied to this machine first
    manifest = verify_dataset(data_dir)
    check_compatible(loaded, manifest, data_dir)
    if split not in manifest["splits"]:
        raise ImgtrainError(f"data set {data_dir} has no split {split!r}; it has {', '.join(manifest['splits'])}")
    if manifest["splits"][split]["num_samples"] == 0:
        raise ImgtrainError(f"split {split!r} of {data_dir} is empty; nothing to evaluate")
    from imgtrain.inference import multilabel_eval

    multilabel_eval.check_kind(loaded, manifest, data_dir)
    if ood and multilabel_eval.is_multi_label(manifest):
        raise ImgtrainError("--ood scores a single-label model's images (their energy, largest logit or softmax); "
                            "this model is multi-label: drop --ood")
    if ood and not Path(ood).expanduser().is_dir():
        raise ImgtrainError(f"--ood {ood} is not a folder of images")
    if multilabel_eval.is_multi_label(manifest):  # one sigmoid per label: figures of its own
        return multilabel_eval.evaluate_multi_label(loaded, data_dir, manifest, split, opts, label_issues, not data)
    method = score_method(opts.engine, opts.ood_score, loaded.meta)
    check_score(loaded.path, loaded.meta, method)  # before any image is run
    classes = list(loaded.preprocess.classes)
    # The predictor ranks TOP_K classes for top-5 accuracy, by index; the rows kept show opts.top_k.
    ranked = min(max(opts.top_k, TOP_K), len(classes))
    index_columns = [f"top{i}_index" for i in range(1, ranked + 1)]
    unasked = [f"top{i}_{what}" for i in range(opts.top_k + 1, ranked + 1) for what in ("class", "prob")]
    sums, plain, parts, nll = EvalSums(len(classes)), EvalSums(len(classes)), [], np.zeros(2)
    likelihood = ["nll", "uncalibrated_nll", "uncalibrated_confidence", "uncalibrated_pred_index"]
    scoring = replace(opts, top_k=ranked)
    for frame in predictions(loaded, list_inputs(str(data_dir), split), scoring, on_error="fail", indices=True):
        labels = frame["label"].to_numpy()
        sums.add(labels, frame[index_columns].to_numpy(), frame["confidence"].to_numpy())
        nll[0] += frame["nll"].sum()
        if "uncalibrated_nll" in frame:  # the logits were at hand (not an export's engine)
            plain.add(labels, frame["uncalibrated_pred_index"].to_numpy(), frame["uncalibrated_confidence"].to_numpy())
            nll[1] += frame["uncalibrated_nll"].sum()
        # one small row per image (no pixels): what the report shows and the caller may inspect
        parts.append(frame.drop(columns=[ERROR_KEY, CONVERTED_KEY, ROW_KEY, *index_columns, *unasked, *likelihood],
                                errors="ignore"))
    import pandas as pd

    rows = pd.concat(parts, ignore_index=True)
    counts = confusion_counts(rows["label"].to_numpy(), rows["pred_index"].to_numpy(), len(classes))
    averages = sums.averages()
    recorded = None if data else loaded.recorded_val_accuracy  # another data set's split is not the one recorded
    return EvalResult(
        accuracy=sums.accuracy, num_samples=sums.n, classes=classes,
        confusion_matrix=confusion_json(counts, len(classes)),
        per_class=per_class_json(sums.class_scores(), classes),
        checkpoint=str(loaded.path), split=split, data=str(Path(data_dir).resolve()),
        # whatever split is evaluated now: the figure training chose this checkpoint by, and on which split
        recorded_val_accuracy=recorded,
        recorded_split=None if recorded is None else loaded.recorded_split or eval_split(manifest),
        top5_accuracy=sums.top5_accuracy, macro_avg=averages["macro"], weighted_avg=averages["weighted"],
        ece=sums.ece, calibration=sums.calibration(), tta=opts.tta,
        label_issues=_label_issues(loaded, data_dir, manifest, label_issues),
        nll=float(nll[0] / max(sums.n, 1)),
        temperature_scaling=_temperature_scaling(loaded, sums, plain, nll),
        ood_score=method,
        ood=_ood_figures(loaded, ood, opts, rows, split) if ood else None,
        predictions=rows, confusion=counts,
    )


def _temperature_scaling(loaded: LoadedCheckpoint, sums: EvalSums, plain: EvalSums, nll: np.ndarray) -> dict:
    """``evaluate --json``'s ``temperature_scaling``: the checkpoint's temperature and the split's
    ECE and NLL before (T = 1) and after it; before is n/a for an export without its logits output
    (T is inside its graph)."""
    from imgtrain.inference.calibration_record import calibration_of

    calibration = calibration_of(loaded)
    if calibration is None:
        return {"temperature": None, "why": "this checkpoint has none (its data set has no val split, or it was "
                                            "never calibrated: imgtrain calibrate RUN)"}
    before = plain.n > 0
    n = max(sums.n, 1)
    return {"temperature": calibration.temperature, "fitted_on": calibration.fitted_on,
            "ece": {"before": plain.ece if before else None, "after": sums.ece},
            "nll": {"before": float(nll[1] / n) if before else None, "after": float(nll[0] / n)}}


def _ood_figures(loaded: LoadedCheckpoint, folder: str, opts: InferenceOptions, rows, split: str) -> dict:
    """AUROC and FPR at 95 % TPR of the out-of-distribution score: the split's images (positive,
    their scores in ``rows``) against every readable image of ``folder``."""
    from imgtrain.inference import ood
    from imgtrain.inference.inputs import list_inputs

    method = score_method(opts.engine, opts.ood_score, loaded.meta)
    inside = rows[ood.column(method)].to_numpy()
    outside = [frame[ood.column(method)].to_numpy()
               for frame in predictions(loaded, list_inputs(folder), opts, on_error="skip")
               if not (frame[ERROR_KEY] != "").any()]
    outside = np.concatenate(outside) if outside else np.zeros(0)
    if not len(outside):
        raise ImgtrainError(f"--ood {folder} holds no readable PNG/JPEG image")
    return {"method": method, "auroc": ood.auroc(inside, outside), "fpr_at_95_tpr": ood.fpr_at_tpr(inside, outside),
            "threshold_at_95_tpr": ood.keep_threshold(inside),
            "in_distribution": {"split": split, "images": int(len(inside))},
            "out_of_distribution": {"folder": str(Path(folder).resolve()), "images": int(len(outside))}}


def _label_issues(loaded: LoadedCheckpoint, data_dir, manifest: dict, top: int) -> dict | None:
    if top <= 0:
        return None
    if "train" not in manifest["splits"]:
        raise ImgtrainError(f"--label-issues looks at the training split, and {data_dir} has none")
    from imgtrain.inference.label_issues import find_label_issues

    return find_label_issues(loaded, data_dir, "train", top=top)


def check_compatible(loaded: LoadedCheckpoint, manifest: dict, data_dir) -> None:
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
    rejected: int = 0  # --reject: images answered unknown
    threshold: float | None = None  # --reject's threshold on the score
    ood_score: str = "energy"  # the score's method, its column ood_<method>

    @property
    def predictions(self):
        """The written predictions, read back (they were never all held while predicting)."""
        import pandas as pd

        return pd.read_csv(self.out) if self.out.suffix.lower() == ".csv" else pd.read_parquet(self.out)


def predict(
    run, input: str, out, checkpoint: str = PredictOptions.checkpoint, storage: str = PredictOptions.storage,
    on_error: str = PredictOptions.on_error, split: str = PredictOptions.split,
    image_column: str = PredictOptions.image_column, options: InferenceOptions | None = None,
    overwrite: bool = PredictOptions.overwrite, reject: str | None = PredictOptions.reject,
    explain: str | None = PredictOptions.explain,
) -> PredictResult:
    """Predict every image of ``input`` (see ``imgtrain.inference.inputs``) and write ``out``
    (.parquet/.csv) batch by batch: memory stays bounded however many images there are.
    ``reject``: ``auto`` or a threshold on the out-of-distribution score (``predictor.rejection``);
    an image under it is answered ``unknown``. ``explain``: a folder for each image's map and
    overlay (``explain.write_explanations``); the table names each image's overlay in its
    ``explanation`` column."""
    from imgtrain.inference.inputs import (
        TableWriter,
        check_output,
        list_inputs,
    )

    opts = options or InferenceOptions()
    opts.validate()
    if on_error not in ON_ERROR:
        raise ImgtrainError(f"--on-error must be skip or fail, got {on_error!r}")
    out = check_output(out, overwrite)  # before any work, not after it
    if explain is not None:
        from imgtrain.inference.explain import NEEDS_CHECKPOINT, check_explain_dir, write_explanations

        if opts.engine != "torch":
            raise ImgtrainError(f"--explain: {NEEDS_CHECKPOINT}")
        explain_dir = check_explain_dir(explain, overwrite)
    # an ONNX Runtime session takes its threads when it is made: the local backend's, here
    loaded = load_checkpoint(run, checkpoint, storage, engine=opts.engine, threads=opts.threads)
    _check_multi_label_options(loaded, opts)
    method = score_method(opts.engine, opts.ood_score, loaded.meta)
    check_score(loaded.path, loaded.meta, method)  # before any image is run
    threshold = rejection(loaded.path, loaded.meta, method, reject)
    inputs = list_inputs(input, split=split, image_column=image_column)
    writer, skipped, converted, rejected = TableWriter(out), [], 0, 0
    try:
        for frame in predictions(loaded, inputs, opts, on_error, threshold=threshold, explain=explain is not None):
            if (frame[ERROR_KEY] != "").any():
                names = frame["path"] if "path" in frame else frame[ROW_KEY].map(lambda r: f"row {r}")
                skipped += list(zip(names, frame[ERROR_KEY]))
                continue
            converted += int(frame[CONVERTED_KEY].sum())
            rejected += int(frame["rejected"].sum()) if "rejected" in frame else 0
            if len(frame) and explain is not None:
                p = loaded.preprocess
                names = write_explanations(frame, explain_dir, p.image_shape, p.preset)
                frame = frame.drop(columns=["explain_map", "image"]).assign(explanation=names)
            if len(frame):
                writer.write(frame.drop(columns=[ERROR_KEY, CONVERTED_KEY, ROW_KEY]))
        if writer.rows == 0:
            raise ImgtrainError(f"no images to predict in {input}" + (
                f": none of the {len(skipped)} file(s) is a readable PNG/JPEG image (first: {skipped[0][0]}: "
                f"{skipped[0][1]})" if skipped else ""))
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    return PredictResult(out=out, num_predictions=writer.rows, converted=converted,
                         image_shape_text="x".join(map(str, loaded.preprocess.image_shape)), skipped=skipped,
                         rejected=rejected, threshold=threshold, ood_score=method)


def _check_multi_label_options(loaded: LoadedCheckpoint, opts: InferenceOptions) -> None:
    """--top-k ranks the classes of a single-label model; a multi-label one answers with every class."""
    from imgtrain.inference.multilabel_answers import is_multi_label_model

    if is_multi_label_model(loaded) and opts.top_k != DEFAULT_TOP_K:
        raise ImgtrainError("--top-k lists a single-label model's most probable classes; this model is multi-label: "
                            "its predictions hold the labels over their thresholds (labels) and every class's "
                            "probability (prob_<class>): drop --top-k")
