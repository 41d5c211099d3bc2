"""The trackers against a real MLflow sqlite store, real TensorBoard event files and W&B's offline run files."""

import base64
import contextlib
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from imgtrain.checkpoint_policy import POLICY
from imgtrain.config import TrainConfig, validate
from imgtrain.errors import ImgtrainError
from imgtrain.storage import checkpoint as ckpt
from imgtrain.storage import runs
from imgtrain.training.tracking import metrics_of, open_trackers, public_config, require, scrub
from imgtrain.training.tracking.mlflow_tracker import MLFLOW_RUN_FILE, MLflowTracker
from imgtrain.training.tracking.tensorboard_tracker import TensorBoardTracker
from imgtrain.training.tracking.wandb_tracker import WANDB_RUN_FILE, WandbTracker
from tests.ports import unused_port

MANIFEST = {"name": "tiny", "splits": {"train": {"num_samples": 256}, "test": {"num_samples": 100}}}


def records(first_step: int, last_step: int, loss_at=lambda s: 1.0 / s):
    out = [{"kind": "start", "step": first_step, "time": 1.0}]
    for s in range(first_step + 2, last_step + 1, 2):
        out.append({"kind": "step", "epoch": 0, "step": s, "loss": loss_at(s), "accuracy": 0.5, "lr": 0.01,
                    "images_per_s": 100.0, "data_wait_fraction": 0.1, "time": 1000.0 + s})
        for rank in (0, 1):
            out.append({"kind": "rank", "rank": rank, "epoch": 0, "step": s, "steps": 2, "step_time_s": 0.2,
                        "data_wait_s": 0.02 * (rank + 1), "data_wait_fraction": 0.1 * (rank + 1), "time": 1000.0 + s})
    out.append({"kind": "epoch", "epoch": 0, "step": last_step, "train_loss": 0.5, "train_accuracy": 0.6,
                "val_loss": 0.4, "val_accuracy": 0.7, "images_per_s": 99.0, "epoch_time_s": 3.0,
                "data_wait_fraction": 0.2, "rank_step_time_s": [0.2, 0.2], "time": 2000.0})
    return out


@pytest.fixture
def run_dir(tmp_path):
    (tmp_path / "run" / "logs").mkdir(parents=True)
    return tmp_path / "run"


def best_checkpoint(run_dir):
    return ckpt.save(run_dir / POLICY.epoch_name(0), {"w": torch.ones(2)}, {}, {"epoch": 0})


def test_metric_names():
    step, rank = records(0, 2)[1:3]
    assert metrics_of(step) == {"step/loss": 0.5, "step/accuracy": 0.5, "step/images_per_s": 100.0,
                                "step/data_wait_fraction": 0.1, "step/lr": 0.01}
    assert set(metrics_of(rank)) == {"rank0/step_time_s", "rank0/data_wait_s", "rank0/data_wait_fraction"}
    assert metrics_of({"kind": "start", "step": 0}) == {}


@pytest.mark.integration  # a tracker's server or service process, and a run
def test_mlflow_gets_params_metrics_the_model_and_the_outcome_and_a_resume_continues_the_run(run_dir, tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = TrainConfig(name="t", data="/d", epochs=1, mlflow=uri, mlflow_experiment="exp")
    tracker = MLflowTracker(cfg, run_dir, MANIFEST)
    for r in records(0, 8):
        tracker.log(r)
    tracker.finish("failed", None)
    tracker.close()  # as the driver's guard does: its log handler off MLflow's loggers

    run_id = json.loads((run_dir / MLFLOW_RUN_FILE).read_text())["run_id"]
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    assert run.info.status == "FAILED" and run.info.run_name == "t"
    assert client.get_experiment(run.info.experiment_id).name == "exp"
    assert run.data.params["lr"] == str(cfg.lr) and run.data.params["data_train_samples"] == "256"
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "step/loss")] == [
        (2, 0.5), (4, 0.25), (6, 1 / 6), (8, 0.125)]
    assert [m.value for m in client.get_metric_history(run_id, "rank1/data_wait_fraction")] == [0.2] * 4
    assert client.get_metric_history(run_id, "epoch/val_accuracy")[0].step == 8

    resumed = MLflowTracker(TrainConfig(name="t", data="/d", epochs=2, mlflow=uri, mlflow_experiment="exp"),
                            run_dir, MANIFEST)
    assert resumed.run_id == run_id  # the same MLflow run goes on
    for r in records(8, 12):
        resumed.log(r)
    resumed.finish("finished", best_checkpoint(run_dir))
    resumed.close()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["epochs"] == "1" and run.data.tags["imgtrain.resumed.epochs"] == "2"
    assert [m.step for m in client.get_metric_history(run_id, "step/loss")] == [2, 4, 6, 8, 10, 12]
    assert sorted(a.path for a in client.list_artifacts(run_id, "model")) == ["model/meta.json", "model/model.pt"]
    model_pt = client.download_artifacts(run_id, "model/model.pt", str(tmp_path))
    assert torch.equal(torch.load(model_pt, weights_only=True)["w"], torch.ones(2))


