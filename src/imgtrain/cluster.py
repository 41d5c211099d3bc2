"""Starting or joining Ray, planning its CPUs, and keeping its noise out of the terminal.

Two waits that never end in plain Ray Train are turned into errors here, before training starts:
  * two 1-CPU workers on a 2-CPU machine leave no CPU for Ray Data's read tasks: the job
    waits forever. We keep CPUs free for ingest and refuse plans that do not fit.
  * ``use_gpu=True`` on a cluster without enough GPUs waits forever for placement.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

from imgtrain.config import TrainConfig
from imgtrain.errors import ImgtrainError, ImgtrainWarning
from imgtrain.ops import process

INGEST_CPUS = 1  # logical CPUs kept free for Ray Data's read and split tasks
RAY_LOGGERS = ("ray", "ray.train", "ray.data", "ray.tune", "ray.serve")


@dataclass
class Cluster:
    started_here: bool
    dashboard_url: str | None
    session_logs: Path | None
    private: bool = False  # a new local cluster, started by this process: it ends with it


GPU_PROCESS_THREADS = 2


def threads_for(sharing: int, given: int = 0, gpu: bool = False) -> int:
    """torch threads for one of ``sharing`` processes on this machine's cores; ``given`` (a
    user's setting) wins. More threads than cores made OpenMP spin against the other processes
    (a grid_sample went from 1.6 to 34 ms, docs/NOTES.md). A process training on a GPU does
    only small host work between kernels, and each CPU op then waits for every sleeping
    intra-op thread to wake (sin/cos of 128 numbers every 15 ms: 24 ms with 2 threads against
    0.1 ms with 1, issue 19): it gets ``GPU_PROCESS_THREADS``."""
    if given:
        return given
    return GPU_PROCESS_THREADS if gpu else max(1, (os.cpu_count() or 1) // max(1, sharing))


def require_gpus(needed: int, what: str, hint: str) -> None:
    """Refuse in seconds what Ray would wait for forever: GPU work on a cluster with too few GPUs."""
    import ray

    gpus = ray.cluster_resources().get("GPU", 0.0)
    if gpus < needed:
        raise ImgtrainError(f"asked for {needed} {what} but the Ray cluster has {gpus:g} GPU(s); {hint}")


def user_log_dir() -> Path:
    """Where Ray's logs go when there is no run directory (evaluate, predict, a bare checkpoint
    served): this user's own cache folder, not a folder in /tmp that every user shares."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    folder = base / "imgtrain" / "logs"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    return folder


def required_cpus(cfg: TrainConfig, workers: int | None = None) -> float:
    workers = cfg.workers if workers is None else workers
    return workers * cfg.cpus_per_worker + (INGEST_CPUS if cfg.ingest == "ray-data" else 0)


def cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's or taskset's share)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def warn_if_oversubscribed(cfg: TrainConfig, cores_here: int | None = None) -> None:
    """One line when the workers of a cluster started here ask for more CPUs than this machine
    has cores. Ray is then started with as many logical CPUs as asked, so nothing waits for
    placement: every worker starts, and all of them take turns on the cores (16 workers on 2
    cores: 159 s for one step, issue 46). A joined cluster (``--address``, or one this process
    joined already: library use) is held to its own CPUs by ``check_resources``."""
    cores_here = cores_here or cores()
    asked = cfg.workers * cfg.cpus_per_worker
    ray = sys.modules.get("ray")  # not imported for this: seconds
    if cfg.backend != "ray" or cfg.address or asked <= cores_here or (ray and ray.is_initialized()):
        return
    fits = int(cores_here // cfg.cpus_per_worker)
    hint = f"--workers {fits} or fewer fit" if fits else "lower --cpus-per-worker"
    warnings.warn(f"{cfg.workers} workers x {cfg.cpus_per_worker:g} CPU = {asked:g} CPUs on this machine's "
                  f"{cores_here} cores: they take turns on the cores, and start-up and every step are that much "
                  f"slower; {hint}", ImgtrainWarning, stacklevel=2)


# The environment of a private cluster's processes (a user's own setting wins). Ray Train 2.60
# starts a preemption watcher with every worker group, an actor that asks the GCS every 5 s which
# nodes are draining, to log it; one machine is never drained, and the watcher's process cost each
# fit 2.4 s and 4 CPU-seconds of a tiny 2-worker run's 17 s and 29 (2 cores, n = 4).
ONE_MACHINE_RAY_ENV = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}


