"""Shared fixtures: one real local Ray cluster per test session, and small real data sets."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
# The suite runs torch in this process, in Ray's workers and in CLI processes at once, on 2 cores:
# OpenMP threads that spin while waiting for work took the cores from the others (a 2-step epoch
# in this process took 12-17 s instead of 1-2 s). Before torch is imported; children inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# numpy's OpenBLAS alike: its threads spin too (an eigh of 512x512, the Mahalanobis fit, took 6 s
# with 2 threads on the loaded machine, 0.09 s with one).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# Ray Train's controller looks at its workers every 2 s: a finished or failed worker group is
# seen that much later in every run. Tests poll faster (inherited by the clusters they start).
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
# What every Ray cluster of the suite does while no test uses it, measured on an idle one (4 CPUs,
# 60 s): 5.4 % of a core, 2.8 % with these two. Ray starts a Python worker per CPU when the first
# driver connects, for the tasks to come; each burns 1.3 % of a core waiting (its main thread),
# and the suite's tasks and actors start their own anyway. Ray's reporter gathers every process's
# usage every 5 s for a dashboard no test cluster runs.
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
os.environ.setdefault("REPORTER_UPDATE_INTERVAL_MS", "60000")


TRAINING_FIXTURES = {"local_run", "ray_run", "ray_cluster"}  # below: each trains a run or starts Ray


@pytest.hookimpl(tryfirst=True)  # before -m "not integration" deselects
def pytest_collection_modifyitems(items):
    """A test that uses a run of the session or its Ray cluster is an integration test whatever
    its file says: `make test-fast` (the unit layer) never trains nor starts Ray.

    The files that start Ray or processes first, the unit layer after (`make test`: xdist's
    --dist loadfile, --no-loadscope-reorder), so that no long one-test file (xdist's own order
    puts the files with the most tests first) is left running alone at the end. On the idle VM,
    925 tests: 1,120 and 1,233 s this way, 1,245 s in xdist's order: within the runs' spread."""
    for item in items:
        if TRAINING_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.integration)
    items.sort(key=lambda item: item.get_closest_marker("integration") is None)  # stable: files stay whole


# A function taking one of the session's runs (below; trained once per pytest process) as a fixture
SHARED_RUNS = re.compile(r"^\s*def \w+\([^)]*\b(local_run|ray_run)\b", re.MULTILINE)


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile`, except that every file reading a session run (``SHARED_RUNS``) goes to
    the same pytest process, which trains each run once: with those files spread over both
    processes, both trained ``ray_run`` (53 and 56 s) and ``local_run``. (xdist's own
    ``xdist_group`` marks do nothing under pytest 9: xdist 3.8 renames a node by an attribute
    pytest no longer reads.) The controller has the test ids only, so the file's text says
    which fixtures its functions take (a file that only mentions one runs where xdist puts it)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    @functools.cache
    def scope_of(path: str) -> str:
        return "shared-runs" if SHARED_RUNS.search((config.rootpath / path).read_text()) else path

    class SharedRunsTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid.split("::", 1)[0])

    return SharedRunsTogether(config, log)


@pytest.fixture(scope="session", autouse=True)
def _cache_of_the_session(tmp_path_factory):
    """imgtrain's cache (logs, working copies, checkpoints being saved) in the session's temporary
    folder, never the user's ~/.cache; inherited by every process the tests start."""
    saved = os.environ.get("IMGTRAIN_CACHE")
    os.environ["IMGTRAIN_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    yield
    if saved is None:
        os.environ.pop("IMGTRAIN_CACHE", None)
    else:
        os.environ["IMGTRAIN_CACHE"] = saved


@pytest.fixture(scope="session")
def ray_cluster(s3_server):
    """A real local Ray cluster, started once. 4 logical CPUs on 2 cores is fine: workers
    set their own torch thread counts. Its processes are started with the way to the test S3
    server in their environment, as a cluster's nodes have their credentials: runs in the
    bucket train on it; and with the environment imgtrain gives a private cluster of its own
    (this one is one machine's too: no Ray Train preemption watcher, 2.4 s less a fit). Yields the
    address other processes can join.

    Started as Ray's own tests start theirs (``ray.cluster_utils.Cluster``), which, unlike
    ``ray.init``, can leave out the log monitor: it sends workers' output to drivers that ask for
    it (no driver of the suite does: imgtrain joins with ``log_to_driver=False``) and looks for new
    log files 10 times a second, 2.2 % of a core late in a suite run, 45 CPU-seconds of the two
    processes' clusters."""
    import ray
    from ray._private.utils import get_ray_address_file
    from ray.cluster_utils import Cluster

    from imgtrain.cluster import ONE_MACHINE_RAY_ENV
    from imgtrain.ops.process import environment, environment_restored
    from imgtrain.training.faults import ENV_VAR as FAULT_ENV

    # Inherited by Ray's processes; this one's is left as it was. A fault a test injected before
    # it asked for the cluster is that test's, not every later run's: started with one, the
    # cluster handed it to every sweep trial of the session (an ASHA trial hung at step 3).
    with environment_restored(), environment(**s3_server, **ONE_MACHINE_RAY_ENV):
        os.environ.pop(FAULT_ENV, None)
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 4, "include_dashboard": False, "include_log_monitor": False,
            "object_store_memory": 2 * 2**30})  # Cluster's default, 150 MiB, is sized for Ray's own tests
    # Cluster writes its address where a bare ray.init() looks for one (/tmp/ray/ray_current_cluster):
    # a process of a test that starts Ray of its own must not join this one instead
    with contextlib.suppress(FileNotFoundError):
        if Path(get_ray_address_file(None)).read_text() == cluster.address:
            os.remove(get_ray_address_file(None))
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    yield cluster.address
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3 server (moto's, in a thread of this process) on 127.0.0.1 with an empty bucket
    ``imgtrain``; yields the environment a process needs to use it (endpoint, credentials, and a
    cache for working copies of its own)."""
    import pyarrow.fs as pafs
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"IMGTRAIN_S3_ENDPOINT": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
           "IMGTRAIN_CACHE": str(tmp_path_factory.mktemp("s3-cache"))}
    pafs.S3FileSystem(endpoint_override=f"{host}:{port}", scheme="http", region="us-east-1",
                      access_key="testing", secret_key="testing", allow_bucket_creation=True).create_dir("imgtrain")
    yield env
    server.stop()


@pytest.fixture(scope="session")
def sample_raw():
    """The embedded 5,000 real MNIST digits, split 4,000 / 1,000."""
    from imgtrain.data.sources.mnist_sample import load_mnist_sample

    return load_mnist_sample()


def subset(raw, n_train: int, n_test: int):
    """The first rows of each split (already in seeded random order, so classes are mixed)."""
    from imgtrain.data.raw import RawDataset, Split

    def take(split, n):
        return Split(images=split.images[:n], labels=split.labels[:n], ids=split.ids[:n])

    return RawDataset(classes=raw.classes, train=take(raw.train, n_train), test=take(raw.test, n_test))


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory, sample_raw) -> Path:
    """256 training and 100 test real MNIST digits: enough to exercise every code path fast."""
    from imgtrain.data.writer import write_dataset

    out = tmp_path_factory.mktemp("data") / "tiny"
    write_dataset(subset(sample_raw, 256, 100), out, name="tiny", source="mnist-sample")
    return out


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """{file: (size, mtime)} under ``folder``, links not followed (logs/ray is Ray's live session)."""
    found = {}
    for root, _, files in os.walk(folder):
        for name in files:
            stat = os.lstat(os.path.join(root, name))
            found[os.path.relpath(os.path.join(root, name), folder)] = (stat.st_size, stat.st_mtime_ns)
    return found


@contextlib.contextmanager
def _read_only(run_dir: Path):
    """Fails the session if a test changed a shared run: such a test must work on ``copy_run``."""
    before = _snapshot(run_dir)
    yield
    changed = sorted(set(before.items()) ^ set(_snapshot(run_dir).items()))
    assert not changed, f"a test changed the shared run {run_dir.name} ({changed[:5]}); give it copy_run(...)"


@pytest.fixture(scope="session")
def local_run(tiny_data, tmp_path_factory):
    """A finished run, trained once for every test that only reads a run (inference, report,
    serve, runs show): the tiny set, 2 epochs on the local backend (this process, no Ray). A
    test that changes a run takes ``copy_run(local_run, tmp_path)``."""
    import imgtrain

    storage = tmp_path_factory.mktemp("shared-local")
    result = imgtrain.train(tiny_config(tiny_data, storage, "local", backend="local", workers=1),
                            display=quiet_display())
    assert result.status == "finished" and len(result.history) == 2
    with _read_only(result.path):
        yield result


@pytest.fixture(scope="session")
def ray_run(ray_cluster, tiny_data, tmp_path_factory):
    """A finished Ray Train run, trained once for the tests that read what only Ray makes: 2
    workers (DDP, Ray Data ingest, validation split across ranks), 2 epochs of the tiny set."""
    import imgtrain

    storage = tmp_path_factory.mktemp("shared-ray")
    result = imgtrain.train(tiny_config(tiny_data, storage, "ray"), display=quiet_display())
    assert result.status == "finished" and len(result.history) == 2
    with _read_only(result.path):
        yield result


def copy_run(run, dest: Path) -> Path:
    """A copy of the finished ``run`` (a RunResult) in ``dest``, for a test that changes it;
    returns the storage folder holding it (``dest``), the run keeping its name."""
    import shutil

    shutil.copytree(run.path, dest / run.name, symlinks=True)
    return dest


def run_cli(*args: str, timeout: float = 240, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run the real ``imgtrain`` command in a new process; never hangs the suite."""
    return subprocess.run(
        [sys.executable, "-m", "imgtrain.cli", *args], capture_output=True, text=True,
        stdin=subprocess.DEVNULL, timeout=timeout, cwd=cwd, env={**os.environ, "COLUMNS": "200"},
    )


def cli_here(capsys, *args: str) -> subprocess.CompletedProcess:
    """The real CLI (``imgtrain.cli.main`` with these arguments) in this process: for what it
    says and does before anything trains, without the seconds a new Python process costs."""
    import warnings

    from imgtrain import cli

    capsys.readouterr()  # what this process printed before (Ray's driver prints from its own threads) is not the command's
    saved = sys.argv, warnings.showwarning, os.environ.get("COLUMNS")
    sys.argv, os.environ["COLUMNS"] = ["imgtrain", *args], "200"
    code = 0
    try:
        with warnings.catch_warnings():  # main() shows imgtrain's warnings its own way: for this call only
            cli.main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv, warnings.showwarning = saved[0], saved[1]
        if saved[2] is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = saved[2]
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["imgtrain", *args], code, out, err)


def peak_rss_of(args: list[str]) -> int:
    """Peak anonymous resident memory (bytes) of the real CLI, sampled from /proc every 20 ms
    while it runs. Anonymous only: the resident pages of torch's shared libraries (counted in
    VmHWM) varied by 80 MB between runs of the same command, more than the data under test."""
    proc = subprocess.Popen([sys.executable, "-m", "imgtrain.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    peak = 0
    while proc.poll() is None:
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
            peak = max(peak, int(next(line for line in status.splitlines() if line.startswith("RssAnon:")).split()[1]) * 1024)
        except (OSError, StopIteration):
            pass
        time.sleep(0.02)
    out, err = proc.communicate()
    assert proc.returncode == 0, err
    return peak


def quiet_display():
    """A progress display that prints nothing (tests read the run's files instead)."""
    from imgtrain.training.progress import TrainingDisplay

    return TrainingDisplay(quiet=True)


def tiny_config(data, storage, name, **overrides):
    """A short real run on the tiny data set: 2 workers, 2 epochs of 8 steps."""
    from imgtrain.config import TrainConfig

    base = dict(data=str(data), storage=str(storage), name=name, workers=2, epochs=2,
                batch_size=32, eval_batch_size=50, log_every_steps=2)
    return TrainConfig(**{**base, **overrides})


def assert_one_line_error(proc, *fragments: str) -> str:
    """The CLI's promise for bad input: exit 2, one line on stderr starting with "error:", no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    err = proc.stderr.strip()
    assert "Traceback" not in proc.stderr + proc.stdout
    assert len(err.splitlines()) == 1, err
    assert err.startswith("error:"), err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    return err


def wait_for(condition, timeout: float, what: str, proc=None, poll_s: float = 0.2) -> None:
    """Poll ``condition`` until true; fail after ``timeout`` s, or as soon as ``proc`` exits."""
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited ({proc.returncode}) before {what}: {proc.stderr.read()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(poll_s)

