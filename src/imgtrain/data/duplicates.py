"""Exact and near duplicates among n fingerprinted images (``fingerprint.py``), found without
comparing all pairs; one implementation for ``data inspect`` and ``data prepare --dedupe``.

* **Exact**: images sorted by content hash; each run of equal hashes is one group, reported as
  pairs of its keeper (the member first in ``rank``) with each other member.
* **Near**: pHash within ``threshold`` bits (Hamming distance), under any rotation or mirror.
  Only each exact group's keeper takes part (its copies have the same pixels), and a near pair of
  keepers stands for every pair of their groups' members. The 64 bits are cut into threshold + 1
  disjoint bands (``band_key``): two hashes within ``threshold`` bits agree exactly on one band at
  least (pigeonhole), so the candidates of an image are the images that share a band with one of
  its 8 turned hashes, found by binary search in the band's sorted values; only they get the full
  distance. With random hashes that is about 8 (t + 1) n^2 / 2^(64 / (t + 1)) candidates
  (t = 4: 0.5 % of n^2); real pHashes are less even (8,000 small photos: 0.8 % of n^2).

A pair is (a, b) with a first in ``rank`` (the image a dedupe keeps: the higher split, then the
first in source order), ``transform`` what turns a into b (``fingerprint.TRANSFORMS``). Memory:
the pairs found, and while searching the sorted band (16 bytes an image) and a bounded batch of
candidates.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from imgtrain.data.fingerprint import INVERSE, UNREADABLE, Prints
from imgtrain.errors import ImgtrainError

DEFAULT_THRESHOLD = 4  # bits of 64: a resized or recompressed copy is 0-2 away, a brightened one ~4
SMALL_GRAY_SIDE = 32  # grayscale images this small (digits) get threshold 0 by default
# Beyond it bands of 7 bits or fewer make the search nearly all-pairs (8,000 small photos: 0.8 %
# of n^2 candidates at 4, 13 % at 6, 63 % at 8) and unrelated images start to match.
MAX_THRESHOLD = 8
QUERY_ROWS = 1 << 14  # images whose candidates are gathered together
CANDIDATE_BATCH = 1 << 18  # candidates checked at once (about 20 MB of temporaries)


@dataclass
class Pairs:
    """Duplicate pairs, by image position; a before b in rank."""

    a: np.ndarray  # int64 [p]
    b: np.ndarray  # int64 [p]
    distance: np.ndarray  # int8 [p]: Hamming distance of the pHashes (0 for exact copies)
    exact: np.ndarray  # bool [p]: same content hash
    transform: np.ndarray  # int8 [p]: TRANSFORMS index that turns a into b
    candidates: int = 0  # (turned hash, image) candidates the near search checked

    def __len__(self) -> int:
        return len(self.a)

    def take(self, index) -> "Pairs":
        return Pairs(self.a[index], self.b[index], self.distance[index], self.exact[index], self.transform[index],
                     self.candidates)


def find_pairs(prints: Prints, rank: np.ndarray, threshold: int = DEFAULT_THRESHOLD) -> Pairs:
    """Every exact and near duplicate pair among ``prints`` (unreadable images left out);
    ``rank`` int64 [n]: lower is kept first (``rank_of``)."""
    readable = np.flatnonzero(prints.mode != UNREADABLE)
    order = readable[np.lexsort((rank[readable], prints.content[readable]))]
    content = prints.content[order]
    starts = np.flatnonzero(np.r_[True, content[1:] != content[:-1]])
    sizes = np.diff(np.r_[starts, len(order)])
    keeper = np.repeat(order[starts], sizes)  # each image's group keeper, by position in ``order``
    copy = order != keeper
    exact = _oriented(keeper[copy], order[copy], np.zeros(copy.sum(), np.int8), np.zeros(copy.sum(), np.int8), rank)
    exact.exact[:] = True
    keepers = order[starts]
    i, j, dist, turn, checked = near_pairs(prints.phash[keepers], threshold)
    near = _expand(keepers[i], keepers[j], dist, turn, order, keeper)
    near = _oriented(near[0], near[1], near[2], near[3], rank)
    both = Pairs(*(np.concatenate([getattr(exact, f), getattr(near, f)]) for f in
                   ("a", "b", "distance", "exact", "transform")), candidates=checked)
    return both.take(np.lexsort((both.b, both.a)))


def default_threshold(gray: bool, side: int) -> int:
    """DEFAULT_THRESHOLD, or 0 for grayscale images of at most SMALL_GRAY_SIDE px a side: pHash
    sees little more than their strokes (the MNIST sample has 3,301 pairs within 4 bits, mostly
    one digit written alike by different hands, and 27 within 0)."""
    return 0 if gray and side <= SMALL_GRAY_SIDE else DEFAULT_THRESHOLD


def threshold_rule(threshold: int, default: int) -> str:
    """How the page and the JSON say which threshold was used."""
    if threshold != default:
        return f"{threshold} bits (--near-threshold)"
    if default == DEFAULT_THRESHOLD:
        return f"{threshold} bits (the default)"
    return (f"{threshold} bits (the default for grayscale images of at most {SMALL_GRAY_SIDE} px a side: pHash "
            f"sees little more than their strokes; {DEFAULT_THRESHOLD} for other images)")


def check_threshold(threshold: int) -> None:
    if isinstance(threshold, bool) or not (isinstance(threshold, int) and 0 <= threshold <= MAX_THRESHOLD):
        raise ImgtrainError(f"--near-threshold must be a whole number of bits from 0 to {MAX_THRESHOLD}, got "
                            f"{threshold!r}; above {MAX_THRESHOLD} unrelated images start to match")


def rank_of(split_codes: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """int64 [n]: the order a dedupe keeps images in: the test split, then val, then train
    (split codes 2, 1, 0), and within a split by id (the source's order)."""
    return np.lexsort((ids, -split_codes.astype(np.int64))).argsort().astype(np.int64)


def _oriented(x, y, dist, turn, rank) -> Pairs:
    """Pairs with a the one first in rank (the transform inverted where x and y swap)."""
    swap = rank[x] > rank[y]
    a, b = np.where(swap, y, x), np.where(swap, x, y)
    turn = np.where(swap, np.asarray(INVERSE, np.int8)[turn], turn).astype(np.int8)
    return Pairs(a.astype(np.int64), b.astype(np.int64), dist.astype(np.int8), np.zeros(len(a), bool), turn)


def _expand(i, j, dist, turn, order, keeper):
    """A near pair of keepers -> a pair for every member of one group with every member of the other."""
    if not len(i):
        return i, j, dist, turn
    members = np.argsort(keeper, kind="stable")  # positions in ``order``, grouped by keeper
    sorted_keepers = keeper[members]
    lo_i, hi_i = np.searchsorted(sorted_keepers, i), np.searchsorted(sorted_keepers, i, "right")
    lo_j, hi_j = np.searchsorted(sorted_keepers, j), np.searchsorted(sorted_keepers, j, "right")
    out = [[], [], [], []]
    for p in np.flatnonzero((hi_i - lo_i > 1) | (hi_j - lo_j > 1)):  # groups of copies: rare
        xs, ys = order[members[lo_i[p]:hi_i[p]]], order[members[lo_j[p]:hi_j[p]]]
        xx, yy = np.meshgrid(xs, ys, indexing="ij")
        for column, values in zip(out, (xx.ravel(), yy.ravel(), np.full(xx.size, dist[p]), np.full(xx.size, turn[p]))):
            column.append(values)
    single = (hi_i - lo_i == 1) & (hi_j - lo_j == 1)
    parts = [i[single], j[single], dist[single], turn[single]]
    return tuple(np.concatenate([part, *extra]) for part, extra in zip(parts, out))


def band_key(hashes: np.ndarray, band: int, count: int) -> np.ndarray:
    """The bits band, band + count, band + 2 count, ... of each uint64, packed: one of ``count``
    disjoint bands. Interleaved, not contiguous: pHash's neighbouring frequencies go together, and
    contiguous bands put 2.7x more candidates in the same buckets (8,000 photos: 2.1 % of n^2 against 0.8 %)."""
    key = np.zeros(hashes.shape, np.uint64)
    for j, bit in enumerate(range(band, 64, count)):
        key |= ((hashes >> np.uint64(bit)) & np.uint64(1)) << np.uint64(j)
    return key


def near_pairs(hashes: np.ndarray, threshold: int):
    """Pairs (i < j) of rows of ``hashes`` (uint64 [m, 8]: column 0 each image as is, then
    turned) whose turned hash k of i is within ``threshold`` bits of j's own: (i, j, distance,
    k that turns i into j, candidates checked). Each pair once, at its smallest distance."""
    m = len(hashes)
    found: list[np.ndarray] = []
    checked = 0
    own = hashes[:, 0]
    for band in range(threshold + 1):
        key = band_key(own, band, threshold + 1)
        order = np.argsort(key, kind="stable")
        sorted_key = key[order]
        for start in range(0, m, QUERY_ROWS):
            turned = hashes[start:start + QUERY_ROWS]  # [q, 8]
            wanted = band_key(turned, band, threshold + 1).ravel()
            lo = np.searchsorted(sorted_key, wanted, "left")
            count = np.searchsorted(sorted_key, wanted, "right") - lo
            checked += int(count.sum())
            found += _check(turned.ravel(), lo, count, order, own, start, threshold)
    i, j, dist, turn = np.concatenate(found, axis=1) if found else np.zeros((4, 0), np.int64)
    best = np.lexsort((turn, dist, j, i))  # per pair, the smallest distance first
    i, j, dist, turn = i[best], j[best], dist[best], turn[best]
    first = np.r_[True, (i[1:] != i[:-1]) | (j[1:] != j[:-1])][:len(i)]
    return i[first], j[first], dist[first].astype(np.int8), turn[first].astype(np.int8), checked


def _check(queries, lo, count, order, own, start, threshold) -> list[np.ndarray]:
    """The candidates of each turned hash (``lo``/``count`` in the sorted band), in batches of at
    most CANDIDATE_BATCH: [i, j, distance, transform] of those within the threshold, i < j."""
    out = []
    ends = np.cumsum(count)
    cuts = np.searchsorted(ends, np.arange(CANDIDATE_BATCH, int(ends[-1]) if len(ends) else 0, CANDIDATE_BATCH))
    for rows in np.split(np.arange(len(count)), np.unique(cuts)):
        n = count[rows]
        if not n.sum():
            continue
        row = np.repeat(rows, n)
        offset = np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)
        j = order[lo[row] + offset]
        dist = popcount(queries[row] ^ own[j])
        i, k = start + row // 8, row % 8
        hit = (dist <= threshold) & (i != j)
        i, j, dist, k = i[hit], j[hit], dist[hit], k[hit]
        swap = i > j  # j's turned hash k matched i: i turned by the inverse of k is j
        k = np.where(swap, np.asarray(INVERSE)[k], k)
        out.append(np.stack([np.minimum(i, j), np.maximum(i, j), dist.astype(np.int64), k]))
    return out


def popcount(x: np.ndarray) -> np.ndarray:
    """Set bits of each uint64."""
    if hasattr(np, "bitwise_count"):  # numpy 2
        return np.bitwise_count(x).astype(np.int64)
    return _BYTE_BITS[x.view(np.uint8).reshape(-1, 8)].sum(1)


_BYTE_BITS = np.array([bin(v).count("1") for v in range(256)], np.int64)


def drops(pairs: Pairs, rank: np.ndarray, n: int) -> np.ndarray:
    """int64 [n]: for each image dropped, the pair (index into ``pairs``) that drops it; -1 for
    the images kept. Greedy in ``rank``: an image goes when one of its pairs holds an image
    earlier in rank that stays, so what stays holds none of ``pairs`` and a copy of a dropped
    image is not dropped for it."""
    because = np.full(n, -1, np.int64)
    for p in np.argsort(rank[pairs.b], kind="stable").tolist():  # an image's fate is settled before its later pairs
        a, b = pairs.a[p], pairs.b[p]
        if because[a] < 0 and because[b] < 0:
            because[b] = p
    return because
