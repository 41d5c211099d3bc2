"""A new data source is one module that registers a spec. Here the whole of one, a .npz file of
images and labels, is registered by this test alone and prepared like the built-in sources."""

from __future__ import annotations

import numpy as np
import pytest

from imgtrain.data.options import PrepareOptions
from imgtrain.data.prepare import prepare
from imgtrain.data.raw import RawDataset, gather
from imgtrain.data.sources import registry
from imgtrain.data.splits import stratified_split
from imgtrain.errors import ImgtrainError
from tests.conftest_data_helpers import read_back


def list_npz(path, opts: PrepareOptions) -> RawDataset:
    """``images`` uint8 [N, H, W, C] and ``labels`` int [N] of a .npz file; ids are row numbers."""
    with np.load(path) as f:
        images, labels = f["images"], f["labels"].astype(np.int64)
    ids = np.arange(len(labels))
    train, test = stratified_split(labels, opts.test_fraction, opts.seed)
    return RawDataset([str(c) for c in range(labels.max() + 1)],
                      gather(images, labels, ids, train), gather(images, labels, ids, test))


NPZ = registry.SourceSpec(name="npz", summary="images and labels in a .npz file", lister=list_npz, source="FILE")


@pytest.fixture
def npz_source(monkeypatch):
    monkeypatch.setattr(registry, "SOURCES", dict(registry.SOURCES))  # registered for this test only
    registry.register(NPZ)


def test_a_source_registered_in_one_file_is_prepared_checked_and_described(tmp_path, npz_source):
    images = np.random.default_rng(0).integers(0, 256, (20, 8, 8, 1), dtype=np.uint8)
    np.savez(tmp_path / "digits.npz", images=images, labels=np.arange(20) % 2)
    manifest = prepare("npz", tmp_path / "out", tmp_path / "digits.npz", PrepareOptions(test_fraction=0.25))
    assert manifest["source"].startswith("npz:") and manifest["image_shape"] == [8, 8, 1]
    splits = read_back(tmp_path / "out")
    assert [len(splits[s][0]) for s in ("train", "test")] == [14, 6]  # 10 per class * 0.25 rounds up
    for ids, labels, x in splits.values():
        assert np.array_equal(x, images[ids]) and np.array_equal(labels, ids % 2)
    # the registry's checks and help know it, and no other file does
    with pytest.raises(ImgtrainError, match="'npz' needs --source PATH.*--path-column only applies to the list"):
        prepare("npz", tmp_path / "again", None, PrepareOptions(path_column="file"))
    assert "npz: images and labels in a .npz file: --source FILE" in registry.help_lines()


def test_an_unknown_source_and_a_name_registered_twice_are_refused(npz_source):
    with pytest.raises(ImgtrainError, match="unknown data source 'cifar'; choose one of: .*, list, webdataset, hf, npz$"):
        registry.get("cifar")
    with pytest.raises(ValueError, match="registered twice"):
        registry.register(NPZ)
