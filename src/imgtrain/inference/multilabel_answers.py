"""What a multi-label model answers (issue 48), the same in ``predict``, ``serve`` and an export:
each class's own probability (a sigmoid, not a softmax), and the label set, the classes whose
probability is at least their threshold. The thresholds are the checkpoint's (``thresholds.pt``,
the F1-best per label on the val split; 0.5 each where it has none) or, for an export folder,
the copy its ``imgtrain.json`` keeps.

    predict: ``labels`` (the set's class names in class order, joined by the data set's
             ``--label-sep``, a space by default; "" for none) and ``prob_<class>`` per class
    serve:   {"labels": [{"label", "probability"}, ...] (most probable first),
              "probabilities": {class: probability}}
"""

from __future__ import annotations

import numpy as np

from imgtrain.data.format import is_multi_label, label_separator
from imgtrain.errors import ImgtrainError
from imgtrain.inference.multilabel_metrics import DEFAULT_THRESHOLD
from imgtrain.inference.preprocess import LoadedCheckpoint

PROB_PREFIX = "prob_"
EXPORT_THRESHOLDS = "thresholds"  # imgtrain.json's copy: a list, in labels.json's order
EXPORT_CHOSEN_ON = "thresholds_chosen_on"


def trained_on(meta: dict) -> dict:
    """The data set summary a checkpoint's meta.json (or an export's record) keeps; {} if none."""
    data = meta.get("data") if isinstance(meta, dict) else None
    return data if isinstance(data, dict) else {}


def is_multi_label_model(loaded: LoadedCheckpoint) -> bool:
    return is_multi_label(trained_on(loaded.meta))


def thresholds_of(loaded: LoadedCheckpoint) -> tuple[np.ndarray, str | None]:
    """float32 [classes] decision thresholds and the split they were chosen on (None: 0.5 each)."""
    from imgtrain.inference.export_record import is_export
    from imgtrain.storage import checkpoint as ckpt

    k = len(loaded.preprocess.classes)
    if is_export(loaded.path):
        return export_thresholds(loaded.meta, k, loaded.path)
    values, chosen_on = ckpt.load_thresholds(loaded.path, k)
    if values is None:  # a checkpoint never validated (taken inside an epoch)
        return np.full(k, DEFAULT_THRESHOLD, np.float32), None
    return values, chosen_on


def export_thresholds(record: dict, k: int, folder) -> tuple[np.ndarray, str | None]:
    """An export record's thresholds, held to what they can be (the record is untrusted)."""
    values = record.get(EXPORT_THRESHOLDS)
    ok = (isinstance(values, list) and len(values) == k
          and all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1 for v in values))
    if not ok:
        raise ImgtrainError(f"export {folder}: imgtrain.json does not hold {k} thresholds between 0 and 1 for its "
                            "multi-label model; export the model again")
    chosen_on = record.get(EXPORT_CHOSEN_ON)
    return np.asarray(values, np.float32), chosen_on if chosen_on == "val" else None


def decide(probs: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """bool [B, classes]: each class in the image's label set, probability >= its threshold (as
    ``multilabel_metrics`` decides them)."""
    return np.asarray(probs) >= np.asarray(thresholds, np.float64)


def probability_columns(classes) -> list[str]:
    """``prob_<class>`` per class; a name seen before gets its index too, so no column is lost."""
    names, seen = [], set()
    for i, c in enumerate(classes):
        name = f"{PROB_PREFIX}{c}"
        if name in seen:
            name = f"{name}_{i}"
        seen.add(name)
        names.append(name)
    return names


def joined(chosen: np.ndarray, classes, sep: str) -> np.ndarray:
    """str [B]: each row's chosen classes (bool or 0/1 [B, classes]) by name, joined by ``sep``."""
    names = np.asarray(classes, dtype=object)
    return np.asarray([sep.join(names[np.flatnonzero(row)]) for row in np.asarray(chosen).astype(bool)], dtype=object)


def prediction_columns(probs: np.ndarray, thresholds: np.ndarray, classes, sep: str) -> dict:
    """``predict``'s columns of a multi-label model: ``labels``, then ``prob_<class>`` per class."""
    out = {"labels": joined(decide(probs, thresholds), classes, sep).astype(str)}
    out.update({name: probs[:, i] for i, name in enumerate(probability_columns(classes))})
    return out


def answer(probs: np.ndarray, thresholds: np.ndarray, classes) -> dict:
    """``serve``'s answer for one image (probabilities [classes])."""
    chosen = np.flatnonzero(decide(probs, thresholds))
    chosen = chosen[np.argsort(-probs[chosen], kind="stable")]
    return {"labels": [{"label": classes[i], "probability": float(probs[i])} for i in chosen],
            "probabilities": {c: float(v) for c, v in zip(classes, probs)}}


def separator_of(loaded: LoadedCheckpoint) -> str:
    return label_separator(trained_on(loaded.meta))
