"""Exact and near duplicates among n fingerprinted images (``fingerprint.py``), found without
comparing all pairs and without holding them: one search for ``data inspect``
(``duplicate_report.py``) and ``data prepare --dedupe`` (``duplicate_drops.py``).

* **Exact**: images with the same content hash are one *group*; its keeper is its first in
  ``rank`` (the image a dedupe keeps: the higher split, then the first in source order).
* **Near**: pHash within ``threshold`` bits (Hamming distance), under any rotation or mirror.
  Only each group's keeper takes part (its copies have the same pixels), and keepers with the
  same 8 turned pHashes are one *class*: n images that share a pHash (blank frames, one
  placeholder saved many ways) are one row of the search, not n^2 / 2 pairs. A near pair of
  classes stands for every pair of their images; images of one class in different groups are
  near pairs at distance 0.
* The search (``Search``): the 64 bits are cut into threshold + 1 disjoint bands (``band_key``):
  two hashes within ``threshold`` bits agree exactly on one band at least (pigeonhole), so the
  candidates of a class are the classes that share a band with one of its 8 turned hashes,
  found by binary search in the band's sorted values; only they get the full distance. With
  random hashes that is about 8 (t + 1) m^2 / 2^(64 / (t + 1)) candidates for m classes
  (t = 4: 0.5 % of m^2); real pHashes are less even (8,000 small photos: 0.8 % of m^2).

Nothing is kept per pair: ``Search.pairs`` hands each near pair of classes over once, in chunks
of at most CANDIDATE_BATCH candidates, to whoever counts, groups or drops. Memory: ``Copies``
(24 bytes an image, 88 a class), the sorted bands (8 bytes a class per band) and one chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from imgtrain.data.fingerprint import INVERSE, UNREADABLE, Prints
from imgtrain.errors import ImgtrainError

DEFAULT_THRESHOLD = 4  # bits of 64: a resized or recompressed copy is 0-2 away, a brightened one ~4
SMALL_GRAY_SIDE = 32  # grayscale images this small (digits) get threshold 0 by default
# Beyond it bands of 7 bits or fewer make the search nearly all-pairs (8,000 small photos: 0.8 %
# of n^2 candidates at 4, 13 % at 6, 63 % at 8) and unrelated images start to match.
MAX_THRESHOLD = 8
QUERY_ROWS = 1 << 14  # classes whose candidates are gathered together
CANDIDATE_BATCH = 1 << 18  # candidates checked at once (a few tens of MB of temporaries)
PAIRS_HELD = 1 << 20  # near pairs of classes kept for a second walk (``Search.pairs``): 26 MB


@dataclass
class Copies:
    """The readable images in exact groups and hash classes. Groups and classes are numbered in
    the rank order of their first image, so a lower class number is a class that comes first."""

    rank: np.ndarray  # int64 [n]: ``rank_of``, lower is kept first
    group: np.ndarray  # int64 [n]: each image's exact group, -1 for an unreadable one
    keeper: np.ndarray  # int64 [g]: each group's first image in rank
    cls: np.ndarray  # int64 [n]: each image's hash class, -1 for an unreadable one
    head: np.ndarray  # int64 [m]: each class's first image in rank
    hashes: np.ndarray  # uint64 [m, 8]: each class's 8 pHashes (column 0 as is, then turned)

    @staticmethod
    def of(prints: Prints, rank: np.ndarray) -> "Copies":
        n = len(rank)
        readable = np.flatnonzero(prints.mode != UNREADABLE)
        keepers_first = readable[np.lexsort((rank[readable], prints.content[readable]))]
        content = prints.content[keepers_first]
        starts = np.r_[True, content[1:] != content[:-1]][:len(content)]
        keeper = keepers_first[starts]
        by_rank = np.argsort(rank[keeper], kind="stable")
        number = np.empty_like(by_rank)
        number[by_rank] = np.arange(len(by_rank))
        group = np.full(n, -1, np.int64)
        group[keepers_first] = number[np.cumsum(starts) - 1]
        keeper = keeper[by_rank]
        # classes: runs of equal rows of the keepers' pHashes, sorted (np.unique(axis=0) holds
        # a few sorted copies of the rows at once; this, one column at a time)
        rows = prints.phash[keeper]
        order = np.lexsort(rows.T[::-1])  # stable: the first keeper of each run is its first in rank
        new, value = np.ones(len(order), bool), None
        for column in rows.T:
            value = column[order]
            new[1:] &= value[1:] == value[:-1]
        new = ~new
        new[:1] = True
        first = order[new]  # each class's first keeper; classes numbered in the order they appear
        in_order = np.argsort(first)
        renumber = np.empty_like(in_order)
        renumber[in_order] = np.arange(len(in_order))
        class_of_group = np.empty(len(order), np.int64)
        class_of_group[order] = renumber[np.cumsum(new) - 1]
        cls = np.full(n, -1, np.int64)
        cls[readable] = class_of_group[group[readable]]
        head = keeper[first[in_order]]
        del rows, value, order  # before the classes' own copy of their rows
        return Copies(rank, group, keeper, cls, head, prints.phash[head])


def rank_of(split_codes: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """int64 [n]: the order a dedupe keeps images in: the test split, then val, then train
    (split codes 2, 1, 0), and within a split by id (the source's order)."""
    return np.lexsort((ids, -split_codes.astype(np.int64))).argsort().astype(np.int64)


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


@dataclass
class Hits:
    """One chunk of the search: class ``q`` turned by ``k`` is ``distance`` bits from class ``c``
    as is (c != q), and they agree on ``band``."""

    q: np.ndarray
    c: np.ndarray
    k: np.ndarray
    band: int
    distance: np.ndarray


@dataclass
class NearPairs:
    """One chunk of near pairs of classes, each pair once: a < b."""

    a: np.ndarray  # int64 [p]
    b: np.ndarray  # int64 [p]
    distance: np.ndarray  # int64 [p]: the fewest bits between one turned and the other as is
    turned: np.ndarray  # bool [p]: closer turned or mirrored than as is


class Search:
    """The near search among the classes' pHashes (``hashes``: uint64 [m, 8])."""

    def __init__(self, hashes: np.ndarray, threshold: int):
        self.hashes, self.threshold, self.count = hashes, threshold, threshold + 1
        self.candidates = 0  # (turned hash, class) candidates checked so far
        self.replay: list[NearPairs] | None = None  # the pairs of a first walk, when they were few
        width = -(-64 // self.count)  # bits of a band
        self.key_type = np.uint64 if width > 32 else np.uint32
        index_type = np.int32 if len(hashes) < 2**31 else np.int64
        self.keys, self.orders = [], []
        for band in range(self.count):
            key = band_key(hashes[:, 0], band, self.count).astype(self.key_type)
            order = np.argsort(key, kind="stable")
            self.keys.append(key[order])
            self.orders.append(order.astype(index_type))
        self.masks = np.array([sum(1 << bit for bit in range(band, 64, self.count)) for band in range(self.count)],
                              np.uint64)

    def hits(self, rows: np.ndarray) -> Iterator[Hits]:
        """The classes within the threshold of each of ``rows`` (int64, any classes), one chunk
        of candidates at a time, band after band."""
        own, turned = self.hashes[:, 0], self.hashes[rows]  # turned: [r, 8]
        flat = turned.ravel()
        for band in range(self.count):
            wanted = band_key(turned, band, self.count).ravel().astype(self.key_type)
            lo = np.searchsorted(self.keys[band], wanted, "left")
            count = np.searchsorted(self.keys[band], wanted, "right") - lo
            self.candidates += int(count.sum())
            for row, c in _candidates(lo, count, self.orders[band]):
                distance = popcount(flat[row] ^ own[c])
                near = np.flatnonzero(distance <= self.threshold)  # few: the rest is done on them
                row, c, distance = row[near], c[near], distance[near].astype(np.int64)
                q = rows[row // 8]
                other = q != c
                yield Hits(q[other], c[other], (row % 8)[other], band, distance[other])

    def pairs(self) -> Iterator[NearPairs]:
        """Every near pair of classes, once, in chunks. A second walk replays the first when it
        held at most PAIRS_HELD pairs, and searches again otherwise."""
        if self.replay is not None:
            yield from self.replay
            return
        held: list | None = []
        count = 0
        for chunk in self._pairs():
            count += len(chunk.a)
            if held is not None and count <= PAIRS_HELD:
                held.append(chunk)
            else:
                held = None
            yield chunk
        self.replay = held

    def _pairs(self) -> Iterator[NearPairs]:
        """A pair is found in each band its hashes agree on, and from both sides; only the first
        band of its closest turn (``closest``), from the side that turns, counts."""
        m = len(self.hashes)
        for start in range(0, m, QUERY_ROWS):
            for hits in self.hits(np.arange(start, min(m, start + QUERY_ROWS))):
                xor = self.hashes[hits.q, hits.k] ^ self.hashes[hits.c, 0]
                first = ((xor[:, None] & self.masks[None, :]) == 0).argmax(1) == hits.band
                q, c, k = hits.q[first], hits.c[first], hits.k[first]
                a, b = np.minimum(q, c), np.maximum(q, c)
                distance, _, code = closest(self.hashes, a, b)
                once = code == np.where(q == a, 0, 8) + k
                a, b, distance = a[once], b[once], distance[once]
                as_is = popcount(self.hashes[a, 0] ^ self.hashes[b, 0]).astype(np.int64)
                yield NearPairs(a, b, distance, as_is > distance)


def _candidates(lo: np.ndarray, count: np.ndarray, order: np.ndarray):
    """(query row, candidate) of each of the ``count`` sorted values from ``lo`` on, at most
    CANDIDATE_BATCH at a time, however many one query has."""
    ends = np.cumsum(count)
    starts = ends - count
    total = int(ends[-1]) if len(ends) else 0
    for start in range(0, total, CANDIDATE_BATCH):
        stop = min(total, start + CANDIDATE_BATCH)
        rows = np.arange(np.searchsorted(ends, start, "right"), np.searchsorted(ends, stop - 1, "right") + 1)
        row = np.repeat(rows, np.minimum(ends[rows], stop) - np.maximum(starts[rows], start))
        yield row, order[lo[row] + np.arange(start, stop) - starts[row]].astype(np.int64)


def closest(hashes: np.ndarray, a: np.ndarray, b: np.ndarray):
    """(distance, transform, code) of classes ``a`` and ``b`` (arrays): the fewest bits between
    one turned and the other as is, the transform (``fingerprint.TRANSFORMS``) that turns a into b
    (the smaller one on a tie), and which hash gave it: code k < 8 is a turned by k, 8 + k is b
    turned by k (then a into b is INVERSE[k])."""
    from_a = popcount(hashes[a] ^ hashes[b, :1]).astype(np.int16)  # [p, 8]
    from_b = popcount(hashes[b] ^ hashes[a, :1]).astype(np.int16)
    key = np.concatenate([from_a * 16 + np.arange(8, dtype=np.int16) * 2,
                          from_b * 16 + np.asarray(INVERSE, np.int16) * 2 + 1], axis=1)
    code = key.argmin(1)
    best = key[np.arange(len(code)), code].astype(np.int64)
    return best // 16, (best % 16) // 2, code


def band_key(hashes: np.ndarray, band: int, count: int) -> np.ndarray:
    """The bits band, band + count, band + 2 count, ... of each uint64, packed: one of ``count``
    disjoint bands. Interleaved, not contiguous: pHash's neighbouring frequencies go together, and
    contiguous bands put 2.7x more candidates in the same buckets (8,000 photos: 2.1 % of n^2 against 0.8 %)."""
    key = np.zeros(hashes.shape, np.uint64)
    for j, bit in enumerate(range(band, 64, count)):
        key |= ((hashes >> np.uint64(bit)) & np.uint64(1)) << np.uint64(j)
    return key


def popcount(x: np.ndarray) -> np.ndarray:
    """Set bits of each uint64 (uint8, any shape)."""
    if hasattr(np, "bitwise_count"):  # numpy 2
        return np.bitwise_count(x)
    x = np.ascontiguousarray(x, np.uint64)
    return _BYTE_BITS[x.view(np.uint8)].reshape(*x.shape, 8).sum(-1, dtype=np.uint8)


_BYTE_BITS = np.array([bin(v).count("1") for v in range(256)], np.uint8)