def test_an_unusable_mlflow_uri_fails_at_once_with_the_uri_named(run_dir):
    from imgtrain.errors import ImgtrainError

    cfg = TrainConfig(name="t", data="/d", mlflow="nosuchscheme://x")
    with pytest.raises(ImgtrainError, match="cannot log to MLflow at nosuchscheme://x"):
        MLflowTracker(cfg, run_dir, MANIFEST)


PASSWORD = "s3cretPassw0rd"
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real MLflow tracking server (sqlite store, artifacts proxied to a folder) on a free
    127.0.0.1 port, started once for the module; yields its URI. It has no authentication: the
    credentials of a URI are sent to it and ignored. A failure under CI=true, a skip elsewhere."""
    root = tmp_path_factory.mktemp("mlflow-server")
    port = unused_port()
    uri = f"http://127.0.0.1:{port}"
    # its own session: SIGTERM reaches the uvicorn worker it starts; no job runner (needs huey)
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
    with open(root / "server.log", "wb") as log:
        server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                                   "--backend-store-uri", f"sqlite:///{root / 'ml.db'}",
                                   "--artifacts-destination", str(root / "artifacts"), "--workers", "1"],
                                  stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while server.poll() is None and time.monotonic() < deadline:
            try:
                NO_PROXY.open(f"{uri}/health", timeout=2).close()
                break
            except OSError:
                time.sleep(0.25)
        else:
            tail = (root / "server.log").read_text(errors="replace")[-1500:]
            why = f"the MLflow tracking server did not answer {uri}/health (exit code {server.poll()}):\n{tail}"
            if os.environ.get("CI", "").lower() == "true":  # CI must check it, never skip it
                pytest.fail(why)
            pytest.skip(why)
        yield uri
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def files_holding(run_dir, secret: str) -> list[str]:
    return [str(p.relative_to(run_dir)) for p in sorted(run_dir.rglob("*"))
            if p.is_file() and secret.encode() in p.read_bytes()]


@pytest.mark.integration  # a tracker's server or service process, and a run
def test_a_password_in_an_http_mlflow_uri_is_never_printed_nor_stored_and_the_server_gets_the_run(
        mlflow_server, run_dir, capfd, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    # The user asked MLflow for its "View run ... at: URL" line: with a password in the URL, not granted.
    monkeypatch.setenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "false")
    uri = mlflow_server.replace("http://", f"http://someuser:{PASSWORD}@")
    cfg = TrainConfig(name="t", data="/d", epochs=1, mlflow=uri, mlflow_experiment="exp")
    runs.write_config(run_dir, public_config(cfg))  # as the driver writes config.json
    notes = []
    (tracker,) = open_trackers(cfg, run_dir, MANIFEST, notes.append)
    for r in records(0, 4):
        tracker.log(r)
    tracker.finish("finished", best_checkpoint(run_dir))

    assert notes == []  # nothing failed on the way
    assert os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] == "false"  # the user's setting is back
    printed = capfd.readouterr()  # file descriptors 1 and 2: what a terminal or a CI log would show
    assert PASSWORD not in printed.out + printed.err
    assert files_holding(run_dir, PASSWORD) == []  # config.json, mlflow.json, logs/tracking.log, ...
    assert json.loads((run_dir / runs.CONFIG_FILE).read_text())["mlflow"] == mlflow_server

    run_id = json.loads((run_dir / MLFLOW_RUN_FILE).read_text())["run_id"]
    client = MlflowClient(mlflow_server)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "t"
    assert run.data.params["lr"] == str(cfg.lr) and run.data.params["data_train_samples"] == "256"
    assert run.data.params["mlflow"] == mlflow_server
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "step/loss")] == [(2, 0.5), (4, 0.25)]
    assert sorted(a.path for a in client.list_artifacts(run_id, "model")) == ["model/meta.json", "model/model.pt"]


@pytest.mark.integration  # a tracker's server or service process, and a run
def test_credentials_stay_out_of_errors_and_of_mlflow_log_lines(run_dir, tmp_path, capfd, monkeypatch):
    # A password holding "@" (requests reads up to the authority's last one)
    assert scrub("API request to http://u:p@ss@host:5000/api failed; see http://h/x") == \
        "API request to http://host:5000/api failed; see http://h/x"
    # Nothing listens on the port: the first request fails, with MLflow's message quoting the URL.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    port = unused_port()
    with pytest.raises(ImgtrainError) as failed:
        MLflowTracker(TrainConfig(name="t", data="/d", mlflow=f"http://someuser:{PASSWORD}@127.0.0.1:{port}"),
                      run_dir, MANIFEST)
    assert f"cannot log to MLflow at http://127.0.0.1:{port}:" in str(failed.value)
    assert PASSWORD not in str(failed.value)

    # MLflow's warnings quote the failed request (http_artifact_repo's multipart upload, with the
    # exception): they go to logs/tracking.log, which is mirrored with the run.
    cfg = TrainConfig(name="t", data="/d", mlflow=f"sqlite:///{tmp_path / 'm.db'}")
    tracker = MLflowTracker(cfg, run_dir, MANIFEST)
    try:
        raise RuntimeError(f"API request to http://someuser:{PASSWORD}@host/api/2.0/mlflow-artifacts failed")
    except RuntimeError:
        logging.getLogger("mlflow.store.artifact.http_artifact_repo").warning(
            "Failed to upload file %s using multipart upload: %s", "model.pt",
            f"http://someuser:{PASSWORD}@host/api", exc_info=True)
    tracker.close()
    log = (run_dir / "logs" / "tracking.log").read_text()
    assert "Failed to upload file model.pt using multipart upload: http://host/api" in log
    assert "RuntimeError: API request to http://host/api/2.0/mlflow-artifacts failed" in log
    assert files_holding(run_dir, PASSWORD) == []
    printed = capfd.readouterr()
    assert PASSWORD not in printed.out + printed.err


def scalars(directory, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def test_tensorboard_event_files_hold_the_metrics_and_a_restart_hides_the_steps_trained_again(run_dir):
    tracker = TensorBoardTracker(TrainConfig(name="t", data="/d", tensorboard=True), run_dir)
    for r in records(0, 8):
        tracker.log(r)
    # The worker group died after step 8 and restarts from a checkpoint at step 4: steps 6 and 8
    # are trained again, with other losses.
    for r in records(4, 8, loss_at=lambda s: 10.0 + s):
        tracker.log(r)
    tracker.finish("finished", None)
    tracker.close()
    assert scalars(run_dir / "tensorboard", "step/loss") == [(2, 0.5), (4, 0.25), (6, 16.0), (8, 18.0)]
    assert [v for _, v in scalars(run_dir / "tensorboard", "rank1/data_wait_s")] == pytest.approx([0.04] * 4)
    assert scalars(run_dir / "tensorboard", "epoch/val_accuracy") == [(8, pytest.approx(0.7))]


def test_the_base_install_needs_no_tracker_and_says_what_to_install(tmp_path):
    # Hide MLflow as if the extra were not installed; nothing else changes.
    code = ("import sys; sys.modules['mlflow'] = None; sys.argv = ['imgtrain'] + sys.argv[1:]; "
            "import imgtrain.cli, imgtrain.training.driver; assert 'tensorboard' not in sys.modules and 'wandb' not in sys.modules; imgtrain.cli.main()")
    done = subprocess.run([sys.executable, "-c", code, "train", "--name", "x", "--data", str(tmp_path),
                           "--mlflow", "sqlite:///m.db", "--storage", str(tmp_path / "runs")],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 2
    assert done.stderr.strip() == "error: --mlflow needs MLflow: pip install 'imgtrain[mlflow]'"
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------- Weights & Biases, offline


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """W&B logging offline, its settings, cache and staged artifacts in the test's folder (never
    the user's home); the run folder is where its run files go (WANDB_DIR unset)."""
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    for var, folder in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / folder))
    yield
    wandb.teardown()  # settings read afresh by the next test; a service a failed test left, stopped


