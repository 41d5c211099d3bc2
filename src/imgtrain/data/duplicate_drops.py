"""Which images ``data prepare --dedupe`` drops, from ``duplicates.py``'s groups and classes,
without holding the pairs: an image goes when it duplicates one earlier in rank (test > val >
train, then source order) that stays, so what stays holds no duplicate pair (across splits
with ``cross-split``) and a copy of a dropped image is not dropped for it. Each dropped image
names the earliest in rank of the kept images it duplicates.

* ``all`` keeps at most one image of a class: its first in rank, unless that one duplicates a
  kept one (and then so does every image of the class: a near pair of classes pairs all their
  images). So it is the greedy choice among classes in rank order (``_greedy_classes``): the
  search runs over the classes a batch at a time in that order, the classes before a batch
  already settled.
* ``cross-split`` keeps every test image; a val image goes when it duplicates a test image, a
  train image when it duplicates a test image or a val image that stays: two passes of the
  search, each keeping per class only the first image of the set it looks for.

Memory: a few arrays per image and per class, one chunk of the search, a MIS_ROWS^2 bitmap and
at most LATER_HELD pairs.
"""

from __future__ import annotations

import numpy as np

from imgtrain.data.duplicates import Copies, Search
from imgtrain.data.named_splits import SPLIT_CODES

MIS_ROWS = 4096  # classes settled together in ``all`` (their near pairs among them: a 16 MB bitmap)
LATER_HELD = 1 << 18  # a batch's near pairs with later classes held until it is settled (else searched again)
NONE = np.iinfo(np.int64).max


def dropped_for(copies: Copies, split: np.ndarray, threshold: int, mode: str) -> np.ndarray:
    """int64 [n]: for each image dropped, the kept image it duplicates (the first in rank); -1
    for the images kept. ``mode``: "all" or "cross-split"."""
    if mode == "all":
        return _drop_all(copies, threshold)
    return _drop_cross_split(copies, split, threshold)


def _drop_all(copies: Copies, threshold: int) -> np.ndarray:
    by_class = _greedy_classes(copies.hashes, threshold)
    out = np.full(len(copies.rank), -1, np.int64)
    images = np.flatnonzero(copies.cls >= 0)
    cls = copies.cls[images]
    out[images] = np.where(by_class[cls] < 0, copies.head[cls], copies.head[np.maximum(by_class[cls], 0)])
    out[copies.head[by_class < 0]] = -1  # the first image of a class that stays
    return out


def _greedy_classes(hashes: np.ndarray, threshold: int) -> np.ndarray:
    """int64 [m]: for each class dropped, the earliest kept class near it; -1 for those kept.
    A class stays when no earlier class near it stays; classes are numbered in rank order."""
    m = len(hashes)
    search = Search(hashes, threshold)
    by = np.full(m, NONE, np.int64)  # the earliest kept class near each, as found so far
    for start in range(0, m, MIS_ROWS):
        end = min(m, start + MIS_ROWS)
        near = np.zeros((end - start, end - start), bool)  # near pairs within the batch
        waits = np.zeros(end - start, bool)  # near an earlier class of the batch
        later: list | None = []  # (q, c) near a later class, while LATER_HELD fit
        held = 0
        for hits in search.hits(np.arange(start, end)):
            before = hits.c < start  # settled: kept when nothing dropped it
            kept = before & (by[np.where(before, hits.c, 0)] == NONE)
            np.minimum.at(by, hits.q[kept], hits.c[kept])
            inside = ~before & (hits.c < end)
            q, c = hits.q[inside] - start, hits.c[inside] - start
            near[q, c] = near[c, q] = True
            waits[np.maximum(q, c)] = True
            after = hits.c >= end
            held += int(after.sum())
            if later is not None and held <= LATER_HELD:
                later.append((hits.q[after], hits.c[after]))
            else:
                later = None
        stays = by[start:end] == NONE
        for r in np.flatnonzero(waits & stays).tolist():  # in rank order: earlier ones are settled
            earlier = np.flatnonzero(near[r, :r] & stays[:r])
            if len(earlier):
                stays[r] = False
                by[start + r] = start + earlier[0]
        # A later class near one that stays but only from this side (its own turned hashes are
        # further off) is found by this batch's search alone: mark it now. When there were too
        # many to hold, the kept classes of the batch search again.
        again = ((hits.q, hits.c) for hits in search.hits(start + np.flatnonzero(stays)))
        for q, c in again if later is None else later:
            mark = (c >= end) & stays[q - start]
            np.minimum.at(by, c[mark], q[mark])
    return np.where(by == NONE, -1, by)


def _drop_cross_split(copies: Copies, split: np.ndarray, threshold: int) -> np.ndarray:
    readable = copies.cls >= 0
    test, val, train = (readable & (split == SPLIT_CODES[s]) for s in ("test", "val", "train"))
    search = Search(copies.hashes, threshold)
    by_test = earliest_duplicate(copies, search, test)
    val_stays = val & (by_test < 0)
    by_val = earliest_duplicate(copies, search, val_stays)
    out = np.full(len(split), -1, np.int64)
    out[val] = by_test[val]
    out[train] = np.where(by_test[train] >= 0, by_test[train], by_val[train])
    return out


def earliest_duplicate(copies: Copies, search: Search, among: np.ndarray) -> np.ndarray:
    """int64 [n]: for each readable image, the first in rank of the images of ``among`` (bool
    [n], readable ones) it duplicates; -1 where none. Its duplicates: its group's keeper (or, for
    a keeper, the group's other images), the images of its class in other groups, and those of
    the classes near its own."""
    rank, group, cls = copies.rank, copies.group, copies.cls
    g, m = len(copies.keeper), len(copies.head)
    members = np.flatnonzero(among)
    by_group = np.full(g, NONE, np.int64)  # the first of ``among`` in each group, by rank
    np.minimum.at(by_group, group[members], rank[members])
    not_keeper = members[copies.keeper[group[members]] != members]
    by_group_copy = np.full(g, NONE, np.int64)  # the same, the keeper left out
    np.minimum.at(by_group_copy, group[not_keeper], rank[not_keeper])
    # the best and second best group of each class: an image looks past its own group
    order = np.lexsort((by_group, copies.cls[copies.keeper]))
    group_class = copies.cls[copies.keeper][order]
    firsts = np.flatnonzero(np.r_[True, group_class[1:] != group_class[:-1]][:len(order)])
    best, best_group, second = np.full(m, NONE, np.int64), np.full(m, -1, np.int64), np.full(m, NONE, np.int64)
    best[group_class[firsts]], best_group[group_class[firsts]] = by_group[order[firsts]], order[firsts]
    then = firsts + 1
    then = then[then < len(order)]
    then = then[group_class[then] == group_class[then - 1]]
    second[group_class[then]] = by_group[order[then]]
    near = np.full(m, NONE, np.int64)  # the best of the classes near each class
    for pairs in search.pairs():
        np.minimum.at(near, pairs.a, best[pairs.b])
        np.minimum.at(near, pairs.b, best[pairs.a])
    images = np.flatnonzero(cls >= 0)
    c, grp = cls[images], group[images]
    keeper = copies.keeper[grp]
    own_group = np.where(keeper == images, by_group_copy[grp], np.where(among[keeper], rank[keeper], NONE))
    own_class = np.where(best_group[c] == grp, second[c], best[c])
    found = np.minimum(np.minimum(own_group, own_class), near[c])
    image_at = np.argsort(rank)
    out = np.full(len(rank), -1, np.int64)
    out[images] = np.where(found == NONE, -1, image_at[np.minimum(found, len(rank) - 1)])
    return out
