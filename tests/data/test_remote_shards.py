"""webdataset shards in a bucket (a real S3 server, moto's): named by a brace pattern or a
prefix, copied into the cache once, prepared into the same data set as the same shards on disk;
a store out of reach and a disk too small refused in one line."""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from imgtrain.data import remote_shards
from imgtrain.data.options import PrepareOptions
from imgtrain.data.prepare import prepare
from imgtrain.errors import ImgtrainError
from tests.conftest import cli_here
from tests.conftest_data_helpers import read_back
from tests.data.shard_files import gray_png, write_shard
from tests.ports import unused_port

NAMES = ["cat", "dog", "emu"]


@pytest.fixture
def bucket(s3_server, monkeypatch, tmp_path):
    """s3://imgtrain/<a prefix of this test's own>, with this process pointed at the server and a
    cache of this test's own."""
    for name, value in {**s3_server, "IMGTRAIN_CACHE": str(tmp_path / "cache")}.items():
        monkeypatch.setenv(name, value)
    return f"s3://imgtrain/{uuid.uuid4().hex[:8]}"


def upload(folder: Path, uri: str) -> None:
    """Every file of ``folder`` (subfolders included) under ``uri``."""
    endpoint = os.environ["IMGTRAIN_S3_ENDPOINT"]
    fs = pafs.S3FileSystem(endpoint_override=endpoint.removeprefix("http://"), scheme="http", region="us-east-1",
                           access_key="testing", secret_key="testing")
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        with fs.open_output_stream(f"{uri.removeprefix('s3://')}/{path.relative_to(folder).as_posix()}") as f:
            f.write(path.read_bytes())


def shards(folder: Path) -> Path:
    """train-000 (.txt labels), train-001 cut short after four samples, test-000."""
    def sample(v: int):
        return f"s{v:04d}", {"png": gray_png(v), "txt": NAMES[v % 3].encode()}

    write_shard(folder / "train-000.tar", [sample(v) for v in range(1, 13)])
    cut = write_shard(folder / "train-001.tar", [sample(v) for v in range(20, 28)])
    data = cut.read_bytes()
    cut.write_bytes(data[:data.index(gray_png(24)) + 20])
    write_shard(folder / "test-000.tar", [sample(v) for v in range(40, 46)])
    return folder


def same_data_set(a: Path, b: Path) -> None:
    """Every row of every split (ids, labels, pixels, in order) and the manifest but where it came from."""
    rows_a, rows_b = read_back(a), read_back(b)
    assert rows_a.keys() == rows_b.keys()
    for split in rows_a:
        assert all((x == y).all() for x, y in zip(rows_a[split], rows_b[split])), split

    def manifest(d):
        m = json.loads((d / "manifest.json").read_text())
        return {k: v for k, v in m.items() if k not in ("name", "source", "created")}

    assert manifest(a) == manifest(b)


