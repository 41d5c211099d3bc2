"""The photo augmentations after the crop (--augment-policy, --color-jitter, --random-erasing):
each image's transformation depends on (seed, step, place in the global batch) only, so any rank
at any world size decodes the same training image, and nothing else's random numbers move."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from imgtrain.data import photo_augment, stream
from imgtrain.data.photo_augment import PhotoAugment
from imgtrain.data.format import load_manifest
from imgtrain.data.options import PrepareOptions
from imgtrain.data.prepare import prepare
from tests.integration.test_streamed import make_photos

EVERYTHING = PhotoAugment("randaugment", 9, 0.4, 0.5, (120, 110, 100))


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    root = tmp_path_factory.mktemp("aug-photos")
    make_photos(root / "src", per_class=6)
    prepare("folder", root / "data", root / "src", PrepareOptions(size=(24, 24), val_fraction=0.0))
    return root / "data"


def decoded(data, aug: PhotoAugment, world: int, rank: int, seed: int = 0) -> dict[int, np.ndarray]:
    """Epoch 0's training images of one rank, by row id, as its decoding tasks make them."""
    manifest = load_manifest(data)
    batch, n = 8, manifest["splits"]["train"]["num_samples"]
    reader = stream.Reader.for_data(data, manifest, seed=seed, global_batch=batch,
                                    positions_end=(n // batch) * batch, world=world, rank=rank,
                                    photo_augment=aug)
    windows = stream.epoch_windows(stream.blocks(data, manifest, "train"), seed, 0, stream.window_blocks(manifest))
    out = {}
    for task in stream.train_tasks(windows, reader):
        rows = stream.read_task(task, reader)
        out.update(zip(rows["id"].tolist(), rows["image"]))
    return out


def test_every_option_gives_each_image_the_same_transformation_at_any_world_size(photos):
    one = decoded(photos, EVERYTHING, world=1, rank=0)
    two = {**decoded(photos, EVERYTHING, world=2, rank=0), **decoded(photos, EVERYTHING, world=2, rank=1)}
    assert one.keys() == two.keys() and len(one) == 16
    for i in one:
        np.testing.assert_array_equal(one[i], two[i])
    plain = decoded(photos, PhotoAugment(), world=1, rank=0)
    changed = sum(not np.array_equal(one[i], plain[i]) for i in one)
    assert changed >= 14, changed  # the options did transform (erasing and jitter may spare a few)
    other_seed = decoded(photos, EVERYTHING, world=1, rank=0, seed=1)
    assert any(not np.array_equal(one[i], other_seed[i]) for i in one)


@pytest.mark.parametrize("policy", ["randaugment", "trivialaugment", "autoaugment"])
def test_each_policy_is_a_pure_function_of_its_seed_and_leaves_torchs_generator_alone(policy):
    image = np.random.default_rng(0).integers(0, 256, (24, 24, 3), dtype=np.uint8)
    aug = PhotoAugment(policy)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    outs = [photo_augment.apply(aug, image, seed) for seed in range(12)]
    assert torch.equal(torch.get_rng_state(), state)  # the training's own numbers did not move
    assert all(o.shape == image.shape and o.dtype == np.uint8 for o in outs)
    np.testing.assert_array_equal(photo_augment.apply(aug, image, 5), outs[5])
    assert len({o.tobytes() for o in outs}) > 6  # the seeds choose different operations
    gray = photo_augment.apply(aug, image[..., :1], 3)
    assert gray.shape == (24, 24, 1)


def test_erasing_paints_a_rectangle_of_the_data_sets_mean_colour():
    image = np.zeros((32, 32, 3), np.uint8)
    out = photo_augment.apply(PhotoAugment(erasing=1.0, fill=(120, 110, 100)), image, 7)
    erased = np.all(out == (120, 110, 100), axis=-1)
    rows, cols = np.flatnonzero(erased.any(1)), np.flatnonzero(erased.any(0))
    assert erased.sum() == len(rows) * len(cols) > 0  # one filled rectangle
    assert np.all(out[~erased] == 0)


def test_the_default_recipe_stays_as_it_was():
    assert not PhotoAugment().active
    assert dataclasses.replace(PhotoAugment(), color_jitter=0.1).active


def test_photo_options_on_digits_are_refused_before_training(tiny_data, tmp_path, capsys):
    from tests.conftest import assert_one_line_error, cli_here

    proc = cli_here(capsys, "train", "--data", str(tiny_data), "--storage", str(tmp_path), "--name", "d",
                    "--backend", "local", "--augment-policy", "randaugment")
    assert_one_line_error(proc, "--augment-policy", "digits preset")
    assert not (tmp_path / "d").exists()


def test_every_policy_the_setting_offers_has_a_transform():
    from imgtrain.config import AUGMENT_POLICIES
    from imgtrain.data.photo_augment import POLICIES

    assert set(AUGMENT_POLICIES) == {"none", *POLICIES}
