"""Multi-label data sets (``data prepare --multi-label``): real tables of real images in, a
format-3 data set out whose readers hand out multi-hot labels; each refusal one line."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from imgtrain.data import format as fmt
from imgtrain.data import stream
from imgtrain.data.options import PrepareOptions
from imgtrain.data.prepare import prepare
from imgtrain.errors import ImgtrainError
from tests.conftest import assert_one_line_error, cli_here
from tests.conftest_data_helpers import save_image
from tests.multilabel_digits import write_digit_grids

ML = dict(multi_label=True, label_column="labels")


@pytest.fixture(scope="module")
def grids(tmp_path_factory) -> Path:
    return write_digit_grids(tmp_path_factory.mktemp("grids"), count=80, size=16)


def csv_rows(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def hot(names: str, classes: list[str]) -> np.ndarray:
    row = np.zeros(len(classes), np.uint8)
    row[[classes.index(n) for n in names.split()]] = 1
    return row


def test_a_csv_of_digit_grids_with_a_split_column(grids, tmp_path):
    out = tmp_path / "out"
    manifest = prepare("list", out, grids, PrepareOptions(split_column="split", **ML))
    rows = csv_rows(grids)
    assert manifest["format_version"] == 3 and manifest["multi_label"] is True
    assert fmt.is_multi_label(fmt.verify_dataset(out))
    classes = manifest["classes"]
    assert classes == sorted({n for r in rows if r["split"] == "train" for n in r["labels"].split()})
    assert manifest["val_split"] == {"from": "source"}  # the table's own val split: none carved
    for split in ("train", "val", "test"):
        mine = [r for r in rows if r["split"] == split]
        assert manifest["splits"][split]["num_samples"] == len(mine)
        expected = np.sum([hot(r["labels"], classes) for r in mine], axis=0, dtype=np.int64)
        assert manifest["class_counts"][split] == expected.tolist()
        sizes = np.bincount([len(r["labels"].split()) for r in mine]).tolist()
        assert manifest["label_set_sizes"][split] == sizes
    assert manifest["label_set_sizes"]["train"][0] > 0  # blank grids: images without a label, counted
    # the streamed reader: uint8 multi-hot [n, K], each image's own labels (ids are the table's rows)
    seen = 0
    for batch in stream.split_batches(out, manifest, "test", None, 16):
        assert batch["label"].dtype == np.uint8 and batch["label"].shape[1] == len(classes)
        for i, label in zip(batch["id"], batch["label"]):
            assert rows[i]["split"] == "test"
            np.testing.assert_array_equal(label, hot(rows[i]["labels"], classes))
            seen += 1
    assert seen == manifest["splits"]["test"]["num_samples"]
    # balanced sampling has no meaning here: said in one line, not a numpy error
    reader = stream.Reader.for_data(out, manifest, class_weights=(1.0,) * len(classes))
    with pytest.raises(ImgtrainError, match="balanced sampling has no meaning for a multi-label"):
        stream.train_tasks(stream.epoch_windows(stream.blocks(out, manifest, "train"), 0, 0, 16), reader)


def pixel_table(path: Path, labels: list, split: list | None = None) -> Path:
    """A Parquet table of 8x8 gray pixel arrays (image k is all value k) and a label column."""
    columns = {"image": pa.array([np.full((8, 8), k, np.uint8).tolist() for k in range(len(labels))]),
               "labels": labels if isinstance(labels, pa.Array) else pa.array(labels)}
    if split is not None:
        columns["split"] = pa.array(split)
    pq.write_table(pa.table(columns), path)
    return path


def test_a_parquet_list_column_is_read_back_multi_hot_by_every_reader(tmp_path):
    names = [["cat", "dog"], ["dog"], [], ["bird", "cat"], ["cat"], ["dog", "bird", "dog"]] * 10
    table = pixel_table(tmp_path / "t.parquet", names)
    out = tmp_path / "out"
    manifest = prepare("parquet", out, table, PrepareOptions(**ML))
    assert manifest["classes"] == ["bird", "cat", "dog"] and manifest["storage"] == "tensor"
    assert manifest["val_split"]["from"] == "train"  # none in the table: carved (at random) as by default
    assert sum(manifest["splits"][s]["num_samples"] for s in ("train", "val", "test")) == 60
    assert manifest["label_set_sizes"]["train"][0] > 0 and len(manifest["label_set_sizes"]["train"]) == 3
    for split in ("train", "val", "test"):
        ids, images, labels = fmt.read_split(out, split)
        assert labels.dtype == np.uint8 and labels.shape == (len(ids), 3)
        for k, (i, label) in enumerate(zip(ids, labels)):
            assert images[k, 0, 0, 0] == i  # image i is row i of the table
            np.testing.assert_array_equal(label, [n in names[i] for n in ("bird", "cat", "dog")])
        assert labels.sum(axis=0).tolist() == manifest["class_counts"][split]
        f, g, _ = stream.blocks(out, manifest, split)[0]
        np.testing.assert_array_equal(fmt.read_labels(Path(f), g, 3), labels[:len(fmt.read_labels(Path(f), g, 3))])


def test_a_list_of_class_ids_and_joined_names_with_another_separator(tmp_path):
    ids = pa.array([[0, 2], [1], [2, 0, 0], []] * 8, pa.list_(pa.int64()))
    manifest = prepare("parquet", tmp_path / "ids", pixel_table(tmp_path / "ids.parquet", ids), PrepareOptions(**ML))
    assert manifest["classes"] == ["0", "1", "2"]
    assert sum(manifest["class_counts"][s][0] for s in manifest["splits"]) == 16
    joined = ["a|b", "b", "", "c|a"] * 8
    manifest = prepare("parquet", tmp_path / "j", pixel_table(tmp_path / "j.parquet", joined),
                       PrepareOptions(label_sep="|", **ML))
    assert manifest["classes"] == ["a", "b", "c"]
    assert sum(sum(manifest["label_set_sizes"][s][0:1]) for s in manifest["splits"]) == 8


def test_split_column_keeps_a_single_label_tables_splits(tmp_path):
    for k in range(12):
        save_image(tmp_path / f"{k}.png", 10 * k)
    rows = [(f"{k}.png", "ab"[k % 2], ["train", "train", "val", "test"][k % 4]) for k in range(12)]
    with open(tmp_path / "t.csv", "w", newline="") as f:
        csv.writer(f).writerows([("path", "label", "part"), *rows])
    manifest = prepare("list", tmp_path / "out", tmp_path / "t.csv", PrepareOptions(split_column="part"))
    assert manifest["format_version"] == 2 and "multi_label" not in manifest
    counts = {s: manifest["splits"][s]["num_samples"] for s in ("train", "val", "test")}
    assert counts == {"train": 6, "val": 3, "test": 3}
    assert manifest["val_split"] == {"from": "source"}
    for split, (ids, _, labels) in ((s, fmt.read_split_file(Path(tmp_path / "out" / f), "encoded").to_pydict().values())
                                    for s in ("train", "val", "test")
                                    for f in manifest["splits"][s]["files"]):
        assert all(rows[i][2] == split and "ab".index(rows[i][1]) == y for i, y in zip(ids, labels))


# ---------------------------------------------------------------------------- refusals


def test_multi_label_on_a_column_of_numbers_is_refused(tmp_path):
    table = pixel_table(tmp_path / "t.parquet", [1, 2, 3, 1])
    with pytest.raises(ImgtrainError, match="--multi-label: label column 'labels' has type int64; expected a list"):
        prepare("parquet", tmp_path / "out", table, PrepareOptions(**ML))


def test_a_separator_that_splits_nothing_is_refused(tmp_path):
    table = pixel_table(tmp_path / "t.parquet", ["a,b", "b", "c,a", "a"] * 4)
    with pytest.raises(ImgtrainError, match=r"--label-sep ' ' splits no label; is the separator right\?"):
        prepare("parquet", tmp_path / "out", table, PrepareOptions(**ML))


def test_a_label_only_in_the_test_split_is_named_with_its_row(grids, tmp_path):
    rows = csv_rows(grids)
    k = next(i for i, r in enumerate(rows) if r["split"] == "test")
    rows[k]["labels"] += " zebra"
    path = grids.parent / "unknown.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["path", "labels", "split"])
        writer.writeheader()
        writer.writerows(rows)
    with pytest.raises(ImgtrainError, match=f"label 'zebra' of line {k + 2} of unknown.csv is not the label of any "
                                            "training image"):
        prepare("list", tmp_path / "out", path, PrepareOptions(split_column="split", **ML))


def test_the_cli_refuses_label_sep_alone_and_multi_label_where_no_table_is(capsys, grids, tmp_path):
    proc = cli_here(capsys, "data", "prepare", "list", str(tmp_path / "o"), "--source", str(grids),
                    "--label-column", "labels", "--label-sep", ",")
    assert_one_line_error(proc, "--label-sep applies to --multi-label")
    proc = cli_here(capsys, "data", "prepare", "folder", str(tmp_path / "o"), "--source", str(grids.parent),
                    "--multi-label")
    assert_one_line_error(proc, "--multi-label/--label-sep only apply to the")
    proc = cli_here(capsys, "data", "prepare", "list", str(tmp_path / "o"), "--source", str(grids),
                    "--label-column", "path", "--split-column", "labels")
    assert_one_line_error(proc, "--split-column 'labels' may only hold train, val or test")


def test_a_manifest_that_says_multi_label_wrongly_is_refused(grids, tmp_path):
    out = tmp_path / "out"
    prepare("list", out, grids, PrepareOptions(split_column="split", **ML))
    manifest = json.loads((out / "manifest.json").read_text())
    for change, expected in (({"multi_label": "yes"}, "multi_label 'yes' is not true or false"),
                             ({"multi_label": False}, "format_version 3 is a multi-label data set's"),
                             ({"label_set_sizes": {"train": [1]}}, "label_set_sizes.train adds up to 1 images")):
        (out / "manifest.json").write_text(json.dumps({**manifest, **change}))
        with pytest.raises(ImgtrainError, match=expected):
            fmt.load_manifest(out)


# ---------------------------------------------------------------------------- hf and webdataset


def pixel_labels(out: Path) -> dict[str, dict[int, list[str]]]:
    """{split: {pixel value: its class names}} of a prepared set of one-gray-value images, read
    by the streamed reader (multi-hot)."""
    manifest = fmt.load_manifest(out)
    found = {}
    for split in manifest["splits"]:
        for batch in stream.split_batches(out, manifest, split, None, 64):
            assert batch["label"].dtype == np.uint8
            found.setdefault(split, {}).update(
                {int(x[0, 0, 0]): [manifest["classes"][k] for k in np.flatnonzero(y)]
                 for x, y in zip(batch["image"], batch["label"])})
    return found


def test_an_hf_dataset_with_a_sequence_of_class_labels_keeps_its_names_and_splits(tmp_path):
    import datasets

    from tests.conftest_data_helpers import png_bytes

    datasets.disable_progress_bars()
    names = ["cat", "dog", "emu"]
    features = datasets.Features({"image": datasets.Image(),
                                  "labels": datasets.Sequence(datasets.ClassLabel(names=names))})

    def split(values):
        return datasets.Dataset.from_dict(
            {"image": [{"bytes": png_bytes(np.full((8, 8), v, np.uint8)), "path": None} for v in values],
             "labels": [[k for k in range(3) if v >> k & 1] for v in values]}, features=features)

    datasets.DatasetDict({"train": split(range(1, 25)), "validation": split(range(40, 48)),
                          "test": split(range(64, 72))}).save_to_disk(tmp_path / "saved")
    manifest = prepare("hf", tmp_path / "out", tmp_path / "saved", PrepareOptions(**ML))
    assert manifest["classes"] == names and manifest["multi_label"] is True
    rows = pixel_labels(tmp_path / "out")
    assert sorted(rows["train"]) == list(range(1, 25)) and sorted(rows["test"]) == list(range(64, 72))
    assert all(labels == [names[k] for k in range(3) if v >> k & 1] for s in rows.values() for v, labels in s.items())
    assert manifest["label_set_sizes"]["val"] == [1, 3, 3, 1]  # 40..47: bits of 0..7

    string_lists = datasets.Features({"image": datasets.Image(),
                                      "labels": datasets.Sequence(datasets.Value("string"))})
    images = [{"bytes": png_bytes(np.full((8, 8), v, np.uint8)), "path": None} for v in range(20)]
    strings = datasets.Dataset.from_dict({"image": images, "labels": [["dog", "cat"][: v % 3] for v in range(20)]},
                                         features=string_lists)
    strings.save_to_disk(tmp_path / "strings")
    manifest = prepare("hf", tmp_path / "out2", tmp_path / "strings", PrepareOptions(**ML))
    assert manifest["classes"] == ["cat", "dog"]
    assert sum(sum(manifest["label_set_sizes"][s][:1]) for s in manifest["splits"]) == 7  # v % 3 == 0: no label


def test_webdataset_json_arrays_and_joined_names(tmp_path):
    from tests.data.shard_files import gray_png, write_shard

    names = ["cat", "dog", "emu"]

    def mine(v):
        return [names[k] for k in range(3) if v >> k & 1]

    src = tmp_path / "shards"
    def tagged(v):
        return {"png": gray_png(v), "json": json.dumps({"tags": mine(v)}).encode()}

    write_shard(src / "train-000.tar", [(f"s{v:03d}", tagged(v)) for v in range(1, 17)])
    write_shard(src / "train-001.tar", [(f"t{v:03d}", {"png": gray_png(v), "txt": ",".join(mine(v)).encode()})
                                       for v in range(17, 33)])
    write_shard(src / "test-000.tar", [(f"u{v:03d}", tagged(v)) for v in range(40, 48)])
    manifest = prepare("webdataset", tmp_path / "out", src, PrepareOptions(multi_label=True, label_column="tags",
                                                                             label_sep=","))
    assert manifest["classes"] == names
    rows = pixel_labels(tmp_path / "out")
    assert sorted(rows["test"]) == list(range(40, 48))
    assert all(labels == mine(v) for s in rows.values() for v, labels in s.items())
    # a label only a test shard has: refused, naming the sample
    write_shard(src / "test-001.tar", [("odd", {"png": gray_png(99), "json": b'{"tags": ["cat", "yak"]}'})])
    with pytest.raises(ImgtrainError, match=r"label 'yak' of test-001.tar:odd.png is not the label of any training"):
        prepare("webdataset", tmp_path / "again", src, PrepareOptions(multi_label=True, label_column="tags",
                                                                       label_sep=","))


# ---------------------------------------------------------------------------- inspect


def test_inspect_counts_labels_their_pairs_and_images_per_number_of_labels(capsys, tmp_path):
    from imgtrain.data.inspection import inspect_dataset

    names = [["cat", "dog"], ["dog"], [], ["bird", "cat", "dog"], ["cat"], ["cat", "dog"]] * 6
    out = tmp_path / "out"
    manifest = prepare("parquet", out, pixel_table(tmp_path / "t.parquet", names), PrepareOptions(**ML))
    result = inspect_dataset(out, out=tmp_path / "page.html", workers=1)
    ml = result["multi_label"]
    assert {s: result["splits"][s]["per_class"] for s in manifest["splits"]} == manifest["class_counts"]
    assert ml["label_set_sizes"] == manifest["label_set_sizes"]
    assert sum(result["splits"][s]["images"] for s in manifest["splits"]) == 36
    assert ml["co_occurrence"] == [{"a": "cat", "b": "dog", "images": 18}, {"a": "bird", "b": "cat", "images": 6},
                                   {"a": "bird", "b": "dog", "images": 6}]
    assert ml["labels_per_image"] == 1.5  # 9 labels per 6 images
    page = (tmp_path / "page.html").read_text()
    assert 'id="label-set-sizes"' in page and "cat + dog" in page
    proc = cli_here(capsys, "data", "inspect", str(out), "--out", str(tmp_path / "p2.html"), "--workers", "1")
    assert proc.returncode == 0, proc.stderr
    assert "labels seen together most: cat+dog 18" in proc.stdout.replace("\n", " ")