def wandb_sessions(run_dir, run_id) -> list[dict]:
    """What each W&B session of ``run_id`` wrote offline (its .wandb transaction log), oldest first:
    config, history rows, artifacts, metric definitions and exit code."""
    from wandb.proto import wandb_internal_pb2

    sessions = []
    for path in (run_dir / "wandb").glob(f"offline-run-*-{run_id}*/run-{run_id}.wandb"):
        session = {"config": {}, "rows": [], "artifacts": [], "metrics": [], "summary": {}, "exit_code": None}
        for data in leveldb_log(path.read_bytes()):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                session["start"] = record.run.start_time.ToNanoseconds()
                session["config"].update({u.key: json.loads(u.value_json) for u in record.run.config.update})
            elif kind == "history":
                session["rows"].append({"/".join(i.nested_key) or i.key: json.loads(i.value_json)
                                        for i in record.history.item})
            elif kind == "summary":
                session["summary"].update({"/".join(u.nested_key) or u.key: json.loads(u.value_json)
                                           for u in record.summary.update})
            elif kind in ("artifact", "metric"):
                session[kind + "s"].append(getattr(record, kind))
            elif kind == "exit":
                session["exit_code"] = record.exit.exit_code
        sessions.append(session)
    return sorted(sessions, key=lambda s: s["start"])


