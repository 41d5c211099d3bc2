"""The webdataset source on real tar shards written here with tarfile: samples grouped by key,
the three label conventions, the shards' own splits, brace patterns and globs, and bad samples
and a cut-short shard skipped and listed."""

from __future__ import annotations

import gzip
import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from imgtrain.data.options import PrepareOptions
from imgtrain.data.prepare import prepare
from imgtrain.data.shard_patterns import expand_braces
from imgtrain.data.tar_members import ShardScan
from imgtrain.errors import ImgtrainError
from tests.conftest import cli_here
from tests.conftest_data_helpers import png_bytes
from tests.data.shard_files import all_rows, gray_png, write_shard


class Planted:
    """Unpickling this would create a file: the test shows no shard member is ever unpickled."""

    target = ""

    def __reduce__(self):
        return (Path.touch, (Path(self.target),))


def test_shards_keep_their_splits_and_bad_samples_and_a_cut_shard_are_listed(tmp_path):
    names = ["cat", "dog", "emu"]

    def sample(v: int, how: str = "txt"):  # the class is v % 3, as a .txt name or a .json field
        label = names[v % 3].encode() if how == "txt" else json.dumps({"label": names[v % 3], "w": 8}).encode()
        return f"s{v:04d}", {"png": gray_png(v), how: label}

    src = tmp_path / "shards"
    Planted.target = str(tmp_path / "unpickled")
    write_shard(src / "train-000.tar", [sample(v) for v in range(1, 13)] + [
        ("broken", {"png": b"not a png", "txt": b"cat"}),  # undecodable image
        ("nolabel", {"png": gray_png(200)}),  # no label at all
        ("orphan", {"txt": b"dog"}),  # a label without an image
        ("s0100", {"png": gray_png(100), "txt": b"cat", "pyd": pickle.dumps(Planted())}),  # .pyd never unpickled
    ])
    write_shard(src / "train-001.tar", [sample(v, "json") for v in range(13, 25)])
    write_shard(src / "test-000.tar", [sample(v) for v in range(30, 36)])
    cut = write_shard(src / "train-002.tar", [sample(v) for v in range(40, 50)])
    data = cut.read_bytes()
    cut.write_bytes(data[:data.index(gray_png(45)) + 20])  # inside the sixth image: s0040-s0044 are whole

    manifest = prepare("webdataset", tmp_path / "out", src, PrepareOptions(val_fraction=0.25))
    rows = all_rows(tmp_path / "out")
    assert manifest["classes"] == names  # class names sorted
    assert sorted(rows["test"]) == list(range(30, 36))  # test-000.tar is the test split, whole
    kept = sorted(rows["train"]) + sorted(rows["val"])
    assert sorted(kept) == [*range(1, 25), *range(40, 45), 100]
    for split in rows.values():
        assert all(names[label] == names[v % 3] for v, label in split.items() if v != 100)
    assert rows["train"].get(100, rows["val"].get(100)) == 0  # "cat"
    assert len(rows["val"]) == 8  # a quarter of the 30 training samples, stratified
    skipped = dict(manifest["skipped"]["files"])
    assert manifest["skipped"]["count"] == 4 and set(skipped) == {
        "train-000.tar:broken.png", "train-000.tar:nolabel.png", "train-000.tar:orphan.txt", "train-002.tar"}
    assert "no label" in skipped["train-000.tar:nolabel.png"] and "no .jpg" in skipped["train-000.tar:orphan.txt"]
    assert skipped["train-002.tar"].startswith("cut short inside s0045.png") and "kept" in skipped["train-002.tar"]
    assert not (tmp_path / "unpickled").exists()
    with pytest.raises(ImgtrainError, match=r"^3 sample\(s\) of the source cannot be used: .*pass --on-error skip"):
        prepare("webdataset", tmp_path / "fail", src, PrepareOptions(on_error="fail"))
    assert not (tmp_path / "fail").exists()


