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
    splits = {s: np.bincount(found.labels[found.split == SPLIT_CODES[s]], minlength=k)
              for s in fmt.ALL_SPLITS if s in manifest["splits"]}
    dups = duplicate_report.report(prints, duplicates.rank_of(found.split, found.ids), found.split, found.labels,
                                   threshold, MAX_JSON_PAIRS)
    # the images named in the JSON and on the page, by where they came from
    shown = np.r_[dups.examples.a, dups.examples.b, [i for g in dups.groups for i in g["members"]]].astype(np.int64)
    names = row_names.lookup(data_dir, manifest, found.ids[shown])
    readable = prints.mode != UNREADABLE
    result = {
        "data": str(data_dir), "name": manifest["name"], "source": manifest["source"],
        "storage": manifest["storage"], "images": int(len(found.ids)), "classes": classes,
        "splits": {s: {"images": int(c.sum()), "per_class": c.tolist()} for s, c in splits.items()},
        "imbalance": imbalance(splits["train"], classes),
        "sizes": _sizes(manifest, prints, readable),
        "modes": {MODES[m]: int(n) for m, n in enumerate(np.bincount(prints.mode, minlength=len(MODES))) if n},
        "exif_turned": int(prints.exif_turned.sum()),
        "skipped": _skipped(manifest.get("skipped")),
        "dedupe": _dedupe(manifest.get("dedupe")),
        "duplicates": _duplicates_json(dups, found, classes, threshold, names),
    }
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
        return {"split": SPLIT_NAMES[int(found.split[i])], "id": int(found.ids[i]),
                "name": names.get(int(found.ids[i])), "label": int(found.labels[i]), "class": classes[found.labels[i]]}

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
        where = np.flatnonzero(train & (found.labels == c))
        out[c] = np.sort(rng.choice(where, min(per_class, len(where)), replace=False)) if len(where) else where
    return out