def leveldb_log(data: bytes):
    """The records of W&B's transaction log: LevelDB's log format (32 KiB blocks of chunks, each
    with a 7-byte header: CRC, length, type) after a 7-byte file header (``:W&B``, magic, version)."""
    import struct

    assert data[:4] == b":W&B"
    position, pieces = 7, b""
    while position + 7 <= len(data):
        left_in_block = 32768 - position % 32768
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if left_in_block < 7 or (kind, length) == (0, 0):  # the block's padding
            position += left_in_block
            continue
        pieces += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or a record's last chunk
            yield pieces
            pieces = b""


def series(session, name) -> list[tuple[int, float]]:
    return [(row["global_step"], row[name]) for row in session["rows"] if name in row]


def wandb_services() -> list[str]:
    """W&B's service processes started by this process (wandb-core)."""
    children = []
    for task in os.listdir(f"/proc/{os.getpid()}/task"):
        # a thread may end between the listing and the reading (the suite's other threads do)
        with contextlib.suppress(FileNotFoundError), open(f"/proc/{os.getpid()}/task/{task}/children") as f:
            children += f.read().split()
    found = []
    for pid in children:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"wandb" in f.read():
                found.append(pid)
    return found


@pytest.mark.integration  # a tracker's server or service process, and a run
def test_wandb_gets_params_metrics_the_model_and_the_outcome_and_a_resume_continues_the_run(run_dir, wandb_offline):
    notes, hooks = [], (sys.exit, sys.excepthook)
    cfg = TrainConfig(name="t", data="/d", epochs=1, wandb="imgtrain-tests")
    [tracker] = open_trackers(cfg, run_dir, MANIFEST, notes.append)  # as the driver opens them
    for r in records(0, 8):
        tracker.log(r)
    tracker.finish("failed", None)
    # the service it started is stopped with it, and the hooks wandb.init sets are put back
    assert wandb_services() == [] and (sys.exit, sys.excepthook) == hooks

    run_id = json.loads((run_dir / WANDB_RUN_FILE).read_text())["run_id"]
    [files] = (run_dir / "wandb").glob(f"offline-run-*-{run_id}")  # in the run folder
    assert notes == [f"W&B: logging offline to {files} (`wandb sync` uploads it)"]
    [first] = wandb_sessions(run_dir, run_id)
    assert first["config"]["lr"] == cfg.lr and first["config"]["wandb"] == "imgtrain-tests"
    assert first["config"]["data_train_samples"] == 256 and first["config"]["data_name"] == "tiny"
    assert [(m.glob_name, m.step_metric) for m in first["metrics"] if m.step_metric] == [("*", "global_step")]
    assert series(first, "step/loss") == [(2, 0.5), (4, 0.25), (6, 1 / 6), (8, 0.125)]
    assert series(first, "rank1/data_wait_fraction") == [(s, 0.2) for s in (2, 4, 6, 8)]
    assert series(first, "epoch/val_accuracy") == [(8, 0.7)]
    assert [row["_timestamp"] for row in first["rows"] if "step/loss" in row] == [1002.0, 1004.0, 1006.0, 1008.0]
    assert first["artifacts"] == [] and first["exit_code"] == 1

    resumed = WandbTracker(TrainConfig(name="t", data="/d", epochs=2, wandb="imgtrain-tests"), run_dir, MANIFEST)
    assert resumed.run.id == run_id  # the same W&B run goes on
    for r in records(8, 12):
        resumed.log(r)
    best = best_checkpoint(run_dir)
    resumed.finish("finished", best)
    resumed.close()
    first_again, second = wandb_sessions(run_dir, run_id)
    assert second["config"]["epochs"] == 2 and series(second, "step/loss") == [(10, 0.1), (12, 1 / 12)]
    [model] = second["artifacts"]
    assert (model.type, model.name, set(model.aliases)) == ("model", f"model-{run_id}", {"best", "latest"})
    digests = {entry.path: entry.digest for entry in model.manifest.contents}
    assert set(digests) == {"model.pt", "meta.json"}  # meta.json as trackers get it: no path of this machine
    assert digests["model.pt"] == base64.b64encode(hashlib.md5((best / "model.pt").read_bytes()).digest()).decode()
    assert second["summary"]["best_checkpoint"] == best.name and second["exit_code"] == 0
    assert wandb_services() == []


