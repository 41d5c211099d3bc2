"""``imgtrain data inspect DIR``: a look at a prepared data set before training on it.

One streamed pass (``inspection_scan.py``) keeps compact arrays per image, whatever the images
weigh. From them come the findings (``inspect_dataset`` returns them as the JSON of ``--json``):
images per class per split and the training split's imbalance, sizes and aspect ratios,
colour modes, the files prepare skipped, and exact and near duplicates (``duplicate_report.py``:
counted, grouped, and a bounded list of example pairs, cross-split ones first). The page
(``inspection_page.py``) then reads back only the images it shows: a few samples per class and
the duplicate pairs it lists.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from imgtrain.data import duplicate_report, duplicates, row_names
from imgtrain.data import format as fmt
from imgtrain.data.fingerprint import MODES, TRANSFORM_WORDS, UNREADABLE, Prints
from imgtrain.data.inspection_scan import Scan, scan
from imgtrain.data.named_splits import SPLIT_CODES, SPLIT_NAMES
from imgtrain.data.options import InspectOptions
from imgtrain.errors import ImgtrainError

IMBALANCE_FLAG = 3.0  # largest / smallest training class at or above this is flagged
MAX_JSON_PAIRS = 100_000  # pairs listed in the JSON (all are counted)
CO_OCCURRING_PAIRS = 20  # multi-label: the pairs of labels seen together most, listed


def inspect_dataset(data_dir, out=InspectOptions.out, workers: int = InspectOptions.workers,
                    threshold: int | None = InspectOptions.threshold, seed: int = InspectOptions.seed,
                    progress: Callable[[int, int], None] | None = None) -> dict:
    """Scan the prepared data set ``data_dir``, write the page to ``out`` (default:
    ``<name>-inspect.html`` here) and return the findings, the page's path among them.
    ``threshold``: the near duplicates' Hamming distance (None: ``duplicates.default_threshold``);
    the options are declared in ``options.InspectOptions``."""
    from imgtrain.data import inspection_page

    data_dir = Path(data_dir)
    manifest = fmt.load_manifest(data_dir)
    default = duplicates.default_threshold(manifest["channels"] == 1, max(manifest["image_shape"][:2]))
    threshold = default if threshold is None else threshold
    duplicates.check_threshold(threshold)
    page = Path(out) if out is not None else Path(f"{_file_name(manifest['name'])}-inspect.html")
    if page.is_dir():
        raise ImgtrainError(f"--out {page} is a folder; name the page's file, e.g. {page / 'inspect.html'}")
    found = scan(data_dir, manifest, workers, progress)
    result, extra = findings(data_dir, manifest, found, threshold, seed, default)
    result["page"] = str(page.absolute())
    inspection_page.write_page(page, result, extra, found, manifest)
    return result


def _file_name(name: str) -> str:
    """A data set's name (untrusted: from its manifest) as a plain file name."""
    kept = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in str(name)).strip("._")
    return kept[:80] or "dataset"


# ---------------------------------------------------------------- the findings