def test_a_brace_pattern_class_indices_and_a_json_field(tmp_path, capsys):
    src = tmp_path / "wds"
    for s in range(4):  # no split in the names: the splits are drawn; .cls indices, and a .json field in shard 3
        write_shard(src / f"shard-{s:03d}.tar", [
            (f"{s}/{i:03d}", {"jpg": png_bytes(np.full((8, 8), 10 * s + i, np.uint8)),  # PNG bytes named .jpg
                              **({"json": json.dumps({"y": i % 2}).encode()} if s == 3 else {"cls": b"%d\n" % (i % 2)})})
            for i in range(6)])
    proc = cli_here(capsys, "data", "prepare", "webdataset", str(tmp_path / "out"),
                    "--source", f"{src}/shard-{{000..002}}.tar", "--test-fraction", "0.34")
    assert proc.returncode == 0, proc.stderr
    rows = all_rows(tmp_path / "out")
    assert sorted(v for split in rows.values() for v in split) == [10 * s + i for s in range(3) for i in range(6)]
    assert all(label == v % 10 % 2 for split in rows.values() for v, label in split.items())
    assert [len(rows["train"]), len(rows["test"])] == [12, 6]
    manifest = prepare("webdataset", tmp_path / "all", f"{src}/shard-{{000..004}}.tar", PrepareOptions(label_column="y"))
    assert manifest["classes"] == ["0", "1"] and sum(s["num_samples"] for s in manifest["splits"].values()) == 24
    assert manifest["skipped"]["files"] == [["shard-004.tar", "missing: the pattern names it and there is no such file"]]
    write_shard(src / "shard-005.tar", [("x", {"png": gray_png(1), "txt": b"cat"})])
    with pytest.raises(ImgtrainError, match=r"mixes class indices .* e.g. at shard-005.tar:x"):
        prepare("webdataset", tmp_path / "mixed", str(src / "*.tar"))
    with pytest.raises(ImgtrainError, match="more than 100,000 shards"):
        prepare("webdataset", tmp_path / "huge", f"{src}/shard-{{0..999999999}}.tar")


def test_brace_expansion_and_shard_names_that_half_name_a_split(tmp_path):
    assert expand_braces("a-{08..10}-{x,y}.tar") == ["a-08-x.tar", "a-08-y.tar", "a-09-x.tar", "a-09-y.tar",
                                                      "a-10-x.tar", "a-10-y.tar"]
    assert expand_braces("{2..0}{}.tar") == ["2{}.tar", "1{}.tar", "0{}.tar"]
    for name in ("train-000.tar", "extra-000.tar"):
        write_shard(tmp_path / "s" / name, [(f"k{i}", {"png": gray_png(i), "cls": b"%d" % (i % 2)}) for i in range(4)])
    with pytest.raises(ImgtrainError, match=r"some shards name a split \(train-000.tar\) and others do not \(extra"):
        prepare("webdataset", tmp_path / "out", tmp_path / "s")
    with pytest.raises(ImgtrainError, match="no .tar shards at"):
        prepare("webdataset", tmp_path / "out", tmp_path / "nowhere")


def test_a_damaged_shard_yields_the_members_before_the_damage_and_says_where(tmp_path):
    whole = write_shard(tmp_path / "whole.tar", [(f"k{i}", {"png": gray_png(i), "cls": b"0"}) for i in range(4)])
    data = whole.read_bytes()
    third = data.index(b"k2.png")  # the third sample's header
    before = ["k0.png", "k0.cls", "k1.png", "k1.cls"]
    for damaged, members, why in ((data[:third + 100], before, "cut short at byte 4,096 (no end-of-archive marker)"),
                                  (data[:third] + b"\1" * 512 + data[third + 512:], before, "corrupt tar header at byte 4,096"),
                                  (gzip.compress(data), [], "compressed (gzip): only plain tar shards are read")):
        (tmp_path / "damaged.tar").write_bytes(damaged)
        scan = ShardScan(tmp_path / "damaged.tar", lambda name: name.endswith(".cls"))
        assert [(m.name, m.data) for m in scan] == [(n, b"0" if n.endswith(".cls") else None) for n in members]
        assert scan.damage.startswith(why)
    scan = ShardScan(whole)
    assert len(list(scan)) == 8 and scan.damage is None