def test_a_wandb_run_that_cannot_start_fails_in_one_line_and_leaves_nothing_running(run_dir, wandb_offline):
    hooks = (sys.exit, sys.excepthook)
    cfg = TrainConfig(name="t", data="/d", wandb="a/b", tensorboard=True)  # a name W&B refuses (validate would first)
    with pytest.raises(ImgtrainError) as failed:
        open_trackers(cfg, run_dir, MANIFEST, print)
    assert str(failed.value).startswith("cannot log to W&B project a/b: ") and "\n" not in str(failed.value)
    assert wandb_services() == [] and (sys.exit, sys.excepthook) == hooks
    assert not (run_dir / WANDB_RUN_FILE).exists()


def test_wandb_without_the_package_or_an_api_key_is_refused_in_one_line(tmp_path, monkeypatch):
    import wandb

    cfg = TrainConfig(name="t", data="/d", wandb="p")
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if the extra were not installed
    with pytest.raises(ImgtrainError) as refused:
        require(cfg)
    assert str(refused.value) == "--wandb needs W&B: pip install 'imgtrain[wandb]'"
    monkeypatch.undo()

    # Online, and no key anywhere: wandb.init would ask on the terminal. Refused before it starts.
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    wandb.teardown()  # settings read from this environment
    try:
        with pytest.raises(ImgtrainError) as refused:
            require(cfg)
        assert str(refused.value).startswith("--wandb logs to the W&B server and no API key was found: run "
                                             "`wandb login` or set WANDB_API_KEY, or log offline with WANDB_MODE=offline")
        assert "\n" not in str(refused.value)
        monkeypatch.setenv("WANDB_MODE", "offline")
        wandb.teardown()
        require(cfg)  # offline needs no key
    finally:
        wandb.teardown()


def test_wandb_names_w_and_b_would_refuse_are_refused_before_anything_starts():
    with pytest.raises(ImgtrainError, match=r"--wandb 'team/p' is not a W&B name.*\(the entity goes in --wandb-entity\)"):
        validate(TrainConfig(name="t", data="/d", wandb="team/p"))
    with pytest.raises(ImgtrainError, match="--wandb-entity is the entity of a --wandb project"):
        validate(TrainConfig(name="t", data="/d", wandb_entity="team"))


# ---------------------------------------------------------------- all three at once, in a bucket


