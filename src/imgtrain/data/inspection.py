"""``imgtrain data inspect DIR``: a look at a prepared data set before training on it.

One streamed pass reads every split's row groups in a process pool (``pool.ordered_map``) and
keeps, per image, only compact numpy arrays: id (8 bytes), split (1), label (4), row group and
row (8), width and height (8), colour mode and EXIF flag (2), content hash (8) and the 8 turned
pHashes (64): 103 bytes an image (about 100 MB for a million images), whatever the images weigh.
From them come the findings (``inspect_dataset`` returns them as the JSON of ``--json``):
images per class per split and the training split's imbalance, sizes and aspect ratios,
colour modes, the files prepare skipped, and exact and near duplicates (``duplicate_report.py``:
counted, grouped, and a bounded list of example pairs, cross-split ones first). The page
(``inspection_page.py``) then reads back only the images it shows: a few samples per class and
the duplicate pairs it lists.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from imgtrain.data import duplicate_report, duplicates, row_names
from imgtrain.data import format as fmt
from imgtrain.data import pool
from imgtrain.data.fingerprint import (
    MODES,
    TRANSFORM_WORDS,
    UNREADABLE,
    Prints,
    fingerprint_encoded,
    fingerprint_pixels,
)
from imgtrain.data.named_splits import SPLIT_CODES
from imgtrain.errors import ImgtrainError

IMBALANCE_FLAG = 3.0  # largest / smallest training class at or above this is flagged
MAX_JSON_PAIRS = 100_000  # pairs listed in the JSON (all are counted)
SPLIT_NAMES = {code: name for name, code in SPLIT_CODES.items()}


def inspect_dataset(data_dir, out=None, workers: int = 0, threshold: int | None = None, seed: int = 0,
                    progress: Callable[[int, int], None] | None = None) -> dict:
    """Scan the prepared data set ``data_dir``, write the page to ``out`` (default:
    ``<name>-inspect.html`` here) and return the findings, the page's path among them.
    ``threshold``: the near duplicates' Hamming distance (None: ``duplicates.default_threshold``)."""
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


@dataclass
class Scan:
    """What the pass keeps of every image, by position (splits one after the other)."""

    split: np.ndarray  # int8 [n]: SPLIT_CODES
    ids: np.ndarray  # int64 [n]
    labels: np.ndarray  # int32 [n]
    block: np.ndarray  # uint32 [n]: index into ``blocks``
    row: np.ndarray  # uint32 [n]: row in its row group
    prints: Prints
    blocks: list  # (file, row group) of each block


def scan(data_dir: Path, manifest: dict, workers: int = 0,
         progress: Callable[[int, int], None] | None = None) -> Scan:
    """Fingerprint every image of every split, row group by row group, in the pool."""
    tasks = [(SPLIT_CODES[s], str(f), g) for s in fmt.ALL_SPLITS if s in manifest["splits"]
             for f, g, _ in fmt.row_groups(data_dir, manifest, s)]
    total = sum(manifest["splits"][s]["num_samples"] for s in manifest["splits"])
    columns: list[list] = [[], [], [], [], [], []]  # split, ids, labels, block, row, prints: a part per block
    done = 0
    work = functools.partial(scan_block, storage=manifest["storage"])
    for k, (task, (ids, labels, prints)) in enumerate(pool.ordered_map(work, tasks, workers)):
        n = len(ids)
        part = (np.full(n, task[0], np.int8), ids.astype(np.int64), labels.astype(np.int32), np.full(n, k, np.uint32),
                np.arange(n, dtype=np.uint32), prints)
        for column, values in zip(columns, part):
            column.append(values)
        done += n
        if progress:
            progress(done, total)
    empty = (np.int8, np.int64, np.int32, np.uint32, np.uint32)
    arrays = [np.concatenate(c) if c else np.zeros(0, t) for c, t in zip(columns, empty)]
    labels = arrays[2]
    if len(labels) and not (0 <= labels.min() and labels.max() < manifest["num_classes"]):
        raise ImgtrainError(f"{data_dir} holds a label outside the manifest's {manifest['num_classes']} classes; "
                            "prepare the data set again")
    return Scan(*arrays, Prints.join(columns[5]), [(f, g) for _, f, g in tasks])


def scan_block(task: tuple, storage: str) -> tuple[np.ndarray, np.ndarray, Prints]:
    """(ids, labels, fingerprints) of one row group (runs in a pool process)."""
    _, path, group = task
    ids, labels, pictures = read_block(path, group, storage)
    prints = Prints.empty(len(ids))
    for k, picture in enumerate(pictures):
        (fingerprint_pixels if storage == "tensor" else fingerprint_encoded)(picture, prints, k)
    return ids, labels, prints


def read_block(path, group: int, storage: str):
    """(ids, labels, images) of one row group: images as encoded bytes, or uint8 [n, H, W, C]."""
    table = fmt.read_row_group(Path(path), group, storage)
    if storage == "tensor":
        from imgtrain.data.tables import tensor_column_to_numpy

        pictures = tensor_column_to_numpy(table.column("image"), table.schema.field("image"))
    else:
        pictures = table.column("image").to_pylist()
    return table.column("id").to_numpy(), table.column("label").to_numpy(), pictures


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