@contextlib.contextmanager
def ray_session(address: str | None, min_cpus: float, logs: Path, log_name: str, dashboard: bool = False,
                private_env: dict[str, str] | None = None):
    """Ray for the length of a command: ``address`` joined, or a private local cluster with at
    least ``min_cpus`` logical CPUs started (and shut down at the end); Ray's output goes to
    ``logs`` (``log_name`` for its Python loggers), never to the terminal. ``private_env``: more
    environment for a private cluster's processes (a joined cluster keeps its own)."""
    env = {} if address else {**ONE_MACHINE_RAY_ENV, **(private_env or {})}
    import ray
    import ray.data

    with contextlib.ExitStack() as scoped:
        scoped.enter_context(process.output_to(logs))
        scoped.enter_context(process.loggers_to(logs / log_name, RAY_LOGGERS))
        scoped.enter_context(process.environment_restored())  # ray.init writes some of its own
        scoped.enter_context(process.environment(**env))
        # Ray Data's progress bars would draw over ours (and fill CI logs)
        scoped.enter_context(process.attribute(ray.data.DataContext.get_current(), "enable_progress_bars", False))
        try:
            with process.signal_handlers_restored():  # ray.init sets SIGTERM to sys.exit: a stop would be a failure
                cluster = start_or_join(address, min_cpus, dashboard)
        except BaseException:  # a half-started Ray (a SIGTERM during ray.init): its atexit hook is too late
            with contextlib.suppress(Exception):
                ray.shutdown()
            raise
        try:
            yield cluster
        finally:
            shutdown(cluster)


def starts_its_own(address: str | None) -> bool:
    """Whether ``address`` means a private cluster, started (and ended) by this command: none
    given, or Ray's "local"."""
    return address in (None, "", "local")


def start_or_join(address: str | None, min_cpus: float, dashboard: bool = False) -> Cluster:
    """Join ``address``, or start a private local cluster with at least ``min_cpus`` logical CPUs."""
    import ray

    if ray.is_initialized():  # a cluster this process already joined (library use, tests)
        return Cluster(False, None, _session_logs())
    # Worker output stays in the session's log files (linked from the run's logs/).
    kwargs = dict(log_to_driver=False, configure_logging=False, include_dashboard=dashboard)
    try:
        if address:
            ctx = ray.init(address=check_joinable(address), **kwargs)
        else:
            # Logical CPUs: enough for every worker plus ingest. Threads are set per worker,
            # so logical CPUs above the physical count do not oversubscribe the cores.
            num_cpus = max(os.cpu_count() or 1, math.ceil(min_cpus) + 1)
            # Ray blocks SIGINT in the processes it starts (services.py) so that Ctrl-C, sent to
            # the terminal's whole process group, reaches only the driver, which stops them in
            # order; a hangup (SIGHUP, to the same group) killed GCS and the raylet under the
            # driver instead, which then hung for a minute and died with its run "running".
            with process.hangup_blocked():
                ctx = ray.init(address="local", num_cpus=num_cpus, **kwargs)
    except ConnectionError as e:
        raise ImgtrainError(f"could not join the Ray cluster at {address}: {e}") from None
    url = getattr(ctx, "dashboard_url", None)
    return Cluster(True, f"http://{url}" if url else None, _session_logs(),
                   private=starts_its_own(address))


