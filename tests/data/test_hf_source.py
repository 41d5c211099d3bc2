"""The hf source on data sets the ``datasets`` library itself wrote: a save_to_disk DatasetDict
(Arrow IPC streams, ClassLabel names in dataset_info.json) and Parquet files in the Hub's layout
(the {bytes, path} image struct, the features in the schema metadata). Read without it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from imgtrain.data.options import PrepareOptions
from imgtrain.data.prepare import prepare
from imgtrain.errors import ImgtrainError
from tests.conftest_data_helpers import png_bytes, read_back

NAMES = ["zebra", "ant", "cat"]  # a ClassLabel's order, not sorted: kept as it is


def image(value: int) -> dict:
    return {"bytes": png_bytes(np.full((8, 8), value, np.uint8)), "path": None}


def pixel_labels(out: Path) -> dict[str, dict[int, int]]:
    """{split: {pixel value: label}} of a prepared data set (every image is one gray value)."""
    return {split: dict(zip(images[:, 0, 0, 0].tolist(), labels.tolist()))
            for split, (ids, labels, images) in read_back(out).items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A DatasetDict saved by ``datasets``: train (two files, a row that is no image, a row
    without a label), validation, test, and a split of unlabelled rows."""
    import datasets

    datasets.disable_progress_bars()
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=NAMES)})

    def split(values, labels=None):
        return datasets.Dataset.from_dict({"image": [image(v) for v in values],
                                           "label": labels or [v % 3 for v in values]}, features=features)

    train = datasets.concatenate_datasets([
        split(range(1, 19)),
        datasets.Dataset.from_dict({"image": [{"bytes": b"junk", "path": None}, image(150)], "label": [0, -1]},
                                   features=features)])
    folder = tmp_path_factory.mktemp("hf") / "saved"
    datasets.DatasetDict({"train": train, "validation": split(range(50, 56)), "test": split(range(60, 66)),
                          "unsupervised": split(range(70, 73), [-1] * 3)}).save_to_disk(
        folder, num_shards={"train": 2, "validation": 1, "test": 1, "unsupervised": 1})
    return folder


def test_a_saved_dataset_dict_keeps_its_splits_class_names_and_lists_bad_rows(saved, tmp_path):
    manifest = prepare("hf", tmp_path / "out", saved)
    assert manifest["classes"] == NAMES
    rows = pixel_labels(tmp_path / "out")
    assert sorted(rows["train"]) == list(range(1, 19))  # the source's splits, whole
    assert sorted(rows["val"]) == list(range(50, 56)) and sorted(rows["test"]) == list(range(60, 66))
    assert all(label == v % 3 for split in rows.values() for v, label in split.items())
    assert manifest["class_counts"]["train"] == [6, 6, 6]
    skipped = dict(manifest["skipped"]["files"])
    assert manifest["skipped"]["count"] == 3  # the bad image, the unlabelled row, the split not read (one entry)
    assert skipped == {"unsupervised/": "split 'unsupervised' is not train, validation or test: not read",
                       "train/data-00001-of-00002.arrow row 9": "no label (-1)",
                       "train/data-00001-of-00002.arrow row 8": "not a PNG or JPEG image"}
    ids = np.concatenate([split[0] for split in read_back(tmp_path / "out").values()])
    assert len(np.unique(ids)) == 30  # ids: rows of the source, unique across its splits
    with pytest.raises(ImgtrainError, match="has its own validation split; drop --val-fraction"):
        prepare("hf", tmp_path / "again", saved, PrepareOptions(val_fraction=0.1))


def test_parquet_files_with_the_image_struct_in_the_hubs_layout(tmp_path):
    import datasets

    features = datasets.Features({"img": datasets.Image(), "animal": datasets.Value("string")})
    for name, values in (("train", range(1, 13)), ("test", range(20, 26))):
        rows = {"img": [image(v) for v in values] + [None], "animal": [["owl", "bee"][v % 2] for v in values] + ["owl"]}
        datasets.Dataset.from_dict(rows, features=features).to_parquet(
            tmp_path / "hub" / "data" / f"{name}-00000-of-00001.parquet")
    # CIFAR-10's layout: the one Image column is found though it is not called "image"
    manifest = prepare("hf", tmp_path / "out", tmp_path / "hub", PrepareOptions(label_column="animal"))
    assert manifest["classes"] == ["bee", "owl"]  # names sorted
    rows = pixel_labels(tmp_path / "out")
    assert sorted(rows["train"]) == list(range(1, 13)) and sorted(rows["test"]) == list(range(20, 26))
    assert all(label == 1 - v % 2 for split in rows.values() for v, label in split.items())
    assert dict(manifest["skipped"]["files"]) == {"data/train-00000-of-00001.parquet row 12": "empty (null) image",
                                                  "data/test-00000-of-00001.parquet row 6": "empty (null) image"}

    # one file, a ClassLabel: its names come from the schema's metadata; the splits are drawn
    labelled = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=NAMES)})
    datasets.Dataset.from_dict({"image": [image(v) for v in range(30)], "label": [v % 3 for v in range(30)]},
                               features=labelled).to_parquet(tmp_path / "one.parquet")
    manifest = prepare("hf", tmp_path / "one", tmp_path / "one.parquet", PrepareOptions(test_fraction=0.2))
    assert manifest["classes"] == NAMES and manifest["class_counts"]["test"] == [2, 2, 2]
    with pytest.raises(ImgtrainError, match="has no column 'label'; available columns: img, animal"):
        prepare("hf", tmp_path / "bad", tmp_path / "hub")
