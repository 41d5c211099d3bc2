"""The duplicate index shared by `data inspect` and `data prepare --dedupe`: exact copies by
content hash, near ones by pHash under rotation and mirroring, found without comparing all pairs."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from imgtrain.data import duplicate_drops, duplicate_report, duplicates
from imgtrain.data.fingerprint import TRANSFORM_WORDS, TRANSFORMS, Prints, fingerprint_encoded
from tests.data.planted import photo


def random_prints(n: int, seed: int = 0) -> Prints:
    """n images with random content hashes and random (unrelated) pHashes for each turn."""
    rng = np.random.default_rng(seed)
    prints = Prints.empty(n)
    prints.mode[:] = 5  # RGB: readable
    prints.content[:] = rng.integers(1, 2**63, n, dtype=np.int64).astype(np.uint64)
    prints.phash[:] = rng.integers(0, 2**63, (n, 8), dtype=np.int64).astype(np.uint64) << np.uint64(1)
    prints.phash[:] |= rng.integers(0, 2, (n, 8)).astype(np.uint64)
    return prints


def flip_bits(value, count: int, rng) -> np.uint64:
    mask = sum(1 << int(b) for b in rng.choice(64, count, replace=False))
    return np.uint64(int(value) ^ mask)


def brute_force(prints: Prints, threshold: int) -> set[tuple[int, int]]:
    """Every pair within the threshold under any turn, by comparing all of them."""
    found = set()
    own = prints.phash[:, 0]
    for i in range(len(own)):
        dist = duplicates.popcount((prints.phash[i][:, None] ^ own[None, :]).ravel()).reshape(8, -1).min(0)
        found |= {(min(i, j), max(i, j)) for j in np.flatnonzero(dist <= threshold).tolist() if j != i}
    return found


def all_pairs(prints: Prints, rank: np.ndarray, threshold: int) -> dict[tuple[int, int], bool]:
    """{(i, j): exact} of every duplicate pair (i < j, by position) as the search defines them, by
    comparing all pairs: an exact group is its first image in rank with each other one, and a
    near pair of images stands for every pair of their copies."""
    readable = np.flatnonzero(prints.mode != Prints.empty(1).mode[0])
    keeper = {}
    for i in readable[np.argsort(rank[readable])].tolist():
        keeper.setdefault(int(prints.content[i]), i)
    out = {}
    for i in readable.tolist():
        k = keeper[int(prints.content[i])]
        if k != i:
            out[min(i, k), max(i, k)] = True
    for i, j in brute_force(prints, threshold):
        if i in readable and j in readable and prints.content[i] != prints.content[j]:
            out[i, j] = False
    return out


def report_of(prints, rank=None, threshold=4, limit=10**6, split=None, labels=None):
    n = len(prints.content)
    split = np.zeros(n, np.int8) if split is None else split
    return duplicate_report.report(prints, np.arange(n) if rank is None else rank, split,
                                   np.zeros(n, np.int64) if labels is None else labels, threshold, limit)


def test_near_pairs_are_found_once_match_brute_force_and_check_far_fewer_than_all_pairs():
    n, rng = 2000, np.random.default_rng(1)
    prints = random_prints(n)
    planted = {}
    for k, distance in enumerate([0, 1, 2, 3, 4, 5, 6, 9]):  # the last three are over the threshold of 4
        a, b, turn = 10 * k, 10 * k + 5, k % 8
        prints.phash[b, 0] = flip_bits(prints.phash[a, turn], distance, rng)  # b is a turned, a few bits off
        planted[(a, b)] = (distance, turn)
    copies = duplicates.Copies.of(prints, np.arange(n))
    assert (copies.head == np.arange(n)).all()  # one image a class, numbered in rank order
    search = duplicates.Search(copies.hashes, 4)
    chunks = list(search.pairs())
    a, b = (np.concatenate([getattr(c, f) for c in chunks]) for f in "ab")
    found = list(zip(a.tolist(), b.tolist()))
    assert len(found) == len(set(found)) and set(found) == brute_force(prints, 4)  # each pair once
    distance, transform, _ = duplicates.closest(copies.hashes, a, b)
    by_pair = dict(zip(found, zip(distance.tolist(), transform.tolist())))
    for (a, b), (distance, turn) in planted.items():
        if distance <= 4:
            assert by_pair[(a, b)] == (distance, turn)
        else:
            assert (a, b) not in by_pair
    assert search.candidates < n * n / 50  # ~20k of the 4M a full comparison makes


def test_exact_copies_pair_with_the_first_in_rank_and_their_near_pairs_reach_every_copy():
    prints = random_prints(6)
    prints.content[[1, 3, 4]] = prints.content[1]  # three copies of one image
    prints.phash[[3, 4]] = prints.phash[1]
    prints.phash[5, 0] = flip_bits(prints.phash[1, 0], 2, np.random.default_rng(0))  # near the three copies
    rank = np.array([0, 4, 1, 3, 5, 2])  # image 5 comes before every copy, image 3 first of the copies
    pairs = report_of(prints, rank).examples
    listed = sorted(zip(pairs.a.tolist(), pairs.b.tolist(), pairs.exact.tolist()))
    assert listed == sorted([(3, 1, True), (3, 4, True), (5, 1, False), (5, 3, False), (5, 4, False)])


def test_unreadable_images_are_never_paired():
    prints = random_prints(3)
    prints.content[:] = 7
    prints.mode[2] = Prints.empty(1).mode[0]  # unreadable
    pairs = report_of(prints).examples
    assert list(zip(pairs.a.tolist(), pairs.b.tolist())) == [(0, 1)]


def encoded(im: Image.Image, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    im.save(out, format=fmt, quality=90)
    return out.getvalue()


def test_a_turned_mirrored_or_recompressed_photo_is_a_near_copy_and_another_photo_is_not():
    rng = np.random.default_rng(3)
    original, other = photo(rng, 64), photo(rng, 64)
    names = ["ROTATE_90", "ROTATE_180", "ROTATE_270", "FLIP_LEFT_RIGHT"]
    variants = [encoded(original), encoded(original)]  # an exact copy
    variants += [encoded(original.transpose(getattr(Image.Transpose, name))) for name in names]
    variants += [encoded(original.resize((48, 48)), "JPEG"), encoded(other)]
    prints = Prints.empty(len(variants))
    for k, data in enumerate(variants):
        fingerprint_encoded(data, prints, k)
    pairs = report_of(prints).examples
    with_first = {int(b): (bool(e), TRANSFORM_WORDS[t], int(d))
                  for a, b, e, t, d in zip(pairs.a, pairs.b, pairs.exact, pairs.transform, pairs.distance) if a == 0}
    assert with_first[1] == (True, "as is", 0)
    for k, name in enumerate(names, start=2):
        exact, turn, distance = with_first[k]
        assert not exact and turn == TRANSFORM_WORDS[TRANSFORMS.index(name)] and distance <= 1, (name, with_first[k])
    assert with_first[6][1] == "as is" and with_first[6][2] <= 2  # smaller, as a JPEG
    assert 7 not in with_first and 7 not in pairs.b  # an unrelated photo


def test_drops_keep_the_first_in_rank_and_never_drop_for_a_dropped_image():
    prints = random_prints(4)
    rng = np.random.default_rng(5)
    prints.phash[1, 0] = flip_bits(prints.phash[0, 0], 1, rng)  # 0 ~ 1
    prints.phash[2, 0] = flip_bits(prints.phash[1, 0], 4, rng)  # 1 ~ 2, and 0 is 5 bits from 2
    copies = duplicates.Copies.of(prints, np.arange(4))
    assert sorted(zip(*(p.tolist() for p in (report_of(prints).examples.a, report_of(prints).examples.b)))) == \
        [(0, 1), (1, 2)]
    dropped_for = duplicate_drops.dropped_for(copies, np.zeros(4, np.int8), 4, "all")
    assert dropped_for.tolist() == [-1, 0, -1, -1]  # 2's only match, 1, is gone


def planted_prints(n: int, seed: int):
    """Random fingerprints with planted exact copies, shared pHashes, near (turned) ones, chains
    of them and unreadable images, in random splits and labels."""
    rng = np.random.default_rng(seed)
    prints = random_prints(n, seed)
    for _ in range(n // 8):
        a, b = rng.integers(0, n, 2)
        kind = rng.integers(0, 4)
        if kind == 0:  # an exact copy
            prints.content[b], prints.phash[b] = prints.content[a], prints.phash[a]
        elif kind == 1:  # other bytes, the same pHashes
            prints.phash[b] = prints.phash[a]
        else:  # a turned a few bits off, only one way round: b's own turned hashes stay random
            prints.phash[b, 0] = flip_bits(prints.phash[a, rng.integers(0, 8)], int(rng.integers(0, 6)), rng)
    _, first, group = np.unique(prints.content, return_index=True, return_inverse=True)
    prints.phash[:] = prints.phash[first[group]]  # the same bytes: the same pHashes
    prints.mode[rng.integers(0, n, n // 40)] = Prints.empty(1).mode[0]
    return prints, rng.integers(0, 3, n).astype(np.int8), rng.integers(0, 3, n)


def greedy(pairs: dict, rank: np.ndarray, split: np.ndarray, mode: str) -> dict[int, set[int]]:
    """{dropped image: the kept images it duplicates}: each image in rank order goes when one of
    its duplicates earlier in rank stays (cross-split: only pairs across splits count)."""
    near = {}
    for i, j in pairs:
        if mode == "all" or split[i] != split[j]:
            near.setdefault(i, set()).add(j)
            near.setdefault(j, set()).add(i)
    gone: dict[int, set[int]] = {}
    for b in np.argsort(rank).tolist():
        kept = {a for a in near.get(b, ()) if rank[a] < rank[b] and a not in gone}
        if kept:
            gone[b] = kept
    return gone


@pytest.mark.parametrize("seed", range(6))
def test_counts_groups_and_drops_match_a_comparison_of_all_pairs(seed, monkeypatch):
    """Small batches everywhere, so that pairs meet across the search's batches and chunks; on
    odd seeds nothing is held for a second look (the search runs again)."""
    monkeypatch.setattr(duplicates, "QUERY_ROWS", 13)
    monkeypatch.setattr(duplicates, "CANDIDATE_BATCH", 50)
    monkeypatch.setattr(duplicate_drops, "MIS_ROWS", 7)
    if seed % 2:
        monkeypatch.setattr(duplicates, "PAIRS_HELD", 0)
        monkeypatch.setattr(duplicate_drops, "LATER_HELD", 0)
    n, threshold = 300, (0, 2, 4)[seed % 3]
    prints, split, labels = planted_prints(n, seed)
    rank = duplicates.rank_of(split, np.arange(n))
    pairs = all_pairs(prints, rank, threshold)
    found = report_of(prints, rank, threshold, split=split, labels=labels)
    counts = {where: {kind: sum(1 for (i, j), exact in pairs.items() if exact == (kind == "exact")
                                and (split[i] != split[j]) == (where == "cross_split"))
                      for kind in ("exact", "near")} for where in ("cross_split", "within_split")}
    assert found.counts == counts and found.pairs_total == len(pairs)
    assert found.different_labels == sum(labels[i] != labels[j] for i, j in pairs)
    examples = set(zip(found.examples.a.tolist(), found.examples.b.tolist()))
    assert examples == {(i, j) if rank[i] < rank[j] else (j, i) for i, j in pairs}  # every class is small
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    i, j = np.array(list(pairs), np.int64).reshape(-1, 2).T
    component = connected_components(coo_matrix((np.ones(len(i)), (i, j)), shape=(n, n)), directed=False)[1]
    size = np.bincount(component)
    assert found.groups_total == (size > 1).sum() and found.images_involved == size[size > 1].sum()
    for group in found.groups:
        members = np.flatnonzero(component == component[group["members"][0]])
        assert group["images"] == len(members)
        assert group["per_split"] == np.bincount(split[members], minlength=3).tolist()
        assert group["members"] == sorted(members.tolist(), key=lambda k: rank[k])[:duplicate_report.GROUP_IMAGES]
    copies = duplicates.Copies.of(prints, rank)
    for mode in ("all", "cross-split"):
        want = greedy(pairs, rank, split, mode)
        got = duplicate_drops.dropped_for(copies, split, threshold, mode)
        assert set(np.flatnonzero(got >= 0).tolist()) == set(want), mode
        assert all(got[b] == min(kept, key=lambda a: rank[a]) for b, kept in want.items())  # the first kept


def test_a_class_of_many_images_lists_pairs_of_a_few_spread_over_its_splits_and_labels():
    n = 400
    prints = random_prints(n)
    prints.phash[:] = prints.phash[0]  # 400 images, other bytes, one pHash: 79,800 pairs
    split, labels = np.repeat([2, 0], [10, n - 10]).astype(np.int8), np.arange(n) % 4
    found = report_of(prints, duplicates.rank_of(split, np.arange(n)), split=split, labels=labels, limit=50)
    assert found.pairs_total == n * (n - 1) // 2 and found.counts["cross_split"]["near"] == 10 * (n - 10)
    assert found.groups_total == 1 and found.largest_group == n and found.groups[0]["per_split"] == [390, 0, 10]
    shown = set(found.examples.a.tolist()) | set(found.examples.b.tolist())
    assert len(found.examples) == 50 and len(shown) <= duplicate_report.SHOWN_IMAGES
    assert found.examples.distance.max() == 0 and not found.examples.exact.any()
    assert all(split[found.examples.a] != split[found.examples.b])  # across splits first
    assert {int(labels[k]) for k in shown} == {0, 1, 2, 3} and {int(split[k]) for k in shown} == {0, 2}


SHARED_PHASH = """
import json, resource, sys
import numpy as np
from imgtrain.data.fingerprint import Prints
n = int(sys.argv[1])
prints = Prints.empty(n)
prints.mode[:] = 5  # RGB
prints.content[:] = np.arange(1, n + 1, dtype=np.uint64)  # n different files...
prints.phash[:] = np.arange(3, 11, dtype=np.uint64) * 0x9E3779B97F4A7C15  # ...that share one pHash
split = np.repeat(np.array([2, 0], np.int8), [n // 10, n - n // 10])
labels = np.arange(n) % 3
# VmHWM, this program's own peak (ru_maxrss would start at the pytest process's it was forked from)
peak_kib = lambda: int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1])
before = peak_kib()
size = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize:")).split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (size + (1 << 30),) * 2)  # quadratic memory fails at once
out = {}
if sys.argv[2] == "inspect":
    from pathlib import Path
    from imgtrain.data.inspection import findings
    from imgtrain.data.inspection_scan import Scan
    manifest = {"classes": ["a", "b", "c"], "name": "shared", "source": "test", "storage": "encoded",
                "image_shape": None, "splits": {"train": {}, "test": {}}}
    scan = Scan(split, np.arange(n), labels.astype(np.int32), np.zeros(n, np.uint32), np.zeros(n, np.uint32),
                prints, [])
    out = findings(Path("shared"), manifest, scan, 4, 0)[0]["duplicates"]
    out = {k: out[k] for k in ("counts", "pairs_total", "pairs_listed", "images_involved")}
