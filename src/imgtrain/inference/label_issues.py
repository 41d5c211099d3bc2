"""Training images whose label deserves a second look: the ones the trained model most
confidently disagrees with, in the spirit of confident learning (Northcutt et al., 2021).

The rule, in one pass over (up to ``scan`` of) the split, with the evaluation transform:

* each class c gets a threshold t_c, the mean probability the model gives class c on the images
  labelled c (its "self-confidence" on them);
* an image labelled y and predicted j != y is a candidate when p_j >= t_j: the model is as sure
  it is a j as it is, on average, of the images really labelled j (confident learning's
  off-diagonal of the confident joint);
* candidates rank by the normalised self-confidence p_y / t_y, lowest first: a label the model
  finds far less likely than it usually finds that class.

Memory: per class, the sums for t_c, and five numbers per misclassified image scanned (at most
``scan`` of them), never the probabilities of every image.

Caveat, said on the report page too: the model was trained on these very labels, so it may have
learnt a wrong one (confident learning proper uses out-of-sample probabilities from
cross-validation, which would cost k trainings). Found mislabels are therefore a lower bound.
"""

from __future__ import annotations

import numpy as np

SCAN = 50_000  # training images scanned by default: the first in file order (a seeded random sample)
SHOWN = 16


def find_label_issues(loaded, data_dir, split: str = "train", top: int = SHOWN, scan: int = SCAN,
                      batch: int = 500) -> dict:
    """``{"rule", "split", "scanned", "of", "issues": [{id, label, predicted, label_prob,
    predicted_prob, score}]}``, the ``top`` most suspect images first."""
    from imgtrain.data import stream
    from imgtrain.data.format import load_manifest
    from imgtrain.inference.predictor import Predictor

    manifest = load_manifest(data_dir)
    k = len(loaded.preprocess.classes)
    predictor = Predictor(loaded)
    sums, counts = np.zeros(k), np.zeros(k)
    wrong = []  # per batch: (id, given label, predicted, p_given, p_predicted) of the misclassified
    scanned = 0
    for part in stream.split_batches(data_dir, manifest, split, loaded.preprocess.preset, batch, scan):
        probs = predictor.predict_proba(part["image"])
        labels = np.asarray(part["label"], np.int64)
        given = probs[np.arange(len(labels)), labels]
        sums += np.bincount(labels, given, minlength=k)
        counts += np.bincount(labels, minlength=k)
        predicted = probs.argmax(1)
        i = np.flatnonzero(predicted != labels)
        wrong.append((np.asarray(part["id"])[i], labels[i], predicted[i], given[i], probs[i, predicted[i]]))
        scanned += len(labels)
    threshold = np.divide(sums, counts, out=np.ones(k), where=counts > 0)
    empty = [np.zeros(0, np.int64)] * 3 + [np.zeros(0)] * 2
    ids, labels, predicted, given, chosen = [np.concatenate(c) for c in zip(*wrong)] if wrong else empty
    confident = chosen >= threshold[predicted]
    score = given / threshold[labels]
    order = [i for i in np.lexsort((ids, score)) if confident[i]][:top]
    issues = [{"id": int(ids[i]), "label": int(labels[i]), "predicted": int(predicted[i]),
               "label_prob": float(given[i]), "predicted_prob": float(chosen[i]), "score": float(score[i])}
              for i in order]
    return {"rule": "confident learning's off-diagonal (p_predicted >= that class's mean self-confidence), "
                    "ranked by the given label's probability over its class's mean self-confidence",
            "split": split, "scanned": scanned, "of": manifest["splits"][split]["num_samples"],
            "issues": issues}


def issue_rows(found: dict, classes) -> "object":
    """The issues as the report's image grid takes its rows (label, pred_index, pred_class, confidence)."""
    import pandas as pd

    return pd.DataFrame({"id": [x["id"] for x in found["issues"]], "label": [x["label"] for x in found["issues"]],
                         "pred_index": [x["predicted"] for x in found["issues"]],
                         "pred_class": [classes[x["predicted"]] for x in found["issues"]],
                         "confidence": [x["predicted_prob"] for x in found["issues"]]})

