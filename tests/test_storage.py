"""The object-store working copy (``storage.py``) against a real S3 server (moto), no Ray."""

from __future__ import annotations

import json
import time

import pyarrow.fs as pafs
import pytest

from imgtrain import storage
from imgtrain.data.format import verify_dataset
from imgtrain.errors import ImgtrainError


@pytest.fixture
def s3(s3_server, monkeypatch, tmp_path):
    for key, value in s3_server.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("IMGTRAIN_CACHE", str(tmp_path / "cache"))
    return storage.store(f"s3://imgtrain/unit-{time.monotonic_ns()}")


def write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def other_machine(st: storage.Store, tmp_path) -> storage.Store:
    return storage.Store(uri=st.uri, root=st.root, local=tmp_path / "elsewhere")


def test_push_then_pull_elsewhere_gives_the_same_files_and_fetches_only_what_changed(s3, tmp_path):
    run = s3.local / "r"
    write(run / "config.json", '{"a": 1}')
    write(run / "metrics.jsonl", '{"epoch": 0}\n')
    write(run / ".lock", "pid")  # this machine's own
    sent = {}
    storage.push(s3, "r", sent)
    assert set(storage.remote_files(s3, "r")) == {"config.json", "metrics.jsonl"}

    there = other_machine(s3, tmp_path)
    got = storage.pull(there, "r")
    assert (got / "config.json").read_text() == '{"a": 1}' and not (got / ".lock").exists()
    inode = (got / "config.json").stat().st_ino
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"epoch": 1}\n')
    storage.push(s3, "r", sent)
    storage.pull(there, "r")
    assert (got / "metrics.jsonl").read_text().count("epoch") == 2
    assert (got / "config.json").stat().st_ino == inode  # unchanged: not fetched again


def test_checkpoints_deleted_in_the_store_leave_the_working_copy_and_a_light_pull_gets_meta_only(s3, tmp_path):
    run = s3.local / "r"
    write(run / "config.json", "{}")
    for name in ("checkpoint_epoch_0000", "checkpoint_epoch_0001"):
        write(run / name / "model.pt", "weights")
        write(run / name / "meta.json", "{}")
    storage.push(s3, "r", everything=True)
    there = other_machine(s3, tmp_path)
    light = storage.pull(there, "r", checkpoints=False)
    assert (light / "checkpoint_epoch_0000" / "meta.json").is_file()
    assert not (light / "checkpoint_epoch_0000" / "model.pt").exists()
    storage.pull(there, "r")
    assert (light / "checkpoint_epoch_0000" / "model.pt").read_text() == "weights"

    import shutil

    shutil.rmtree(run / "checkpoint_epoch_0000")  # the local backend's retention
    write(run / "checkpoint_epoch_0002" / "meta.json", "{}")
    storage.push(s3, "r", everything=True)
    assert not any(k.startswith("checkpoint_epoch_0000") for k in storage.remote_files(s3, "r"))
    storage.pull(there, "r")
    assert sorted(p.name for p in light.glob("checkpoint_*")) == ["checkpoint_epoch_0001", "checkpoint_epoch_0002"]


def test_the_mirror_uploads_while_the_block_runs_and_once_more_at_its_end(s3):
    run = s3.local / "r"
    write(run / "status.json", '{"status": "running"}')
    with storage.mirrored(s3, "r", interval_s=0.1):
        deadline = time.monotonic() + 30
        while "status.json" not in storage.remote_files(s3, "r"):
            assert time.monotonic() < deadline, "nothing uploaded while the block ran"
            time.sleep(0.05)
        write(run / "status.json", '{"status": "finished!"}')
    with s3.fs.open_input_stream(f"{s3.root}/r/status.json") as f:
        assert json.loads(f.read())["status"] == "finished!"


def test_a_data_set_in_the_store_is_copied_once_and_checked_against_its_manifest(s3, s3_server, tiny_data):
    uri = f"{s3.uri}/data/tiny"
    pafs.copy_files(str(tiny_data), uri.removeprefix("s3://"), source_filesystem=pafs.LocalFileSystem(),
                    destination_filesystem=s3.fs)
    local = storage.stage_dataset(uri)
    assert verify_dataset(local)["splits"] == verify_dataset(tiny_data)["splits"]
    shard = next(local.rglob("*.parquet"))
    inode = shard.stat().st_ino
    assert storage.stage_dataset(uri) == local and shard.stat().st_ino == inode  # not copied again

    rel = shard.relative_to(local).as_posix()
    data = bytearray((tiny_data / rel).read_bytes())
    data[len(data) // 2] ^= 0xFF  # the same size, other bytes: a changed object
    with s3.fs.open_output_stream(f"{s3.root}/data/bad/{rel}") as f:
        f.write(bytes(data))
    for other in tiny_data.rglob("*"):
        if other.is_file() and other.relative_to(tiny_data).as_posix() != rel:
            with s3.fs.open_output_stream(f"{s3.root}/data/bad/{other.relative_to(tiny_data).as_posix()}") as f:
                f.write(other.read_bytes())
    with pytest.raises(ImgtrainError, match="sha256"):
        verify_dataset(storage.stage_dataset(f"{s3.uri}/data/bad"))

    with pytest.raises(ImgtrainError, match="not a prepared data set"):
        storage.stage_dataset(f"{s3.uri}/data/nothing-here")


def test_a_manifest_cannot_reach_outside_its_folder(s3):
    manifest = {"splits": {"train": {"files": ["../../runs/x/model.pt"]}}}
    with s3.fs.open_output_stream(f"{s3.root}/data/evil/manifest.json") as f:
        f.write(json.dumps(manifest).encode())
    with pytest.raises(ImgtrainError, match="outside the data set"):
        storage.stage_dataset(f"{s3.uri}/data/evil")


def test_storage_uris_and_their_errors(s3, monkeypatch):
    assert storage.is_remote("s3://b/p") and not storage.is_remote("./runs") and not storage.is_remote("file:///x")
    with pytest.raises(ImgtrainError, match="name a bucket"):
        storage.store("s3://")
    monkeypatch.setenv("IMGTRAIN_S3_ENDPOINT", "http://127.0.0.1:1")  # nothing listens there
    with pytest.raises(ImgtrainError, match="IMGTRAIN_S3_ENDPOINT"):
        storage.probe(storage.store("s3://imgtrain/x"))
    assert "testing" not in repr(storage.s3_filesystem().__reduce__())  # no credentials inside: pickled to workers