def findings(data_dir: Path, manifest: dict, found: Scan, threshold: int, seed: int,
             default: int = duplicates.DEFAULT_THRESHOLD) -> tuple[dict, dict]:
    """(the findings as JSON, what the page shows besides: sample positions per class and the
    pairs as positions); ``default``: the threshold the data set gets unless told otherwise."""
    classes, prints = manifest["classes"], found.prints
    k = len(classes)
    present = [s for s in fmt.ALL_SPLITS if s in manifest["splits"]]
    if found.label_sets is None:
        splits = {s: np.bincount(found.labels[found.split == SPLIT_CODES[s]], minlength=k) for s in present}
    else:  # per class, the images carrying it
        splits = {s: found.label_sets[found.split == SPLIT_CODES[s]].counts(k) for s in present}
    dups = duplicate_report.report(prints, duplicates.rank_of(found.split, found.ids), found.split, found.labels,
                                   threshold, MAX_JSON_PAIRS)
    # the images named in the JSON and on the page, by where they came from
    shown = np.r_[dups.examples.a, dups.examples.b, [i for g in dups.groups for i in g["members"]]].astype(np.int64)
    names = row_names.lookup(data_dir, manifest, found.ids[shown])
    readable = prints.mode != UNREADABLE
    result = {
        "data": str(data_dir), "name": manifest["name"], "source": manifest["source"],
        "storage": manifest["storage"], "images": int(len(found.ids)), "classes": classes,
        "splits": {s: {"images": int((found.split == SPLIT_CODES[s]).sum()), "per_class": c.tolist()}
                   for s, c in splits.items()},
        "imbalance": imbalance(splits["train"], classes),
        "sizes": _sizes(manifest, prints, readable),
        "modes": {MODES[m]: int(n) for m, n in enumerate(np.bincount(prints.mode, minlength=len(MODES))) if n},
        "exif_turned": int(prints.exif_turned.sum()),
        "skipped": _skipped(manifest.get("skipped")),
        "dedupe": _dedupe(manifest.get("dedupe")),
        "duplicates": _duplicates_json(dups, found, classes, threshold, names),
    }
    if found.label_sets is not None:
        result["multi_label"] = multi_label_findings(found, classes, present)
    result["duplicates"]["threshold_rule"] = duplicates.threshold_rule(threshold, default)
    result["mode_mix"] = len([m for m in result["modes"] if m != "unreadable"]) > 1
    extra = {"samples": _samples(found, k, seed), "pairs": dups.examples, "names": names}
    return result, extra


def _skipped(listed) -> dict:
    """The manifest's skipped files (untrusted: a manifest is input) as prepare writes them."""
    if not isinstance(listed, dict) or not _count(listed.get("count")):
        return {"count": 0, "files": []}
    files = listed.get("files") if isinstance(listed.get("files"), list) else []
    return {"count": listed["count"], "files": [[str(f[0]), str(f[1])] for f in files
                                                if isinstance(f, list) and len(f) == 2]}


def _dedupe(summary) -> dict | None:
    """The manifest's ``dedupe`` (``--dedupe``), when it is what prepare writes."""
    fields = ("mode", "threshold", "dropped", "file")
    if not isinstance(summary, dict) or not all(k in summary for k in fields) \
            or not _count(summary["dropped"]):
        return None
    return summary


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def imbalance(counts: np.ndarray, classes: list[str]) -> dict:
    """The training split's largest class against its smallest; flagged at IMBALANCE_FLAG x."""
    big, small = int(np.argmax(counts)), int(np.argmin(counts))
    ratio = float(counts[big] / counts[small]) if counts[small] else None  # None: a class has no image
    return {"split": "train", "ratio": None if ratio is None else round(ratio, 2), "flag_at": IMBALANCE_FLAG,
            "flagged": ratio is None or ratio >= IMBALANCE_FLAG,
            "largest": {"class": classes[big], "images": int(counts[big])},
            "smallest": {"class": classes[small], "images": int(counts[small])},
            "empty_classes": [classes[c] for c in np.flatnonzero(counts == 0)]}


def _sizes(manifest: dict, prints: Prints, readable: np.ndarray) -> dict:
    w, h = prints.width[readable].astype(np.float64), prints.height[readable].astype(np.float64)
    aspect = w / np.maximum(h, 1)

    def summary(x):
        return {"min": float(x.min()), "median": float(np.median(x)), "max": float(x.max())} if len(x) else None

    fixed = manifest["image_shape"] if manifest["storage"] == "tensor" else None
    return {"width": summary(w), "height": summary(h), "aspect": summary(np.round(aspect, 4)), "fixed_shape": fixed,
            "one_size": bool(len(w) and w.min() == w.max() and h.min() == h.max())}


