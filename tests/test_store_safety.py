"""What a bucket, an outage or a name can do to the machine that reads a run in an object store,
against a real S3 server (moto) and, for the outage, a real loss of the way to it (a TCP proxy
that drops every connection): never lose a checkpoint, never write outside the working copy,
never let two drivers train one run."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from imgtrain.checkpoint_policy import POLICY, PREFIX
from imgtrain.data import staging
from imgtrain.errors import ImgtrainError, ImgtrainWarning
from imgtrain.ops import process, remote
from imgtrain.storage import lease, location, mirror, ownership, runs
from tests.conftest import quiet_display, tiny_config
from tests.store_proxy import FlakyStore


@pytest.fixture
def env(s3_server, monkeypatch, tmp_path):
    """This test's own prefix in the bucket, and an empty working-copy cache."""
    for key, value in s3_server.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("IMGTRAIN_CACHE", str(tmp_path / "cache"))
    return f"s3://imgtrain/safety-{time.monotonic_ns()}"


def boto(s3_server):
    """The store as anyone with write access sees it: any key at all (pyarrow refuses some)."""
    import boto3

    return boto3.client("s3", endpoint_url=s3_server["IMGTRAIN_S3_ENDPOINT"], region_name="us-east-1",
                        aws_access_key_id="testing", aws_secret_access_key="testing")


def keys(s3_server, prefix: str) -> list[str]:
    found = boto(s3_server).list_objects_v2(Bucket="imgtrain", Prefix=prefix.removeprefix("s3://imgtrain/"))
    return sorted(o["Key"] for o in found.get("Contents", []))


def checkpoint_names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if POLICY.is_checkpoint(p.name) and p.is_dir())