def check_joinable(address: str, timeout_s: float = 5.0) -> str:
    """Fail in seconds when nothing answers at ``address`` (ray.init would wait for minutes) or
    when the cluster refuses this process (token authentication: ray.init retries for ~20 s).
    Returns the address for ray.init: "auto" resolved to the cluster's HOST:PORT.

    ``ray start --head`` turns token authentication on by default since Ray 2.59, but a process
    that joins does not (until Ray 2.61). When the cluster asks for a token and this machine has
    one (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token), token mode is turned on here;
    only then: a client in token mode cannot run actors on a cluster without authentication
    (they die as they start). That is why ray.init never gets "auto": given "auto", Ray 2.60
    turns token mode on whenever ~/.ray/auth_token exists, and any private cluster (``make demo``)
    leaves one there, so a cluster started without authentication could no longer be joined.
    """
    if address == "local":  # Ray's name for "start a new local cluster"
        return address
    target = _reachable(address, timeout_s)
    if address.startswith("ray://"):  # Ray Client has its own handshake
        return address
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
        from ray._raylet import GcsClient
        from ray.exceptions import AuthenticationError
    except ImportError:  # another Ray version: ray.init will tell
        return target

    def refuses() -> bool:
        try:
            with process.stderr_silenced():  # Ray's C++ client logs each refusal to fd 2
                GcsClient(address=target).internal_kv_get(b"session_name", b"session", timeout=timeout_s)
            return False
        except AuthenticationError:
            return True
        except Exception:  # anything else: let ray.init report it
            return False

    def use_local_token() -> bool:
        quiet = logging.getLogger(maybe_enable_token_auth_if_token_available.__module__)
        level = quiet.level
        quiet.setLevel(logging.ERROR)  # not Ray's "token authentication is enabled" warning on the terminal
        try:
            return maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
        finally:
            quiet.setLevel(level)

    if refuses() and (not use_local_token() or refuses()):
        raise ImgtrainError(
            f"the Ray cluster at {address} requires token authentication and refused this process; set "
            "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN=<the output of `ray get-auth-token` on its head node>"
        )
    return target


def _reachable(address: str, timeout_s: float) -> str:
    """The cluster's GCS host:port, after a TCP connection to it succeeded."""
    import socket

    import ray._private.services as services

    target = address
    if address.startswith("ray://"):
        target = address.removeprefix("ray://")
    else:
        try:  # "auto": the cluster `ray start` last started here, or RAY_ADDRESS
            target = services.canonicalize_bootstrap_address(address) or address
        except ConnectionError:
            raise ImgtrainError(f"--address {address}: no running Ray cluster found on this machine; "
                                "start one with `ray start --head`, or pass its address (HOST:6379)") from None
    host, _, port = target.rpartition(":")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e) or type(e).__name__
        raise ImgtrainError(
            f"cannot reach the Ray cluster at {address} ({reason}); check the address (HOST:PORT, port 6379 "
            "by default) and that `ray start --head` runs there"
        ) from None
    return target


def check_resources(cfg: TrainConfig) -> None:
    """Refuse, in seconds, a plan the cluster cannot place (instead of waiting forever). An
    elastic run needs room for its fewest workers; Ray Train adds more as the cluster allows."""
    import ray

    total = ray.cluster_resources()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    cpus = total.get("CPU", 0.0)
    workers = cfg.fewest_workers()
    if cfg.use_gpu:
        require_gpus(workers, "GPU worker(s)", "use --cpu, fewer --workers, or a cluster with GPUs")
    need = required_cpus(cfg, workers)
    if cpus < need:
        raise ImgtrainError(
            f"asked for {workers} worker(s) x {cfg.cpus_per_worker:g} CPU plus {INGEST_CPUS} CPU kept for "
            f"data ingest = {need:g} CPUs, but the Ray cluster has {cpus:g}; use fewer --workers"
        )
    biggest = max((n["Resources"].get("CPU", 0.0) for n in nodes), default=0.0)
    if biggest < cfg.cpus_per_worker:
        raise ImgtrainError(
            f"each worker needs {cfg.cpus_per_worker:g} CPUs on one node, the largest node has {biggest:g}"
        )


def require_shared_paths(run_dir: Path, data_dir: str | None, storage: str | None = None) -> None:
    """On a cluster of several nodes, refuse to start unless every node sees the run directory
    (and can write there) and the data set at the same paths as this driver. Otherwise workers
    would write checkpoints to disks of their own and the run could never resume. With runs in
    an object store (``storage``), every node must reach it instead."""
    import ray

    from imgtrain.ops import remote

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) == 1 and nodes[0]["NodeID"] == ray.get_runtime_context().get_node_id():
        return  # one machine: the driver's own files
    manifest = [str(Path(data_dir) / "manifest.json")] if data_dir else []
    if storage and remote.is_remote(storage):
        problems = check_store_from_nodes(storage, manifest)
        if problems:
            raise ImgtrainError(f"not every node of the cluster can use --storage {storage} and --data: "
                                f"{'; '.join(problems)}")
        return
    problems = check_shared_paths(run_dir, manifest)
    if problems:
        raise ImgtrainError(
            f"storage is not shared by every node of the cluster: {'; '.join(problems)}; --storage and --data must "
            "be on a filesystem every node mounts at the same path (NFS or another shared file system, see "
            "docs/clusters.md, 'From a laptop to a cluster')"
        )


