"""What ``data inspect`` says of duplicates, from ``duplicates.py``'s groups, classes and near
pairs of classes, without holding the pairs (n images that share a pHash are n^2 / 2 of them):

* **counts** of the pairs (exact, near; across splits or within one; with different labels;
  turned), from per-class counts: a near pair of classes of x and y images is x y pairs. An
  exact group is counted as its keeper paired with each of its other images.
* **groups**: the images linked by duplicate pairs (union-find over the classes), counted, and
  the first MAX_GROUPS listed with their first GROUP_IMAGES images.
* **examples**: the first ``limit`` pairs in the page's order (``Shortlist``), drawn from every
  exact pair and, of a class with more than SHOWN_IMAGES images, from SHOWN_IMAGES of them
  spread over its splits and labels (fewer images: all of their pairs).

Memory: a few arrays per image and per class, one chunk of the search, and at most 2 ``limit``
example pairs at a time.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from imgtrain.data.duplicates import Copies, NearPairs, Search, closest
from imgtrain.data.fingerprint import Prints

SHOWN_IMAGES = 16  # images of one class whose pairs can be examples
GROUP_IMAGES = 10  # images listed of a group
MAX_GROUPS = 10_000  # groups listed (all are counted)
EXPAND = 1 << 20  # example pairs made from near pairs of classes at once


@dataclass
class Pairs:
    """Example pairs, by image position; a before b in rank (a is the one a dedupe keeps)."""

    a: np.ndarray  # int64 [p]
    b: np.ndarray  # int64 [p]
    distance: np.ndarray  # int64 [p]: Hamming distance of the pHashes (0 for exact copies)
    exact: np.ndarray  # bool [p]: same content hash
    transform: np.ndarray  # int64 [p]: TRANSFORMS index that turns a into b

    def __len__(self) -> int:
        return len(self.a)


@dataclass
class Report:
    counts: dict  # {"cross_split" | "within_split": {"exact": pairs, "near": pairs}}
    different_labels: int  # pairs whose labels differ
    turned: int  # near pairs closer turned or mirrored than as is
    pairs_total: int
    candidates: int  # (turned hash, class) candidates the near search checked
    examples: Pairs  # in the page's order: across splits, labels differ, exact, closest first
    images_involved: int  # images in a group
    groups_total: int
    largest_group: int  # images in the largest group (0: none)
    groups: list[dict] = field(default_factory=list)  # the first MAX_GROUPS (``_groups``)


def report(prints: Prints, rank: np.ndarray, split: np.ndarray, labels: np.ndarray, threshold: int,
           limit: int) -> Report:
    """The duplicates among ``prints`` (``split``, ``labels``: int [n]) with at most ``limit`` examples."""
    copies = Copies.of(prints, rank)
    census = _Census(copies, split, labels)
    shortlist = Shortlist(limit, rank, split, labels)
    census.exact(shortlist)
    census.within_classes(shortlist)
    search = Search(copies.hashes, threshold)
    parent = np.arange(len(copies.head))
    for near in search.pairs():
        census.near(near)
        for start in range(0, len(near.a), EXPAND // SHOWN_IMAGES ** 2):
            census.examples(near, slice(start, start + EXPAND // SHOWN_IMAGES ** 2), shortlist)
        union(parent, near.a, near.b)
    examples = shortlist.result()
    exact = examples.exact
    examples.transform = np.where(exact, 0, closest(copies.hashes, copies.cls[examples.a], copies.cls[examples.b])[1])
    component = roots(parent, np.arange(len(parent)))
    involved, total, largest, groups = _groups(copies, component, split, labels)
    c = census
    return Report({"cross_split": {"exact": c.exact_cross, "near": c.near_cross},
                   "within_split": {"exact": c.exact_within, "near": c.near_within}},
                  c.differ, c.turned, c.exact_cross + c.exact_within + c.near_cross + c.near_within,
                  search.candidates, examples, involved, total, largest, groups)


class _Census:
    """The pair counts, and the images of each class that examples are drawn from."""

    def __init__(self, copies: Copies, split: np.ndarray, labels: np.ndarray):
        self.copies, self.split, self.labels = copies, split.astype(np.int64), labels.astype(np.int64)
        self.exact_cross = self.exact_within = self.near_cross = self.near_within = self.differ = self.turned = 0
        m = len(copies.head)
        images = np.flatnonzero(copies.cls >= 0)
        cls = copies.cls[images]
        self.size = np.bincount(cls, minlength=m)
        self.per_split = np.bincount(cls * 3 + self.split[images], minlength=3 * m).reshape(m, 3)
        # a class's one label, or -1 where its images have several (their Counter in ``mixed``)
        self.top = int(self.labels.max(initial=0)) + 1  # class * top + label: one number per (class, label)
        keys, counts = np.unique(cls * self.top + self.labels[images], return_counts=True)
        key_class, key_label = keys // self.top, keys % self.top
        alone = (np.bincount(key_class, minlength=m) == 1)[key_class]
        self.label = np.full(m, -1, np.int64)
        self.label[key_class[alone]] = key_label[alone]
        self.mixed: dict[int, Counter] = {}
        for k, label, n in zip(key_class[~alone].tolist(), key_label[~alone].tolist(), counts[~alone].tolist()):
            self.mixed.setdefault(k, Counter())[label] = n
        # SHOWN_IMAGES of each class: the first of each (split, label) in rank, then the second ...
        by = images[np.lexsort((copies.rank[images], self.labels[images], self.split[images], cls))]
        combo = np.stack([copies.cls[by], self.split[by], self.labels[by]])
        starts = np.flatnonzero(np.r_[True, (combo[:, 1:] != combo[:, :-1]).any(0)][:len(by)])
        nth = np.arange(len(by)) - np.repeat(starts, np.diff(np.r_[starts, len(by)]))
        by = by[np.lexsort((copies.rank[by], nth, copies.cls[by]))]
        first = np.searchsorted(copies.cls[by], np.arange(m + 1))
        place = np.arange(len(by)) - first[copies.cls[by]]
        self.shown = by[place < SHOWN_IMAGES]
        self.shown_start = np.searchsorted(copies.cls[self.shown], np.arange(m + 1))

    def exact(self, shortlist: "Shortlist") -> None:
        """Each group's keeper with each of its other images."""
        copies = self.copies
        b = np.flatnonzero(copies.cls >= 0)
        b = b[copies.keeper[copies.group[b]] != b]
        a = copies.keeper[copies.group[b]]
        cross = self.split[a] != self.split[b]
        self.exact_cross, self.exact_within = int(cross.sum()), int((~cross).sum())
        self.differ += int((self.labels[a] != self.labels[b]).sum())
        shortlist.add(a, b, np.ones(len(a), bool), np.zeros(len(a), np.int64))

    def within_classes(self, shortlist: "Shortlist") -> None:
        """A class's images in different groups: near pairs at distance 0."""
        copies = self.copies
        images = np.flatnonzero(copies.cls >= 0)
        cls, grp, split, labels = copies.cls[images], copies.group[images], self.split[images], self.labels[images]

        def square_sums(keys):  # the sum of the squares of the number of images of each key
            return int((np.unique(keys, return_counts=True)[1].astype(np.int64) ** 2).sum())

        total = (square_sums(cls) - square_sums(grp)) // 2
        same_split = (square_sums(cls * 3 + split) - square_sums(grp * 3 + split)) // 2
        same_label = (square_sums(cls * self.top + labels) - square_sums(grp * self.top + labels)) // 2
        self.near_within += same_split
        self.near_cross += total - same_split
        self.differ += total - same_label
        several = np.flatnonzero(np.bincount(copies.cls[copies.keeper], minlength=len(copies.head)) > 1)
        for size in range(2, SHOWN_IMAGES + 1):  # pairs of the shown images, class by class of one size
            these = several[np.diff(self.shown_start)[several] == size]
            x, y = np.triu_indices(size, 1)
            for start in range(0, len(these), max(1, EXPAND // len(x))):
                base = self.shown_start[these[start:start + EXPAND // len(x)], None]
                a, b = self.shown[(base + x).ravel()], self.shown[(base + y).ravel()]
                other = copies.group[a] != copies.group[b]
                a, b = a[other], b[other]
                shortlist.add(a, b, np.zeros(len(a), bool), np.zeros(len(a), np.int64))

    def near(self, near: NearPairs) -> None:
        """A near pair of classes: every image of one with every image of the other."""
        a, b = near.a, near.b
        pairs = self.size[a].astype(np.int64) * self.size[b]
        same_split = (self.per_split[a] * self.per_split[b]).sum(1)
        self.near_within += int(same_split.sum())
        self.near_cross += int((pairs - same_split).sum())
        self.turned += int(pairs[near.turned].sum())
        one = (self.label[a] >= 0) & (self.label[b] >= 0)
        same_label = int(pairs[one & (self.label[a] == self.label[b])].sum())
        for x, y in zip(a[~one].tolist(), b[~one].tolist()):  # classes whose copies carry several labels: rare
            cx, cy = (self.mixed.get(k) or Counter({int(self.label[k]): int(self.size[k])}) for k in (x, y))
            same_label += sum(n * cy[label] for label, n in cx.items())
        self.differ += int(pairs.sum()) - same_label

    def examples(self, near: NearPairs, rows: slice, shortlist: "Shortlist") -> None:
        """The pairs of the shown images of each near pair of classes in ``rows``."""
        a, b = near.a[rows], near.b[rows]
        sa, sb = np.diff(self.shown_start)[a], np.diff(self.shown_start)[b]
        each = sa * sb
        pair = np.repeat(np.arange(len(a)), each)
        offset = np.arange(int(each.sum())) - np.repeat(np.cumsum(each) - each, each)
        x = self.shown[self.shown_start[a][pair] + offset // sb[pair]]
        y = self.shown[self.shown_start[b][pair] + offset % sb[pair]]
        shortlist.add(x, y, np.zeros(len(x), bool), near.distance[rows][pair])


class Shortlist:
    """The first ``limit`` pairs in the page's order (across splits, labels differ, exact,
    closest, then by position) of all those added: at most 2 ``limit`` held at once."""

    def __init__(self, limit: int, rank: np.ndarray, split: np.ndarray, labels: np.ndarray):
        self.limit, self.rank, self.split, self.labels = limit, rank, split, labels
        self.parts: list[tuple] = []
        self.held = 0
        self.bound = None  # (key, b) of the last pair kept, once ``limit`` are

    def add(self, x, y, exact, distance) -> None:
        swap = self.rank[x] > self.rank[y]
        a, b = np.where(swap, y, x), np.where(swap, x, y)
        key = ((((self.split[a] == self.split[b]).astype(np.int64) << 1 | (self.labels[a] == self.labels[b])) << 1
                | ~exact) << 7 | distance) << 40 | a
        if self.bound is not None:
            keep = (key < self.bound[0]) | ((key == self.bound[0]) & (b < self.bound[1]))
            key, a, b, exact, distance = key[keep], a[keep], b[keep], exact[keep], distance[keep]
        self.parts.append((key, a, b, exact, distance))
        self.held += len(key)
        if self.held > 2 * self.limit:
            self._trim()

    def _trim(self) -> None:
        if not self.parts:
            self.parts = [(np.zeros(0, np.int64),) * 3 + (np.zeros(0, bool), np.zeros(0, np.int64))]
        key, a, b, exact, distance = (np.concatenate(column) for column in zip(*self.parts))
        first = np.lexsort((b, key))[:self.limit]
        self.parts = [(key[first], a[first], b[first], exact[first], distance[first])]
        self.held = len(first)
        if len(first) == self.limit and len(first):
            self.bound = (key[first[-1]], b[first[-1]])

    def result(self) -> Pairs:
        self._trim()
        _, a, b, exact, distance = self.parts[0]
        return Pairs(a.astype(np.int64), b.astype(np.int64), distance.astype(np.int64), exact.astype(bool),
                     np.zeros(len(a), np.int64))


def union(parent: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    """Join the sets of each a[i] and b[i] (a forest pointing to smaller numbers)."""
    while len(a):
        ra, rb = roots(parent, a), roots(parent, b)
        apart = ra != rb
        a, b, ra, rb = a[apart], b[apart], ra[apart], rb[apart]
        np.minimum.at(parent, np.maximum(ra, rb), np.minimum(ra, rb))  # one link per root a round


def roots(parent: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The root of each of ``x``; the path from each is shortened to one step."""
    r = parent[x]
    while True:
        up = parent[r]
        if np.array_equal(up, r):
            break
        r = up
    parent[x] = r
    return r


def _groups(copies: Copies, component: np.ndarray, split: np.ndarray, labels: np.ndarray):
    """(images in groups, groups, images in the largest, the first MAX_GROUPS as dicts): across
    splits first, then those whose labels differ, then the largest; ``per_split`` by split code,
    ``labels`` how many different ones, ``members`` the first GROUP_IMAGES in rank."""
    images = np.flatnonzero(copies.cls >= 0)
    comp = component[copies.cls[images]]
    size = np.bincount(comp, minlength=len(component))
    grouped = size[comp] > 1
    images, comp = images[grouped], comp[grouped]
    ids = np.flatnonzero(size > 1)
    per_split = np.bincount(comp * 3 + split[images], minlength=3 * len(component)).reshape(-1, 3)[ids]
    top = int(labels.max(initial=0)) + 1
    pairs = np.unique(comp * top + labels[images].astype(np.int64))
    kinds = np.bincount(pairs // top, minlength=len(component))[ids]
    cross = (per_split > 0).sum(1) > 1
    order = np.lexsort((ids, -size[ids], kinds < 2, ~cross))[:MAX_GROUPS]
    by = images[np.lexsort((copies.rank[images], comp))]
    starts = np.searchsorted(component[copies.cls[by]], ids[order])
    groups = [{"images": int(size[ids[g]]), "per_split": per_split[g].tolist(), "cross_split": bool(cross[g]),
               "labels": int(kinds[g]), "members": by[s:s + min(GROUP_IMAGES, int(size[ids[g]]))].tolist()}
              for g, s in zip(order.tolist(), starts.tolist())]
    return int(grouped.sum()), len(ids), int(size.max(initial=0)) if len(ids) else 0, groups
