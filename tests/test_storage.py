"""The object-store working copy (``storage.mirror``, ``storage.lease``) against a real S3 server (moto), no Ray."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time

import pyarrow.fs as pafs
import pytest

from imgtrain.checkpoint_policy import POLICY, RAY_SNAPSHOT_FILE
from imgtrain.data import staging
from imgtrain.data.format import verify_dataset
from imgtrain.errors import ImgtrainError
from imgtrain.ops import remote
from imgtrain.storage import lease, location, mirror, ownership, runs
from tests.conftest import wait_for


@pytest.fixture
def s3(s3_server, monkeypatch, tmp_path):
    for key, value in s3_server.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("IMGTRAIN_CACHE", str(tmp_path / "cache"))
    return location.store(f"s3://imgtrain/unit-{time.monotonic_ns()}")


def write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def other_machine(st: remote.Store, tmp_path) -> remote.Store:
    return remote.Store(uri=st.uri, root=st.root, local=tmp_path / "elsewhere")


def read_object(st: remote.Store, rel: str):
    with st.fs.open_input_stream(f"{st.root}/{rel}") as f:
        return json.loads(f.read())


def put_object(st: remote.Store, rel: str, data: bytes) -> None:
    with st.fs.open_output_stream(f"{st.root}/{rel}") as f:
        f.write(data)


def test_push_then_pull_elsewhere_gives_the_same_files_and_fetches_only_what_changed(s3, tmp_path):
    run = s3.local / "r"
    write(run / "config.json", '{"a": 1}')
    write(run / "metrics.jsonl", '{"epoch": 0}\n')
    write(run / ".lock", "pid")  # this machine's own
    sent = {}
    mirror.push(s3, "r", sent)
    assert set(mirror.remote_files(s3, "r")) == {"config.json", "metrics.jsonl"}

    there = other_machine(s3, tmp_path)
    got = mirror.pull(there, "r")
    assert (got / "config.json").read_text() == '{"a": 1}' and not (got / ".lock").exists()
    inode = (got / "config.json").stat().st_ino
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"epoch": 1}\n')
    mirror.push(s3, "r", sent)
    mirror.pull(there, "r")
    assert (got / "metrics.jsonl").read_text().count("epoch") == 2
    assert (got / "config.json").stat().st_ino == inode  # unchanged: not fetched again


def test_checkpoints_deleted_in_the_store_leave_the_working_copy_and_a_light_pull_gets_meta_only(s3, tmp_path):
    run = s3.local / "r"
    write(run / "config.json", "{}")
    for name in (POLICY.epoch_name(0), POLICY.epoch_name(1)):
        write(run / name / "model.pt", "weights")
        write(run / name / "meta.json", "{}")
    mirror.push(s3, "r", everything=True)
    there = other_machine(s3, tmp_path)
    light = mirror.pull(there, "r", checkpoints=False)
    assert (light / POLICY.epoch_name(0) / "meta.json").is_file()
    assert not (light / POLICY.epoch_name(0) / "model.pt").exists()
    mirror.pull(there, "r")
    assert (light / POLICY.epoch_name(0) / "model.pt").read_text() == "weights"

    import shutil

    shutil.rmtree(run / POLICY.epoch_name(0))  # the local backend's retention
    write(run / POLICY.epoch_name(2) / "meta.json", "{}")
    mirror.push(s3, "r", everything=True)
    assert not any(k.startswith(POLICY.epoch_name(0)) for k in mirror.remote_files(s3, "r"))
    mirror.pull(there, "r")
    pulled = sorted(p.name for p in light.iterdir() if POLICY.is_checkpoint(p.name))
    assert pulled == [POLICY.epoch_name(1), POLICY.epoch_name(2)]


def test_the_mirror_uploads_while_the_block_runs_and_once_more_at_its_end(s3):
    run = s3.local / "r"
    write(run / "status.json", '{"status": "running"}')
    with mirror.mirrored(s3, "r", interval_s=0.1):
        deadline = time.monotonic() + 30
        while "status.json" not in mirror.remote_files(s3, "r"):
            assert time.monotonic() < deadline, "nothing uploaded while the block ran"
            time.sleep(0.05)
        write(run / "status.json", '{"status": "finished!"}')
        # read as a driver reads it: the heartbeat is replaced every 0.1 s here, and a read in the
        # middle of a replacement can get pieces of two versions (lease.read_beat reads again)
        wait_for(lambda: lease.read_beat(s3, "r") is not None, 30, "a heartbeat")
        first = lease.read_beat(s3, "r")
        assert (first["host"], first["pid"]) == (socket.gethostname(), os.getpid())
        wait_for(lambda: (lease.read_beat(s3, "r") or first)["time"] > first["time"], 30, "a second heartbeat")
    assert read_object(s3, "r/status.json")["status"] == "finished!"
    assert not (run / "heartbeat.json").exists()  # written to the store only


def test_a_data_set_in_the_store_is_copied_once_and_checked_against_its_manifest(s3, s3_server, tiny_data):
    uri = f"{s3.uri}/data/tiny"
    pafs.copy_files(str(tiny_data), uri.removeprefix("s3://"), source_filesystem=pafs.LocalFileSystem(),
                    destination_filesystem=s3.fs)
    local = staging.stage_dataset(uri)
    assert verify_dataset(local)["splits"] == verify_dataset(tiny_data)["splits"]
    shard = next(local.rglob("*.parquet"))
    inode = shard.stat().st_ino
    assert staging.stage_dataset(uri) == local and shard.stat().st_ino == inode  # not copied again

    rel = shard.relative_to(local).as_posix()
    data = bytearray((tiny_data / rel).read_bytes())
    data[len(data) // 2] ^= 0xFF  # the same size, other bytes: a changed object
    with s3.fs.open_output_stream(f"{s3.root}/data/bad/{rel}") as f:
        f.write(bytes(data))
    for other in tiny_data.rglob("*"):
        if other.is_file() and other.relative_to(tiny_data).as_posix() != rel:
            with s3.fs.open_output_stream(f"{s3.root}/data/bad/{other.relative_to(tiny_data).as_posix()}") as f:
                f.write(other.read_bytes())
    with pytest.raises(ImgtrainError, match="sha256"):  # on every node, not only by the driver's reader
        staging.stage_dataset(f"{s3.uri}/data/bad")

    with pytest.raises(ImgtrainError, match="not a prepared data set"):
        staging.stage_dataset(f"{s3.uri}/data/nothing-here")


def test_a_manifest_cannot_reach_outside_its_folder(s3):
    manifest = {"splits": {"train": {"files": ["../../runs/x/model.pt"]}}}
    with s3.fs.open_output_stream(f"{s3.root}/data/evil/manifest.json") as f:
        f.write(json.dumps(manifest).encode())
    with pytest.raises(ImgtrainError, match="outside the data set"):
        staging.stage_dataset(f"{s3.uri}/data/evil")


def test_storage_uris_and_their_errors(s3, monkeypatch):
    assert remote.is_remote("s3://b/p") and not remote.is_remote("./runs") and not remote.is_remote("file:///x")
    with pytest.raises(ImgtrainError, match="name a bucket"):
        location.store("s3://")
    monkeypatch.setenv("IMGTRAIN_S3_ENDPOINT", "http://127.0.0.1:1")  # nothing listens there
    with pytest.raises(ImgtrainError, match="IMGTRAIN_S3_ENDPOINT"):
        remote.probe(location.store("s3://imgtrain/x"))
    assert "testing" not in repr(remote.s3_filesystem().__reduce__())  # no credentials inside: pickled to workers


# ---------------------------------------------------------------- a run trained on this machine


def trained_here(st: remote.Store, name: str = "r"):
    """A run whose driver (this process, as far as the working copy can tell) holds its lock,
    uploaded once, then written to further as a driver does: the store is behind it."""
    run = st.local / name
    write(run / ownership.MARKER_FILE, "{}")
    write(run / "metrics.jsonl", '{"epoch": 0}\n')
    mirror.push(st, name)
    with open(run / "metrics.jsonl", "a") as f:  # the driver's next record, not uploaded yet
        f.write('{"epoch": 1}\n')
    write(run / POLICY.epoch_name(1) / "model.pt", "weights")  # the local backend's, not uploaded yet
    return run


def test_a_pull_leaves_a_run_trained_on_this_machine_as_its_driver_has_it(s3):
    run = trained_here(s3)
    with ownership.locked(run, "trained"):
        assert mirror.pull(s3, "r") == run
        assert location.fetch(s3.uri, "r") == run and [r.name for r in runs.list_runs(s3.uri)] == ["r"]
        assert (run / "metrics.jsonl").read_text().count("epoch") == 2  # not the store's older copy
        assert (run / POLICY.epoch_name(1) / "model.pt").is_file()  # not dropped as "deleted in the store"


def test_a_pull_never_replaces_a_file_changed_here_since_its_upload(s3):
    run = trained_here(s3)  # its driver is gone: nobody holds the lock
    uploaded = mirror.remote_files(s3, "r")["metrics.jsonl"][1]
    os.utime(run / "metrics.jsonl", (uploaded + 2, uploaded + 2))  # written here after the upload
    mirror.pull(s3, "r")
    assert (run / "metrics.jsonl").read_text().count("epoch") == 2


def test_a_second_train_on_this_machine_is_refused_before_it_touches_the_working_copy(s3):
    from imgtrain.config import TrainConfig
    from imgtrain.training.driver import _working_copy

    run = trained_here(s3)
    before = (run / "metrics.jsonl").read_text()
    cfg = TrainConfig(name="r", storage=s3.uri)
    with ownership.locked(run, "trained"), contextlib.ExitStack() as held, \
            pytest.raises(ImgtrainError, match="being trained right now"):
        _working_copy(cfg, held)
    assert (run / "metrics.jsonl").read_text() == before


def test_what_was_uploaded_or_fetched_here_is_not_fetched_again(s3):
    run = s3.local / "r"
    write(run / "config.json", "{}")
    write(run / POLICY.epoch_name(0) / "model.pt", "weights")
    mirror.push(s3, "r", everything=True)
    inodes = {p: p.stat().st_ino for p in run.rglob("*") if p.is_file()}
    mirror.pull(s3, "r")
    assert {p: p.stat().st_ino for p in inodes} == inodes  # the same files: nothing downloaded


def test_the_mirror_sends_nothing_that_a_pull_brought_down_nor_ray_trains_own_record(s3, tmp_path):
    run = s3.local / "r"
    write(run / "config.json", "{}")
    mirror.push(s3, "r")
    put_object(s3, f"r/{RAY_SNAPSHOT_FILE}", b'{"checkpoints": []}')
    there = other_machine(s3, tmp_path)
    mirror.pull(there, "r")
    put_object(s3, f"r/{RAY_SNAPSHOT_FILE}", b'{"checkpoints": ["newer, by Ray Train"]}')
    before = mirror.remote_files(s3, "r")
    time.sleep(1.1)  # the store's times are in seconds: anything sent again would show
    with mirror.mirrored(there, "r", interval_s=0.1):
        time.sleep(0.3)
    after = mirror.remote_files(there, "r")
    assert {k: after[k] for k in before} == before
    assert read_object(s3, f"r/{RAY_SNAPSHOT_FILE}") == {"checkpoints": ["newer, by Ray Train"]}


# ---------------------------------------------------------------- a driver on another machine


def status_from_elsewhere(run, beat_age: float | None, pid: int = 4242):
    write(run / runs.STATUS_FILE, json.dumps({"status": "running", "host": "another-machine", "pid": 4242}))
    (run / lease.HEARTBEAT_FILE).unlink(missing_ok=True)
    if beat_age is not None:
        write(run / lease.HEARTBEAT_FILE, json.dumps(
            {"host": "another-machine", "pid": pid, "time": time.time() - beat_age}))


def test_another_machines_driver_is_gone_once_its_heartbeat_is_old(tmp_path):
    run = tmp_path / "r"
    status_from_elsewhere(run, beat_age=5)
    assert runs.read_status(run)["status"] == "running"
    with pytest.raises(ImgtrainError, match=r"on another-machine \(its heartbeat 5 s ago\); try later"):
        runs.refuse_if_trained(run, hint="try later")

    status_from_elsewhere(run, beat_age=lease.HEARTBEAT_STALE_S + 30)
    assert runs.read_status(run)["status"] == "interrupted"
    runs.refuse_if_trained(run, hint="resumable")  # no error

    status_from_elsewhere(run, beat_age=None)  # no heartbeat (a shared folder): believed
    assert runs.read_status(run)["status"] == "running"
    status_from_elsewhere(run, beat_age=lease.HEARTBEAT_STALE_S + 30, pid=1)  # an earlier driver's
    assert runs.read_status(run)["status"] == "running"


def test_another_machines_heartbeat_dated_in_the_future_is_no_driver(tmp_path):
    run = tmp_path / "r"
    status_from_elsewhere(run, beat_age=-3600)  # written "an hour from now": by no driver that runs now
    assert runs.read_status(run)["status"] == "interrupted"
    status_from_elsewhere(run, beat_age=-lease.CLOCK_SKEW_S / 2)  # a clock a little ahead: believed
    assert runs.read_status(run)["status"] == "running"


# ---------------------------------------------------------------- the mirror when things go wrong


def test_the_mirror_skips_a_file_deleted_under_it_and_survives_any_error(s3, monkeypatch):
    run = s3.local / "r"
    write(run / "config.json", "{}")
    listed = mirror._mirrored_files

    def with_a_vanished_checkpoint(local):  # retention deleted it between the listing and its upload
        yield f"{POLICY.epoch_name(0)}/model.pt"
        yield from listed(local)

    monkeypatch.setattr(mirror, "_mirrored_files", with_a_vanished_checkpoint)
    mirror.push(s3, "r", everything=True)
    assert set(mirror.remote_files(s3, "r")) == {"config.json"}

    real_push, calls = mirror.push, []

    def flaky_push(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug in one round")
        return real_push(*args, **kwargs)

    monkeypatch.setattr(mirror, "push", flaky_push)
    with mirror.mirrored(s3, "r", interval_s=0.05):
        write(run / "metrics.jsonl", "{}\n")
        wait_for(lambda: "metrics.jsonl" in mirror.remote_files(s3, "r"), 30, "a round after the failed one")


def test_the_last_rounds_failure_never_hides_the_runs_own(s3, monkeypatch):
    def broken_push(*args, **kwargs):
        raise RuntimeError("the bucket went away")

    monkeypatch.setattr(mirror, "push", broken_push)
    with pytest.raises(ValueError, match="training failed"), mirror.mirrored(s3, "r", interval_s=0.05):
        raise ValueError("training failed")
    with pytest.raises(ImgtrainError, match="the last upload failed: the bucket went away"), \
            mirror.mirrored(s3, "r", interval_s=0.05):
        pass


def test_processes_pulling_one_run_at_once_each_get_it_whole(s3, tmp_path):
    run = s3.local / "r"
    payload = os.urandom(10 << 20)  # several chunks: the pulls overlap
    write(run / "config.json", "{}")
    (run / POLICY.epoch_name(0)).mkdir()
    (run / POLICY.epoch_name(0) / "model.pt").write_bytes(payload)
    mirror.push(s3, "r", everything=True)
    there = other_machine(s3, tmp_path)
    errors = []

    def pull():
        try:
            mirror.pull(there, "r")
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=pull) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert (there.local / "r" / POLICY.epoch_name(0) / "model.pt").read_bytes() == payload
    assert not [p for p in there.local.rglob("*.part")]


def test_a_pull_takes_a_file_its_driver_replaced_after_the_listing_as_it_is_now(s3, tmp_path, monkeypatch):
    run = s3.local / "r"
    write(run / "metrics.jsonl", '{"epoch": 0}\n')
    mirror.push(s3, "r")
    listed = mirror.remote_files

    def then_the_driver_uploads_again(st, name):  # its next record, between the listing and the copy
        found = listed(st, name)
        put_object(s3, "r/metrics.jsonl", b'{"epoch": 0}\n{"epoch": 1}\n')
        return found

    monkeypatch.setattr(mirror, "remote_files", then_the_driver_uploads_again)
    got = mirror.pull(other_machine(s3, tmp_path), "r")
    monkeypatch.setattr(mirror, "remote_files", listed)
    assert (got / "metrics.jsonl").read_text() == '{"epoch": 0}\n{"epoch": 1}\n'  # whole, not cut at the listed size
    size, mtime = mirror.remote_files(s3, "r")["metrics.jsonl"]
    assert mirror._same(got / "metrics.jsonl", size, mtime)  # with the store's time: not fetched again


def test_a_copy_ends_at_the_listed_size_where_the_store_does_not_say_the_size_when_it_opens(tmp_path):
    """pyarrow's other filesystems give no HEAD reply: the copy itself stops at the listed size."""
    source = tmp_path / "object"
    source.write_bytes(b"x" * 100)
    st = remote.Store(uri="file://x", root=str(tmp_path), local=tmp_path / "copy")
    with open(source, "ab") as f:  # written to after it was listed
        f.write(b"y" * 50)
    for listed, how in ((100, "longer than listed"), (200, "cut short")):
        with pytest.raises(remote.ObjectChanged, match=f"listed with {listed} bytes, {how}"):
            remote.copy_down(pafs.LocalFileSystem(), str(source), st.local / "object", st, (listed, None))
    assert not st.local.exists() or list(st.local.iterdir()) == []  # nothing kept, no partial file


