"""``data prepare --dedupe cross-split|all``: drop what ``data inspect`` would flag, before the
data set is written.

A first pass over the listing's chunks (in the preparation pool, a few chunks at a time) checks
each image as the writing pass will (``images.check_image``: the bytes that would be stored)
and fingerprints them (``fingerprint.py``: about 90 bytes an image); ``duplicate_drops.py``
chooses, from ``duplicates.py``'s exact groups and near classes (no list of pairs is held), and
an image goes when it duplicates one that stays earlier in the order test > val > train, then
source order (ids). cross-split looks only at pairs across splits (the test copy stays, the train
copy goes), all at every pair. What went is listed in ``dedupe.csv`` beside the manifest (its
text cells quoted as ``ops.spreadsheet`` says: names come from users' folders), and counted in
the manifest's ``dedupe``.
"""

from __future__ import annotations

import bisect
import csv
import functools
import io
from dataclasses import dataclass

import numpy as np

from imgtrain.data import duplicate_drops, duplicates, images, pool
from imgtrain.data.fingerprint import MODES, TRANSFORM_WORDS, UNREADABLE, Prints, fingerprint_encoded
from imgtrain.data.format import DEDUPE_FILE
from imgtrain.data.label_sets import LabelSets
from imgtrain.data.listing import Listing
from imgtrain.data.named_splits import SPLIT_CODES, SPLIT_NAMES
from imgtrain.data.options import PrepareOptions
from imgtrain.ops import spreadsheet

GRAY = {MODES.index(m) for m in ("1", "L", "LA", "I;16", "I", "F")}
COLUMNS = ("dropped_id", "dropped_name", "dropped_split", "dropped_class", "kept_id", "kept_name", "kept_split",
           "kept_class", "kind", "distance", "transform")


@dataclass
class Dropped:
    """What ``--dedupe`` drops: ``drop`` bool [N] by listing position, the manifest's summary and the CSV."""

    drop: np.ndarray
    summary: dict
    listing_csv: str


def plan(listed: Listing, split: np.ndarray, opts: PrepareOptions, progress=None) -> Dropped:
    """Fingerprint every image of ``listed`` (``split``: its split codes) and choose what goes."""
    n, parts, done = len(listed.labels), [], 0
    for chunk, prints in pool.ordered_map(functools.partial(fingerprint_chunk, size=opts.size), listed.chunks,
                                          opts.workers):
        parts.append(prints)
        done += len(prints.content)
        if progress:
            progress(done, n)
    return choose(listed, split, Prints.join(parts), opts)


def choose(listed: Listing, split: np.ndarray, prints: Prints, opts: PrepareOptions) -> Dropped:
    """What goes, from the fingerprints of every image of ``listed``."""
    default = _default_threshold(prints, opts)
    threshold = default if opts.near_threshold is None else opts.near_threshold
    copies = duplicates.Copies.of(prints, duplicates.rank_of(split, listed.ids))
    because = duplicate_drops.dropped_for(copies, split, threshold, opts.dedupe)
    gone = np.flatnonzero(because >= 0)
    gone = gone[np.argsort(copies.rank[gone])]
    kept = because[gone]
    exact = copies.group[kept] == copies.group[gone]
    distance, transform, _ = duplicates.closest(copies.hashes, copies.cls[kept], copies.cls[gone])
    summary = {"mode": opts.dedupe, "threshold": threshold, "dropped": len(gone), "exact": int(exact.sum()),
               "near": int((~exact).sum()), "file": DEDUPE_FILE,
               "by_split": {s: int((split[gone] == code).sum()) for s, code in SPLIT_CODES.items()}}
    rows = zip(gone.tolist(), kept.tolist(), exact.tolist(), np.where(exact, 0, distance).tolist(),
               np.where(exact, 0, transform).tolist())
    return Dropped(because >= 0, summary, _csv(listed, split, rows))


def fingerprint_chunk(chunk, size) -> Prints:
    """Fingerprints of a chunk's images as they would be stored (runs in a pool process)."""
    datas = list(chunk.read())
    prints = Prints.empty(len(datas))
    for k, data in enumerate(datas):
        stored = images.check_image(data, size).data
        if stored is not None:  # an unreadable file is skipped by the writing pass: never a keeper
            fingerprint_encoded(stored, prints, k)
    return prints


def _default_threshold(prints: Prints, opts: PrepareOptions) -> int:
    readable = prints.mode != UNREADABLE
    if not readable.any():
        return duplicates.DEFAULT_THRESHOLD
    gray = opts.channels == 1 or (opts.channels is None and bool(np.isin(prints.mode[readable], list(GRAY)).all()))
    side = max(opts.size) if opts.size else int(np.median(np.maximum(prints.width, prints.height)[readable]))
    return duplicates.default_threshold(gray, side)


def _csv(listed: Listing, split, rows) -> str:
    """``rows``: (dropped, kept, exact, distance, transform) by listing position, in rank order."""
    firsts = [c.first for c in listed.chunks]

    def name(position: int) -> str:
        chunk = listed.chunks[bisect.bisect_right(firsts, position) - 1]
        return chunk.names[position - chunk.first]

    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(COLUMNS)
    for b, a, exact, distance, transform in rows:
        writer.writerow(spreadsheet.safe_row([
            int(listed.ids[b]), name(b), SPLIT_NAMES[int(split[b])], _class_of(listed, b),
            int(listed.ids[a]), name(a), SPLIT_NAMES[int(split[a])], _class_of(listed, a),
            "exact" if exact else "near", distance, TRANSFORM_WORDS[transform]]))
    return out.getvalue()


def _class_of(listed: Listing, position: int) -> str:
    """An image's class, or a multi-label image's classes joined by spaces."""
    if isinstance(listed.labels, LabelSets):
        return " ".join(listed.classes[k] for k in listed.labels.row(position))
    return listed.classes[listed.labels[position]]
