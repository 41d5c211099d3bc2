"""The duplicate index shared by `data inspect` and `data prepare --dedupe`: exact copies by
content hash, near ones by pHash under rotation and mirroring, found without comparing all pairs."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from imgtrain.data import duplicates
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


def test_near_pairs_match_brute_force_and_check_far_fewer_than_all_pairs():
    n, rng = 2000, np.random.default_rng(1)
    prints = random_prints(n)
    planted = {}
    for k, distance in enumerate([0, 1, 2, 3, 4, 5, 6, 9]):  # the last three are over the threshold of 4
        a, b, turn = 10 * k, 10 * k + 5, k % 8
        prints.phash[b, 0] = flip_bits(prints.phash[a, turn], distance, rng)  # b is a turned, a few bits off
        planted[(a, b)] = (distance, turn)
    pairs = duplicates.find_pairs(prints, np.arange(n), threshold=4)
    found = {(int(a), int(b)): (int(d), int(t)) for a, b, d, t in zip(pairs.a, pairs.b, pairs.distance, pairs.transform)}
    assert set(found) == brute_force(prints, 4)
    for (a, b), (distance, turn) in planted.items():
        if distance <= 4:
            assert found[(a, b)] == (distance, turn)
        else:
            assert (a, b) not in found
    assert not pairs.exact.any()
    assert pairs.candidates < n * n / 50  # ~20k of the 4M a full comparison makes


def test_exact_copies_pair_with_the_first_in_rank_and_their_near_pairs_reach_every_copy():
    prints = random_prints(6)
    prints.content[[1, 3, 4]] = prints.content[1]  # three copies of one image
    prints.phash[[3, 4]] = prints.phash[1]
    prints.phash[5, 0] = flip_bits(prints.phash[1, 0], 2, np.random.default_rng(0))  # near the three copies
    rank = np.array([0, 4, 1, 3, 5, 2])  # image 5 comes before every copy, image 3 first of the copies
    pairs = duplicates.find_pairs(prints, rank, threshold=4)
    listed = sorted(zip(pairs.a.tolist(), pairs.b.tolist(), pairs.exact.tolist()))
    assert listed == sorted([(3, 1, True), (3, 4, True), (5, 1, False), (5, 3, False), (5, 4, False)])


def test_unreadable_images_are_never_paired():
    prints = random_prints(3)
    prints.content[:] = 7
    prints.mode[2] = Prints.empty(1).mode[0]  # unreadable
    pairs = duplicates.find_pairs(prints, np.arange(3))
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
    pairs = duplicates.find_pairs(prints, np.arange(len(variants)))
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
    rank = np.arange(4)
    pairs = duplicates.find_pairs(prints, rank, threshold=4)
    assert sorted(zip(pairs.a.tolist(), pairs.b.tolist())) == [(0, 1), (1, 2)]
    because = duplicates.drops(pairs, rank, 4)
    assert (because >= 0).tolist() == [False, True, False, False]  # 2's only match, 1, is gone


@pytest.mark.parametrize("bad", [-1, 9, 2.5, "3"])
def test_thresholds_outside_0_to_8_are_refused(bad):
    from imgtrain.errors import ImgtrainError

    with pytest.raises(ImgtrainError, match="--near-threshold"):
        duplicates.check_threshold(bad)