def test_a_data_set_file_damaged_on_this_node_is_fetched_again_and_a_checked_one_not_read_again(
        s3, tiny_data, monkeypatch):
    uri = f"{s3.uri}/data/tiny"
    pafs.copy_files(str(tiny_data), uri.removeprefix("s3://"), source_filesystem=pafs.LocalFileSystem(),
                    destination_filesystem=s3.fs)
    local = staging.stage_dataset(uri)
    shard = next(local.rglob("*.parquet"))
    good = shard.read_bytes()
    damaged = bytearray(good)
    damaged[len(damaged) // 2] ^= 0xFF  # the same size
    shard.write_bytes(bytes(damaged))
    staging.stage_dataset(uri)
    assert shard.read_bytes() == good

    hashed = []
    real = staging.sha256_file
    monkeypatch.setattr(staging, "sha256_file", lambda path: hashed.append(path) or real(path))
    staging.stage_dataset(uri)
    assert hashed == []  # checked once, remembered by size and time
    verify_dataset(local)


def test_store_paths_come_from_pyarrow_and_an_s3_uri_is_a_bucket_and_prefix_only(s3):
    assert location.store("abfs://container@acct.dfs.core.windows.net/runs").root == "container/runs"
    for uri in ("s3://imgtrain/runs?region=eu-west-1", "s3://key:secret@imgtrain/runs"):
        with pytest.raises(ImgtrainError, match=r"s3://bucket/prefix, nothing more") as e:
            location.store(uri)
        assert "\n" not in str(e.value)