def bucket_objects(env: dict, prefix: str) -> dict[str, bytes]:
    """Every object under ``prefix`` of the test bucket, by key."""
    import pyarrow.fs as pafs

    store = pafs.S3FileSystem(endpoint_override=env["IMGTRAIN_S3_ENDPOINT"].removeprefix("http://"), scheme="http",
                              region="us-east-1", access_key=env["AWS_ACCESS_KEY_ID"],
                              secret_key=env["AWS_SECRET_ACCESS_KEY"])
    infos = store.get_file_info(pafs.FileSelector(f"imgtrain/{prefix}", recursive=True))
    found = {}
    for info in infos:
        if info.type == pafs.FileType.File:
            with store.open_input_stream(info.path) as f:
                found[info.path] = f.read()
    return found


def holding(files: dict[str, bytes], *secrets: str) -> list[str]:
    return [name for name, data in files.items() if any(s.encode() in data for s in secrets)]


@pytest.mark.integration  # trains (the local backend: no Ray)
def test_no_credential_reaches_any_file_or_object_and_no_local_path_any_tracker(
        mlflow_server, s3_server, tiny_data, wandb_offline, tmp_path, tmp_path_factory):
    # The driver's command line holds the password: W&B used to record it in its run file, which
    # the run's mirror uploaded to the bucket.
    uri = mlflow_server.replace("http://", f"http://someuser:{PASSWORD}@")
    env = {**os.environ, **s3_server, "NO_PROXY": "127.0.0.1", "COLUMNS": "200",
           "IMGTRAIN_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-m", "imgtrain.cli", "train", "--data", str(tiny_data), "--storage", "s3://imgtrain/leaks",
         "--name", "all3", "--backend", "local", "--epochs", "1", "--limit-train-batches", "2", "--batch-size", "32",
         "--model", "timm:test_resnet", "--mlflow", uri, "--tensorboard", "--wandb", "imgtrain-tests"],
        capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert PASSWORD not in done.stdout + done.stderr

    local = {str(p): p.read_bytes() for p in (tmp_path / "cache").rglob("*") if p.is_file()}
    in_bucket = bucket_objects(s3_server, "leaks/all3")
    assert any("/wandb/" in k for k in in_bucket) and any("/tensorboard/" in k for k in in_bucket)
    assert holding(local, PASSWORD) == [] and holding(in_bucket, PASSWORD) == []

    # What each tracker keeps: the MLflow server's store and artifacts, what W&B's run file sends
    # its server (config, metadata, summary, history, the artifacts' metadata and files; the
    # file's own record of where W&B staged the files, for `wandb sync`, stays on this machine),
    # TensorBoard's event files. No folder of this machine in any.
    machine_paths = (str(tmp_path_factory.getbasetemp()), sys.prefix, os.getcwd())
    server_root = next(p for p in tmp_path_factory.getbasetemp().glob("mlflow-server*"))
    tracked = {str(p): p.read_bytes() for p in server_root.rglob("*") if p.is_file() and p.name != "server.log"}
    tracked |= {k: v for k, v in in_bucket.items() if "/tensorboard/" in k}
    run_dir = tmp_path / "cache" / "stores" / "s3" / "imgtrain" / "leaks" / "all3"
    [session] = wandb_sessions(run_dir, json.loads((run_dir / WANDB_RUN_FILE).read_text())["run_id"])
    [model] = session["artifacts"]
    tracked["W&B run"] = json.dumps({k: session[k] for k in ("config", "summary", "rows")}).encode()
    tracked["W&B model"] = (model.metadata + "".join(e.path for e in model.manifest.contents)).encode()
    for entry in model.manifest.contents:
        tracked[f"W&B model/{entry.path}"] = Path(entry.local_path).read_bytes()
    assert holding(tracked, PASSWORD, *machine_paths) == []
    assert session["summary"]["best_checkpoint"] == "checkpoint_epoch_0000"
    # The model's meta.json, in both, with the bucket's address (a public place) kept. The MLflow
    # server is the session's: other tests' models are there too.
    metas = [m for k, v in tracked.items()
             if k.endswith("meta.json") and (m := json.loads(v))["config"].get("storage") == "s3://imgtrain/leaks"]
    assert len(metas) == 2 and all(m["config"]["data"] == tiny_data.name for m in metas)