PROBE_TIMEOUT_S = 60.0


def check_shared_paths(write_dir: Path, read_files=()) -> list[str]:
    """One line per problem: a live node that cannot see a file this process writes in
    ``write_dir``, cannot write there itself, or cannot read one of ``read_files``."""
    import time
    import uuid

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    token = uuid.uuid4().hex
    probe = Path(write_dir) / f".imgtrain-probe-{token}"
    probe.write_text(token)
    problems = []
    try:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        pending = {
            n["NodeID"]: ray.remote(_probe_node).options(
                num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
            ).remote(str(probe), token, list(map(str, read_files)))
            for n in nodes
        }
        deadline = time.monotonic() + PROBE_TIMEOUT_S
        for node in nodes:
            where = f"node {node['NodeManagerAddress']} ({node['NodeID'][:8]})"
            try:
                found = ray.get(pending[node["NodeID"]], timeout=max(1.0, deadline - time.monotonic()))
            except ray.exceptions.GetTimeoutError:
                problems.append(f"{where} did not answer within {PROBE_TIMEOUT_S:g} s")
                continue
            if not found and not Path(f"{probe}-{node['NodeID']}").is_file():  # its write went elsewhere
                found = [f"writes in {write_dir} where this driver cannot see them"]
            problems += [f"{where} {what}" for what in found]
    finally:
        for leftover in Path(write_dir).glob(f"{probe.name}*"):
            leftover.unlink(missing_ok=True)
    return problems


def check_store_from_nodes(storage: str, read_files=()) -> list[str]:
    """One line per live node that cannot write, read back and delete an object in the object
    store ``storage`` with its own environment's credentials (``remote.probe`` on each node),
    or cannot read one of ``read_files``."""
    import time

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    pending = {n["NodeID"]: ray.remote(_probe_store).options(
        num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
    ).remote(storage, list(map(str, read_files))) for n in nodes}
    deadline, problems = time.monotonic() + PROBE_TIMEOUT_S, []
    for node in nodes:
        where = f"node {node['NodeManagerAddress']} ({node['NodeID'][:8]})"
        try:
            found = ray.get(pending[node["NodeID"]], timeout=max(1.0, deadline - time.monotonic()))
        except ray.exceptions.GetTimeoutError:
            found = [f"did not answer within {PROBE_TIMEOUT_S:g} s"]
        problems += [f"{where}: {what}" for what in found]
    return problems


def _probe_store(storage: str, read_files: list[str]) -> list[str]:
    """Runs on one node: why it cannot use the object store or read the files."""
    import os

    from imgtrain.ops import remote
    from imgtrain.storage import location

    problems = [f"cannot read {path}" for path in read_files if not os.path.isfile(path)]
    try:
        remote.probe(location.store(storage))
    except ImgtrainError as e:
        problems.append(str(e))
    return problems


def _probe_node(probe: str, token: str, read_files: list[str]) -> list[str]:
    """Runs on one node: what it cannot see, write or read there."""
    import os

    import ray

    problems = []
    try:
        with open(probe) as f:
            seen = f.read() == token
    except OSError:
        seen = False
    if not seen:
        problems.append(f"cannot see {os.path.dirname(probe)} (a file written there by the driver is missing)")
    else:
        try:
            with open(f"{probe}-{ray.get_runtime_context().get_node_id()}", "w") as f:
                f.write(token)
        except OSError as e:
            problems.append(f"cannot write in {os.path.dirname(probe)} ({e.strerror})")
    problems += [f"cannot read {path}" for path in read_files if not os.path.isfile(path)]
    return problems


def _session_logs() -> Path | None:
    try:
        import ray._private.worker as worker

        return Path(worker._global_node.get_session_dir_path()) / "logs"
    except Exception:  # joined through ray:// or internals moved: the link is a convenience only
        return None


def shutdown(cluster: Cluster) -> None:
    import ray

    if cluster.started_here and ray.is_initialized():
        ray.shutdown()
