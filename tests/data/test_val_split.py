"""`data prepare`'s default validation split: carved from the training images (stratified,
seeded) when the source has none, so that training selects its best checkpoint on it and the
test split is first seen by `evaluate`; none, and said so, when a class is too small or
`--val-fraction 0` asks for none."""

from __future__ import annotations

import json

import numpy as np

from imgtrain.data.options import PrepareOptions
from imgtrain.data.prepare import prepare
from tests.conftest import cli_here
from tests.conftest_data_helpers import read_back, save_image


def photo_folder(root, counts: dict[str, int]):
    """Gray 8x8 PNGs, ``counts[c]`` in class folder ``c``, each a different value."""
    value = 0
    for c, n in counts.items():
        for i in range(n):
            save_image(root / c / f"{i:03d}.png", value % 256)
            value += 1
    return root


def ids_of(data_dir) -> dict[str, set]:
    return {split: set(ids.tolist()) for split, (ids, _, _) in read_back(data_dir).items()}


def test_prepare_carves_a_stratified_seeded_val_split_from_train_by_default(tmp_path, capsys):
    src = photo_folder(tmp_path / "src", {"ant": 30, "bee": 30, "cat": 30})
    proc = cli_here(capsys, "data", "prepare", "folder", str(tmp_path / "d"), "--source", str(src), "--workers", "1")
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    # a tenth of the 90 images, drawn from the 72 training ones: 3 of each class's 24
    assert manifest["class_counts"] == {"train": [21] * 3, "val": [3] * 3, "test": [6] * 3}
    assert manifest["val_split"] == {"from": "train", "fraction": 0.1, "default": True}
    assert manifest["options"]["val_fraction"] == 0.1
    assert "63 train (21 per class), 9 val (3 per class, carved from train), 18 test (6 per class)" in proc.stdout
    carved = ids_of(tmp_path / "d")
    assert not carved["val"] & (carved["train"] | carved["test"])

    # seeded: the same seed draws the same split, another seed another one
    prepare("folder", tmp_path / "again", src, PrepareOptions(workers=1))
    assert ids_of(tmp_path / "again") == carved
    prepare("folder", tmp_path / "seed1", src, PrepareOptions(workers=1, seed=1))
    assert ids_of(tmp_path / "seed1")["val"] != carved["val"]

    # --val-fraction 0: no validation split, said so; the test split is the very same one
    none = cli_here(capsys, "data", "prepare", "folder", str(tmp_path / "none"), "--source", str(src), "--workers", "1",
                    "--val-fraction", "0")
    assert none.returncode == 0, none.stderr
    manifest = json.loads((tmp_path / "none" / "manifest.json").read_text())
    assert set(manifest["splits"]) == {"train", "test"}
    assert manifest["val_split"] == {"from": None, "why": "--val-fraction 0"}
    assert "no val split (--val-fraction 0): training will pick its best checkpoint on the test split" in none.stdout
    kept = ids_of(tmp_path / "none")
    assert kept["test"] == carved["test"] and kept["train"] == carved["train"] | carved["val"]


def test_no_default_val_split_when_a_class_has_too_few_training_images(tmp_path):
    src = photo_folder(tmp_path / "src", {"big": 40, "small": 11})  # small: 2 to test, 9 left to train on
    manifest = prepare("folder", tmp_path / "d", src, PrepareOptions(workers=1))
    assert set(manifest["splits"]) == {"train", "test"}
    why = "class 'small' has only 9 training image(s); the default carves one when every class has 10 or more"
    assert manifest["val_split"] == {"from": None, "why": why}
    from imgtrain.data.format import describe

    assert f"no val split ({why}): training will pick its best checkpoint on the test split" in describe(manifest)
    # asked for, it is carved anyway: every class keeps one validation image at least
    asked = prepare("folder", tmp_path / "asked", src, PrepareOptions(workers=1, val_fraction=0.1))
    assert asked["class_counts"]["val"] == [4, 1] and asked["val_split"]["default"] is False


def test_a_source_with_its_own_test_split_gets_its_val_split_from_its_training_images(tmp_path):
    for split, n in (("train", 20), ("test", 5)):
        photo_folder(tmp_path / "src" / split, {"x": n, "y": n})
    manifest = prepare("folder", tmp_path / "d", tmp_path / "src", PrepareOptions(workers=1))
    assert manifest["class_counts"] == {"train": [18, 18], "val": [2, 2], "test": [5, 5]}
    assert np.array_equal(sorted(ids_of(tmp_path / "d")["test"]), np.arange(10))  # the source's own, untouched


def test_a_manifests_val_split_record_is_shown_as_short_text_whatever_it_holds(tmp_path):
    from imgtrain.data.format import describe

    src = photo_folder(tmp_path / "src", {"a": 5, "b": 5})
    manifest = prepare("folder", tmp_path / "d", src, PrepareOptions(workers=1))
    for record, shown in (({"from": None, "why": "x" * 10_000}, "x" * 200 + "): "), ([1, 2], "(prepared without one)"),
                          ({"why": 7}, "(prepared without one)")):
        text = describe({**manifest, "val_split": record})
        assert shown in text and len(text) < 1_000
