"""``evaluate`` of a multi-label checkpoint (issue 48): one sigmoid per class, decided at the
checkpoint's per-label thresholds (``thresholds.pt``, chosen on the val split in training;
0.5 each where it has none), scored by ``multilabel_metrics.py``: mAP, micro and macro F1,
exact-match ratio, Hamming loss, and per label precision, recall, F1, AP and threshold.

Run in this process, row group by row group through the streamed reader's evaluation
transform (``data/stream.py``). The split's probabilities are kept, float32 [n, classes]: average
precision ranks every score of a label (40 MB for 10,000 images of 1,000 labels).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from imgtrain.data.format import eval_split, is_multi_label
from imgtrain.errors import ImgtrainError
from imgtrain.inference import multilabel_metrics as mm
from imgtrain.inference.options import InferenceOptions
from imgtrain.inference.preprocess import LoadedCheckpoint
from imgtrain.ops import process
from imgtrain.storage import checkpoint as ckpt


@dataclass
class MultiLabelEvalResult:
    num_samples: int
    classes: list[str]
    map: float  # macro average precision over the labels with a positive sample in the split
    f1_micro: float
    f1_macro: float
    exact_match: float
    hamming_loss: float
    per_label: dict[str, dict]  # class -> precision, recall, f1, ap (None: no positive), threshold, support
    thresholds_chosen_on: str | None  # "val", or None: 0.5 each
    checkpoint: str
    split: str
    data: str
    recorded_val_map: float | None = None  # what training measured for this checkpoint
    recorded_split: str | None = None
    tta: str = "none"
    multi_label: bool = True
    ids: np.ndarray | None = field(default=None, repr=False)  # int64 [n]
    scores: np.ndarray | None = field(default=None, repr=False)  # float32 [n, classes]: the probabilities
    targets: np.ndarray | None = field(default=None, repr=False)  # uint8 [n, classes]
    thresholds: np.ndarray | None = field(default=None, repr=False)  # float32 [classes]

    def to_json(self) -> dict:
        keys = ("multi_label", "map", "f1_micro", "f1_macro", "exact_match", "hamming_loss", "num_samples", "classes",
                "per_label", "thresholds_chosen_on", "checkpoint", "split", "data", "recorded_val_map",
                "recorded_split", "tta")
        return {k: getattr(self, k) for k in keys}

    def wrong_labels(self) -> np.ndarray:
        """int [n]: each image's wrongly decided labels (missed and extra)."""
        return ((self.scores >= self.thresholds) != self.targets.astype(bool)).sum(1)

    def confident_wrong_labels(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The ``n`` most confident wrong label decisions, the surest first: (image rows, label
        indices, how sure: an extra label's probability, a missed label's 1 - probability)."""
        return confident_wrong_labels(self.scores, self.targets, self.thresholds, n)


def confident_wrong_labels(scores, targets, thresholds, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``MultiLabelEvalResult.confident_wrong_labels`` of probabilities ``scores`` [images, classes],
    0/1 ``targets`` and the per-label ``thresholds``; ties in image, then label order."""
    scores = np.asarray(scores, np.float64)
    said, true = scores >= np.asarray(thresholds), np.asarray(targets).astype(bool)
    rows, labels = np.nonzero(said != true)
    sure = np.where(said[rows, labels], scores[rows, labels], 1.0 - scores[rows, labels])
    order = np.argsort(-sure, kind="stable")[:n]
    return rows[order], labels[order], sure[order]


def check_kind(loaded: LoadedCheckpoint, manifest: dict, data_dir) -> None:
    """A single-label model is not evaluated on a multi-label set, nor the other way round."""
    trained_on = loaded.meta.get("data") if isinstance(loaded.meta.get("data"), dict) else {}
    if is_multi_label(trained_on) != is_multi_label(manifest):
        kinds = ("multi-label", "single-label")
        raise ImgtrainError(f"checkpoint {loaded.path} is a {kinds[not is_multi_label(trained_on)]} model and "
                            f"{data_dir} a {kinds[not is_multi_label(manifest)]} data set; evaluate on the kind "
                            "of data set it was trained for")


def evaluate_multi_label(loaded: LoadedCheckpoint, data_dir, manifest: dict, split: str, opts: InferenceOptions,
                         label_issues: int = 0, same_data: bool = True) -> MultiLabelEvalResult:
    if label_issues:
        raise ImgtrainError("--label-issues looks for images whose one label the model disputes; this is a "
                            "multi-label data set: drop --label-issues (the report lists the images with the most "
                            "wrong labels)")
    if not isinstance(loaded.path, Path) or not (loaded.path / ckpt.META_FILE).is_file():
        raise ImgtrainError("evaluate of a multi-label model runs the checkpoint itself (--engine torch); "
                            "exports are verified when they are made")
    classes = list(loaded.preprocess.classes)
    thresholds, chosen_on = ckpt.load_thresholds(loaded.path, len(classes))
    if thresholds is None:
        thresholds = np.full(len(classes), mm.DEFAULT_THRESHOLD, np.float32)
    ids, scores, targets = probabilities(loaded, data_dir, manifest, split, opts)
    figures = label_figures(scores, targets, thresholds, classes)
    metrics = loaded.meta.get("metrics") if isinstance(loaded.meta.get("metrics"), dict) else {}
    recorded = metrics.get("val_map") if same_data else None
    recorded = float(recorded) if isinstance(recorded, (int, float)) and not isinstance(recorded, bool) else None
    return MultiLabelEvalResult(
        num_samples=len(ids), classes=classes, **figures,
        thresholds_chosen_on=chosen_on, checkpoint=str(loaded.path), split=split,
        data=str(Path(data_dir).resolve()), recorded_val_map=recorded,
        recorded_split=None if recorded is None else loaded.recorded_split or eval_split(manifest), tta=opts.tta,
        ids=ids, scores=scores, targets=targets, thresholds=thresholds,
    )


def label_figures(scores: np.ndarray, targets: np.ndarray, thresholds: np.ndarray, classes) -> dict:
    """``map``, ``f1_micro``, ``f1_macro``, ``exact_match``, ``hamming_loss`` and ``per_label``
    {class: precision, recall, f1, ap (None: no positive), threshold, support} of a split's
    probabilities decided at ``thresholds`` (what ``evaluate`` reports and an export's card states)."""
    ap = mm.average_precision(scores, targets)
    s = mm.set_scores(scores, targets, thresholds)
    per_label = {
        str(c): {"precision": float(s["precision"][i]), "recall": float(s["recall"][i]), "f1": float(s["f1"][i]),
                 "ap": None if np.isnan(ap[i]) else float(ap[i]), "threshold": float(thresholds[i]),
                 "support": int(s["support"][i])}
        for i, c in enumerate(classes)
    }
    return {"map": mm.mean_average_precision(ap), "f1_micro": s["f1_micro"], "f1_macro": s["f1_macro"],
            "exact_match": s["exact_match"], "hamming_loss": s["hamming_loss"], "per_label": per_label}


def probabilities(loaded: LoadedCheckpoint, data_dir, manifest: dict, split: str, opts: InferenceOptions):
    """(ids int64 [n], probabilities float32 [n, classes], targets uint8 [n, classes]) of a split,
    in file order; with ``--tta flip`` each image's sigmoid averaged with its mirror image's."""
    import torch

    from imgtrain.data import stream

    preprocess, model = loaded.preprocess, loaded.model
    # the data set's shape is the model's (batch.check_compatible); the reader hands out multi-hot labels
    reader = stream.Reader.for_data(data_dir, manifest, preset=preprocess.preset, train=False, augment=False)
    ids, scores, targets = [], [], []
    with process.torch_threads(opts.threads), torch.inference_mode():
        for f, g, rows in stream.blocks(data_dir, manifest, split):
            part = stream.read_task({"file": f, "group": g, "first": 0, "count": rows}, reader)
            for i in range(0, len(part["id"]), opts.batch_size):
                x = preprocess(part["image"][i:i + opts.batch_size])
                p = model(x).float().sigmoid()
                if opts.tta == "flip":
                    mirrored = x.flip(-1)
                    if preprocess.channels_last:
                        mirrored = mirrored.contiguous(memory_format=torch.channels_last)
                    p = (p + model(mirrored).float().sigmoid()) / 2
                scores.append(p.numpy())
            ids.append(np.asarray(part["id"], np.int64))
            targets.append(np.asarray(part["label"], np.uint8))
    k = len(preprocess.classes)
    if not ids:
        return np.zeros(0, np.int64), np.zeros((0, k), np.float32), np.zeros((0, k), np.uint8)
    return np.concatenate(ids), np.concatenate(scores), np.concatenate(targets)


def summary_lines(result: MultiLabelEvalResult):
    """What ``evaluate`` prints (without ``--json``): the figures, then a table per label."""
    from rich.table import Table

    on = result.thresholds_chosen_on
    recorded = result.recorded_val_map
    yield (f"{result.split} mAP {result.map:.4f} on {result.num_samples} samples"
           + (f" (recorded in training on the {result.recorded_split} split: {recorded:.4f})" if recorded is not None else "")
           + (" with --tta flip" if result.tta == "flip" else ""))
    yield (f"F1 micro {result.f1_micro:.4f}  macro {result.f1_macro:.4f}  exact match {result.exact_match:.2%}  "
           f"Hamming loss {result.hamming_loss:.4f}  (thresholds: "
           + ("the F1-best per label on the val split)" if on == "val" else "0.5 each: no val split to choose them on)"))
    table = Table("label", "AP", "threshold", "precision", "recall", "f1", "support")
    for name, s in result.per_label.items():
        table.add_row(name, "n/a" if s["ap"] is None else f"{s['ap']:.3f}", f"{s['threshold']:.3f}",
                      f"{s['precision']:.3f}", f"{s['recall']:.3f}", f"{s['f1']:.3f}", str(s["support"]))
    yield table