else:
    from imgtrain.data import dedupe
    from imgtrain.data.listing import Chunk, Listing
    from imgtrain.data.options import PrepareOptions
    names = [f"=cat/{k}.png" for k in range(n)]
    listed = Listing(["a", "b", "c"], labels, [Chunk(0, names, list)])
    dropped = dedupe.choose(listed, split, prints, PrepareOptions(dedupe=sys.argv[2]))
    out = {"summary": dropped.summary, "rows": dropped.listing_csv.count(chr(10)) - 1}
out["grew_mib"] = (peak_kib() - before) / 1024
print(json.dumps(out))
"""


@pytest.mark.parametrize("what", ["inspect", "all", "cross-split"])
def test_images_sharing_one_phash_cost_memory_by_image_not_by_pair(what):
    """20,000 different files with one pHash are 200 M near pairs: a list of them (5 GB and
    more) fails under the child's limit of 1 GB more than it starts with."""
    import json
    import subprocess
    import sys

    n = 20_000
    proc = subprocess.run([sys.executable, "-c", SHARED_PHASH, str(n), what], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["grew_mib"] < 120, out
    if what == "inspect":
        test = n // 10
        assert out["counts"] == {"cross_split": {"exact": 0, "near": test * (n - test)},
                                 "within_split": {"exact": 0, "near": test * (test - 1) // 2
                                                  + (n - test) * (n - test - 1) // 2}}
        assert out["pairs_total"] == n * (n - 1) // 2 and out["images_involved"] == n
    elif what == "all":
        assert out["summary"]["dropped"] == out["rows"] == n - 1  # the first test image stays
    else:
        assert out["summary"]["by_split"] == {"train": n - n // 10, "val": 0, "test": 0}


@pytest.mark.parametrize("bad", [-1, 9, 2.5, "3"])
def test_thresholds_outside_0_to_8_are_refused(bad):
    from imgtrain.errors import ImgtrainError

    with pytest.raises(ImgtrainError, match="--near-threshold"):
        duplicates.check_threshold(bad)