def test_a_brace_pattern_over_s3_prepares_what_the_same_local_shards_give_and_is_copied_once(bucket, tmp_path, capsys):
    local = shards(tmp_path / "shards")
    upload(local, f"{bucket}/shards")
    pattern = "{train,test}-00{0,1}.tar"  # test-001.tar is not there
    proc = cli_here(capsys, "data", "prepare", "webdataset", str(tmp_path / "s3"), "--source",
                    f"{bucket}/shards/{pattern}", "--workers", "1")
    assert proc.returncode == 0, proc.stderr
    assert "copying 3 shard(s)" in proc.stderr and str(tmp_path / "cache") in proc.stderr
    assert "skipped test-001.tar: missing" in proc.stderr
    assert "skipped train-001.tar: cut short inside s0024.png" in proc.stderr
    manifest = prepare("webdataset", tmp_path / "here", f"{local}/{pattern}", PrepareOptions(workers=1))
    same_data_set(tmp_path / "s3", tmp_path / "here")
    assert manifest["classes"] == NAMES and manifest["class_counts"]["test"] == [2, 2, 2]
    assert {s: v["num_samples"] for s, v in manifest["splits"].items()} == {"train": 16, "test": 6}

    copy = next((tmp_path / "cache").rglob("train-000.tar"))
    before = copy.stat()
    # again, named by the prefix: nothing is copied, and the missing shard is no longer named
    again = prepare("webdataset", tmp_path / "again", f"{bucket}/shards/", PrepareOptions(workers=1))
    assert "the 3 shard(s) of" in capsys.readouterr().err
    assert (copy.stat().st_ino, copy.stat().st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert [name for name, _ in again["skipped"]["files"]] == ["train-001.tar"]
    assert again["source"] == f"webdataset:{bucket}/shards/"


def test_globs_skip_hidden_and_compressed_shards_and_out_of_reach_bad_buckets_and_small_disks_fail_in_one_line(
        bucket, tmp_path, monkeypatch, capsys):
    upload(shards(tmp_path / "shards"), f"{bucket}/shards")
    for name in (".cache/h.tar", "sub/k.tar", "sub/k.tar.gz"):
        write_shard(tmp_path / "more" / name, [("x", {"png": gray_png(1), "txt": b"cat"})])
    upload(tmp_path / "more", f"{bucket}/more")
    copies, root, skipped = remote_shards.find_remote_shards(f"{bucket}/more/**/*.tar*")  # ** as glob.glob's
    assert [p.relative_to(root).as_posix() for p in copies] == ["k.tar"] and copies[0].is_file()
    assert skipped == [("k.tar.gz", "compressed shard, not read: decompress it to .tar")]

    with pytest.raises(ImgtrainError, match=r"^no \.tar shards at .*/nothing/; pass a folder"):
        prepare("webdataset", tmp_path / "out", f"{bucket}/nothing/")
    with pytest.raises(ImgtrainError, match=r"^--source s3://no-such-bucket-here/x: no bucket"):
        prepare("webdataset", tmp_path / "out", "s3://no-such-bucket-here/x")

    free = remote_shards.shutil.disk_usage(tmp_path)._replace(free=remote_shards.SPARE_BYTES)
    monkeypatch.setattr(remote_shards.shutil, "disk_usage", lambda path: free)
    with pytest.raises(ImgtrainError, match=r"copying its 3 shard\(s\) needs 512\.\d MiB free on the disk of .* and it "
                                            r"has 512\.0 MiB; set IMGTRAIN_CACHE to a folder on a larger disk$"):
        prepare("webdataset", tmp_path / "out", f"{bucket}/shards/*.tar")
    assert not list((tmp_path / "cache").rglob("train-*"))  # refused before the first byte

    port = unused_port()  # a port nothing listens on
    monkeypatch.setenv("IMGTRAIN_S3_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    started = time.monotonic()
    proc = cli_here(capsys, "data", "prepare", "webdataset", str(tmp_path / "out"), "--source", f"{bucket}/shards/")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert f"--source {bucket}/shards:" in proc.stderr and "IMGTRAIN_S3_ENDPOINT" in proc.stderr
    assert time.monotonic() - started < 10
    assert not (tmp_path / "out").exists()


def test_a_shard_replaced_between_its_listing_and_its_copy_is_refused_in_one_line_and_nothing_of_it_kept(
        bucket, tmp_path, monkeypatch, capsys):
    """The disk check counted the shards as listed: a shard that grew since is not copied to
    its new end (nor one cut short since taken as whole)."""
    upload(shards(tmp_path / "shards"), f"{bucket}/shards")
    listed_size = (tmp_path / "shards" / "train-000.tar").stat().st_size
    real_copy = remote_shards._copy_missing
    replacement: list[Path] = []

    def replaced_after_listing(fs, st, copies):  # another client uploads a new version meanwhile
        upload(replacement[-1].parent, f"{bucket}/shards")
        real_copy(fs, st, copies)

    monkeypatch.setattr(remote_shards, "_copy_missing", replaced_after_listing)
    replacement.append(write_shard(tmp_path / "bigger" / "train-000.tar",
                                   [(f"s{v:04d}", {"png": gray_png(v), "txt": b"cat"}) for v in range(1, 40)]))
    proc = cli_here(capsys, "data", "prepare", "webdataset", str(tmp_path / "out"), "--source",
                    f"{bucket}/shards/train-000.tar")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    error = proc.stderr.strip().splitlines()[-1]  # under the line that said what it copies
    assert error.startswith(f"error: --source {bucket}/shards/train-000.tar: "), error
    assert f"train-000.tar changed while it was being copied (listed with {listed_size} bytes, " \
           f"{replacement[-1].stat().st_size} bytes now)" in error
    assert not (tmp_path / "out").exists()

    replacement.append(write_shard(tmp_path / "smaller" / "train-000.tar", [("s0001", {"png": gray_png(1)})]))
    upload(tmp_path / "shards", f"{bucket}/shards")  # listed as the original again
    with pytest.raises(ImgtrainError, match=f"listed with {listed_size} bytes, "
                                            f"{replacement[-1].stat().st_size} bytes now"):
        remote_shards.find_remote_shards(f"{bucket}/shards/train-000.tar")
    assert [p.name for p in (tmp_path / "cache").rglob("*") if p.is_file()] == []  # no copy, no partial file