def files_under(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


# ---------------------------------------------------------------- 1. an outage never deletes a checkpoint


@pytest.mark.integration  # trains, its checkpoints going to the S3 server
def test_checkpoints_made_while_the_store_was_unreachable_are_kept_and_uploaded_when_it_is_back(
        env, s3_server, tiny_data, monkeypatch):
    from imgtrain.training import driver

    prefix = env.removeprefix("s3://imgtrain/")
    first_meta = f"HEAD /imgtrain/{prefix}/outage/{POLICY.epoch_name(0)}/meta.json".encode()
    proxy = FlakyStore(s3_server["IMGTRAIN_S3_ENDPOINT"], cut_on=first_meta)  # the store goes away there
    monkeypatch.setenv("IMGTRAIN_S3_ENDPOINT", proxy.endpoint)
    sent = driver.Records.send

    def slow_first_epoch(records, record):  # training goes on once the mirror has uploaded epoch 0 (and the
        sent(records, record)  # store is gone), as it would after a longer epoch: the outage falls between two
        if record.get("checkpoint") == POLICY.epoch_name(0):
            assert proxy.was_cut.wait(60), "the first checkpoint never went up"

    monkeypatch.setattr(driver.Records, "send", slow_first_epoch)
    try:
        # 2 epochs; a small model: ResNet-18's checkpoints took most of the time going up (what is tested is the mirror)
        cfg = tiny_config(tiny_data, env, "outage", backend="local", workers=1, model="timm:test_resnet")
        with pytest.raises(ImgtrainError, match=f"storage {env}"):  # its last upload failed: said, not hidden
            driver.train(cfg, display=quiet_display())
        assert proxy.was_cut.is_set()
        copy = location.store(env).local / "outage"
        made = [n for n in checkpoint_names(copy) if n != POLICY.epoch_name(0)]  # never uploaded
        assert made == [POLICY.epoch_name(1)], made
        in_bucket = {k.split("/")[2] for k in keys(s3_server, env) if f"/{PREFIX}" in k}
        assert in_bucket == {POLICY.epoch_name(0)}

        proxy.restore()
        result = runs.load_run(env, "outage")  # `imgtrain runs show outage`: the first command after
        assert set(made) <= set(checkpoint_names(copy))  # nothing made here was deleted
        assert result.latest_checkpoint.name == POLICY.epoch_name(1)
        uploaded = keys(s3_server, f"{env}/outage")
        for name in made:  # ... and what the store lacked went up, meta.json with the rest
            assert f"{prefix}/outage/{name}/meta.json" in uploaded and f"{prefix}/outage/{name}/model.pt" in uploaded
    finally:
        proxy.close()

    monkeypatch.setenv("IMGTRAIN_S3_ENDPOINT", s3_server["IMGTRAIN_S3_ENDPOINT"])
    elsewhere = remote.Store(uri=env, root=f"imgtrain/{prefix}", local=copy.parent.parent / "other")
    there = mirror.pull(elsewhere, "outage")  # another machine sees the whole run
    assert [r["epoch"] for r in runs.read_run(there).history] == [0, 1]
    assert POLICY.epoch_name(1) in checkpoint_names(there)


def test_a_pull_drops_only_checkpoints_that_were_in_the_store(env, s3_server):
    st = location.store(env)
    run = st.local / "r"
    (run / ownership.MARKER_FILE).parent.mkdir(parents=True)
    (run / ownership.MARKER_FILE).write_text("{}")
    for epoch in (0, 1):
        folder = run / POLICY.epoch_name(epoch)
        folder.mkdir()
        (folder / "model.pt").write_text("w")
        (folder / "meta.json").write_text(json.dumps({"step": 8 * (epoch + 1)}))
    mirror.push(st, "r", everything=True)
    mirror.delete(st, "r", POLICY.epoch_name(0))  # Ray Train's retention, in the store
    never_sent = run / POLICY.epoch_name(2)  # made here while the store was away
    never_sent.mkdir()
    (never_sent / "model.pt").write_text("w")
    (never_sent / "meta.json").write_text(json.dumps({"step": 24}))
    mirror.pull(st, "r")
    assert checkpoint_names(run) == [POLICY.epoch_name(1), POLICY.epoch_name(2)]
    assert any(k.endswith(f"r/{POLICY.epoch_name(2)}/meta.json") for k in keys(s3_server, env))


def test_a_run_emptied_from_the_store_by_another_client_keeps_the_records_never_sent(env, s3_server):
    st = location.store(env)
    run = st.local / "r"
    run.mkdir(parents=True)
    (run / ownership.MARKER_FILE).write_text("{}")
    (run / runs.METRICS_FILE).write_text('{"epoch": 0}\n')
    (run / POLICY.epoch_name(0)).mkdir()
    (run / POLICY.epoch_name(0) / "meta.json").write_text(json.dumps({"step": 8}))
    mirror.push(st, "r", everything=True)  # the driver's last upload
    with open(run / runs.METRICS_FILE, "a") as f:  # its next record, then the store went away
        f.write('{"epoch": 1}\n')
    s3, prefix = boto(s3_server), env.removeprefix("s3://imgtrain/")
    for key in keys(s3_server, f"{env}/r/"):  # another client empties the run's prefix
        s3.delete_object(Bucket="imgtrain", Key=key)

    location.fetch(env, "r")  # `imgtrain runs show r` (as `runs list`, `evaluate`, ...) first pulls it
    assert (run / runs.METRICS_FILE).read_text() == '{"epoch": 0}\n{"epoch": 1}\n'  # the unsent record
    assert f"{prefix}/r/{runs.METRICS_FILE}" in keys(s3_server, env)  # ... and sent back, as a reader does

    for key in keys(s3_server, f"{env}/r/"):  # emptied again: now everything here was in the store as it is
        s3.delete_object(Bucket="imgtrain", Key=key)
    location.fetch(env, "r")
    assert not run.exists()  # a run deleted elsewhere goes from this machine too


# ---------------------------------------------------------------- 2. a bucket never writes outside the cache


def test_a_key_with_dot_dot_never_becomes_a_file_outside_the_working_copy(env, s3_server, tmp_path):
    prefix = env.removeprefix("s3://imgtrain/")
    s3 = boto(s3_server)
    s3.put_object(Bucket="imgtrain", Key=f"{prefix}/r/.imgtrain-run", Body=b"{}")
    s3.put_object(Bucket="imgtrain", Key=f"{prefix}/r/config.json", Body=b"{}")
    # what S3 clients send for the key below reaches this one: a GET of it returns these bytes
    s3.put_object(Bucket="imgtrain", Key=f"{prefix}/r/../../planted.txt", Body=b"planted")
    s3.put_object(Bucket="imgtrain", Key="planted.txt", Body=b"planted")
    s3.put_object(Bucket="imgtrain", Key=f"{prefix}/r/logs/ray/through-a-link", Body=b"planted")
    cache = tmp_path / "cache"
    with pytest.warns(ImgtrainWarning, match="will not copy here"):
        listed = runs.list_runs(env)  # `imgtrain runs list`
    assert [r.name for r in listed] == ["r"]
    with pytest.warns(ImgtrainWarning, match="will not copy here"):
        runs.load_run(env, "r")  # `runs show`, `evaluate`, `report`, `serve`, a resume
    run = location.store(env).local / "r"
    assert files_under(cache) - {f"stores/s3/imgtrain/{prefix}/r/{f}" for f in files_under(run)} \
        <= {f"stores/s3/imgtrain/{prefix}/.r.pull-lock"}
    assert not any("planted" in f for f in files_under(tmp_path))


def test_a_key_through_a_link_in_the_working_copy_is_refused(tmp_path):
    outside = tmp_path / "ray-session"
    outside.mkdir()
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "ray").symlink_to(outside)
    with pytest.raises(remote.UnsafeKey, match="link"):
        remote.local_file(run, "logs/ray/x")
    for key in ("../x", "a/../../x", "a//b", "/etc/passwd", "a/./b", "a\\..\\b", "a\x1b[2J"):
        with pytest.raises(remote.UnsafeKey):
            remote.local_file(run, key)
    assert remote.local_file(run, f"{POLICY.epoch_name(0)}/model.pt") == run / POLICY.epoch_name(0) / "model.pt"