def _duplicates_json(dups: duplicate_report.Report, found: Scan, classes, threshold: int,
                     names: dict[int, str]) -> dict:
    """The report as JSON: the counts, the example pairs (in the page's order: across splits
    first, then labels that differ, exact before near, closest first) and the groups."""
    pairs = dups.examples
    cross = found.split[pairs.a] != found.split[pairs.b]
    differ = found.labels[pairs.a] != found.labels[pairs.b]

    def image(i):  # "name": where it came from (row_names.py), null where the data set does not say
        label = int(found.labels[i]) if found.label_sets is None else found.label_sets.row(i).tolist()
        return {"split": SPLIT_NAMES[int(found.split[i])], "id": int(found.ids[i]),
                "name": names.get(int(found.ids[i])), "label": label, "class": found.class_of(i, classes)}

    listed = [{"kind": "exact" if pairs.exact[p] else "near", "distance": int(pairs.distance[p]),
               "transform": TRANSFORM_WORDS[pairs.transform[p]], "cross_split": bool(cross[p]),
               "same_label": not differ[p], "a": image(pairs.a[p]), "b": image(pairs.b[p])}
              for p in range(len(pairs))]
    groups = [{"images": g["images"], "splits": {SPLIT_NAMES[code]: n for code, n in enumerate(g["per_split"]) if n},
               "cross_split": g["cross_split"], "classes": g["labels"], "first": [image(i) for i in g["members"]]}
              for g in dups.groups]
    return {"hash": "pHash (imagehash), 64 bits, of the image and its 7 rotations and mirror images",
            "threshold": threshold, "counts": dups.counts, "different_labels": dups.different_labels,
            "turned": dups.turned, "images_involved": dups.images_involved, "candidates_checked": dups.candidates,
            "pairs_total": dups.pairs_total, "pairs_listed": len(listed), "pairs": listed,
            "groups_total": dups.groups_total, "largest_group": dups.largest_group, "groups_listed": len(groups),
            "groups": groups}


def _samples(found: Scan, k: int, seed: int, per_class: int = 6, classes_shown: int = 40) -> dict[int, np.ndarray]:
    """A seeded choice of training images (positions) for each of the first classes."""
    rng = np.random.default_rng([seed, 0x1A5])
    train = found.split == SPLIT_CODES["train"]
    out = {}
    for c in range(min(k, classes_shown)):
        carries = found.labels == c if found.label_sets is None else _carries(found, c)
        where = np.flatnonzero(train & carries)
        out[c] = np.sort(rng.choice(where, min(per_class, len(where)), replace=False)) if len(where) else where
    return out


def _carries(found: Scan, c: int) -> np.ndarray:
    """bool [n]: the images whose labels include class ``c``."""
    sets = found.label_sets
    out = np.zeros(len(sets), bool)
    out[np.repeat(np.arange(len(sets)), sets.sizes())[sets.values == c]] = True
    return out


def multi_label_findings(found: Scan, classes: list[str], splits: list[str], top: int = CO_OCCURRING_PAIRS) -> dict:
    """A multi-label data set: images per number of labels (per split) and the pairs of labels
    carried together by the most images (all splits), counted from each image's pairs."""
    sets = found.label_sets
    sizes = {s: np.bincount(sets[found.split == SPLIT_CODES[s]].sizes(), minlength=1).tolist() for s in splits}
    k = len(classes)
    codes = []
    for i in np.flatnonzero(sets.sizes() >= 2):
        row = sets.row(i)
        a, b = np.triu_indices(len(row), 1)
        codes.append(row[a] * k + row[b])
    pairs, counts = np.unique(np.concatenate(codes), return_counts=True) if codes else (np.zeros(0, np.int64),) * 2
    order = np.lexsort((pairs, -counts))[:top]
    return {"label_set_sizes": sizes,
            "labels_per_image": round(float(sets.sizes().mean()), 3) if len(sets) else 0.0,
            "co_occurrence": [{"a": classes[pairs[j] // k], "b": classes[pairs[j] % k], "images": int(counts[j])}
                              for j in order]}