@pytest.mark.parametrize("uri", ["s3://imgtrain/x/../../DIR", "s3://imgtrain/x//y", "s3://imgtrain/./x"])
def test_a_location_with_dot_dot_is_refused_before_anything_is_written(env, tmp_path, uri):
    cache = tmp_path / "cache"
    with pytest.raises(ImgtrainError, match="plain names"):
        staging.stage_dataset(uri)  # --data
    with pytest.raises(ImgtrainError, match="plain names"):
        location.store(uri)  # --storage
    assert not cache.exists() or files_under(cache) == set()
    assert not (tmp_path.parent / "DIR").exists()


# ---------------------------------------------------------------- 3. names checked before any file is touched


@pytest.mark.parametrize("name", ["./../../../victim", "..", "../victim", "a/../../victim"])
def test_a_run_name_that_leaves_the_storage_touches_nothing(env, tmp_path, tiny_data, name):
    from imgtrain.training.driver import train

    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("keep me")
    (tmp_path / "cache").mkdir()
    for read in (lambda: runs.load_run(env, name), lambda: location.fetch(env, name),
                 lambda: mirror.pull(location.store(env), name),
                 lambda: train(tiny_config(tiny_data, env, name, backend="local"), display=quiet_display())):
        with pytest.raises(ImgtrainError, match="plain name|not a run name"):
            read()
    assert (victim / "precious.txt").read_text() == "keep me"


# ---------------------------------------------------------------- 5. two drivers, one run


def test_two_drivers_starting_one_run_at_the_same_moment_one_trains_one_is_refused(env, monkeypatch):
    st = location.store(env)
    both_read = threading.Barrier(2, timeout=30)
    real_read, first_reads = lease.read_beat, set()

    def read_then_meet(st_, name):  # each driver's first look finds the lease free, before either writes
        found = real_read(st_, name)
        if threading.get_ident() not in first_reads:
            first_reads.add(threading.get_ident())
            both_read.wait()
        return found

    monkeypatch.setattr(lease, "read_beat", read_then_meet)
    monkeypatch.setattr(lease, "LEASE_SETTLE_S", 0.5)
    outcomes: dict[str, object] = {}
    release = threading.Event()

    def driver(label: str) -> None:
        try:
            with lease.leased(st, "r") as token:
                outcomes[label] = token
                release.wait(30)
        except ImgtrainError as e:
            outcomes[label] = e

    threads = [threading.Thread(target=driver, args=(label,)) for label in ("a", "b")]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while len(outcomes) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    release.set()
    for t in threads:
        t.join(30)
    errors = [o for o in outcomes.values() if isinstance(o, ImgtrainError)]
    tokens = [o for o in outcomes.values() if isinstance(o, str)]
    assert len(errors) == 1 and len(tokens) == 1, outcomes
    assert "started at the same moment" in str(errors[0])
    assert real_read(st, "r")["token"] == tokens[0] and real_read(st, "r")["released"]  # given back at the end


def test_a_held_lease_refuses_a_later_driver_and_a_released_one_does_not(env, monkeypatch):
    st = location.store(env)
    monkeypatch.setattr(lease, "LEASE_SETTLE_S", 0.1)  # one driver at a time here: no race to settle
    with lease.leased(st, "r"):
        with pytest.raises(ImgtrainError, match="being trained right now by process"):
            with lease.leased(st, "r"):
                pass
    with lease.leased(st, "r"):  # released: taken again at once
        pass
    lease.beat(st, "r", token="someone-elses")  # a driver of another machine, beating now
    record = lease.read_beat(st, "r")
    record.update(host="another-machine")
    with st.fs.open_output_stream(f"{st.root}/r/{lease.HEARTBEAT_FILE}") as f:
        f.write(json.dumps(record).encode())
    with pytest.raises(ImgtrainError, match="on another-machine"):
        with lease.leased(st, "r"):
            pass


def put_beat(st: remote.Store, record: dict) -> None:
    """The run's heartbeat as anyone who may write to the bucket writes it."""
    with st.fs.open_output_stream(f"{st.root}/r/{lease.HEARTBEAT_FILE}") as f:
        f.write(json.dumps(record).encode())


def test_a_heartbeat_dated_in_the_future_or_of_no_driver_on_this_host_holds_no_lease(env, monkeypatch):
    st = location.store(env)
    monkeypatch.setattr(lease, "LEASE_SETTLE_S", 0.1)  # one driver at a time here
    put_beat(st, {"host": "another-machine", "pid": 4242, "time": time.time() + 3600, "token": "t"})
    told = r"names process 4242 on another-machine at a time 3600 s after this machine's clock.*not honoured as a lease"
    with pytest.warns(ImgtrainWarning, match=told), lease.leased(st, "r") as token:
        assert lease.read_beat(st, "r")["token"] == token  # this driver took the run

    here = socket.gethostname()
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()
    with subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE) as other:
        try:
            started = process.started(other.pid)
            not_a_driver = [
                {"host": here, "pid": 1, "time": time.time() - lease.HEARTBEAT_STALE_S - 30},  # pid 1 runs, no beat
                {"host": here, "pid": gone.pid, "time": time.time()},  # a driver here that is gone
                {"host": here, "pid": other.pid, "started": "another process", "time": time.time()},  # its pid, reused
            ]
            for record in not_a_driver:
                put_beat(st, record)
                with lease.leased(st, "r"):
                    pass
            # live drivers keep the run: one here, and another machine's whose clock runs a little ahead
            for record in ({"host": here, "pid": other.pid, "started": started, "time": time.time()},
                           {"host": "another-machine", "pid": 4242, "time": time.time() + lease.CLOCK_SKEW_S / 2}):
                put_beat(st, record)
                with pytest.raises(ImgtrainError, match=f"being trained right now by process {record['pid']} on "):
                    with lease.leased(st, "r"):
                        pass
        finally:
            other.stdin.close()


# ---------------------------------------------------------------- 8. keys pyarrow cannot address


def test_a_double_slash_key_does_not_break_runs_list_or_clean(env, s3_server):
    from imgtrain.commands import clean

    prefix = env.removeprefix("s3://imgtrain/")
    s3 = boto(s3_server)
    for run in ("a", "b"):
        s3.put_object(Bucket="imgtrain", Key=f"{prefix}/{run}/.imgtrain-run", Body=b"{}")
    s3.put_object(Bucket="imgtrain", Key=f"{prefix}/a//odd", Body=b"x")
    s3.put_object(Bucket="imgtrain", Key=f"{prefix}//odd", Body=b"x")
    with pytest.warns(ImgtrainWarning):
        assert [r.name for r in runs.list_runs(env)] == ["a", "b"]
    with pytest.warns(ImgtrainWarning):
        removals = clean.plan_runs(env, [], everything=True)
    assert sorted(r.path.name for r in removals) == ["a", "b"]
    for removal in removals:
        clean.remove(removal)
    assert not [k for k in keys(s3_server, env) if k.startswith(f"{prefix}/a/") or k.startswith(f"{prefix}/b/")]
