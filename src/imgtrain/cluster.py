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
from dataclasses import dataclass
from pathlib import Path

from imgtrain.config import TrainConfig
from imgtrain.errors import ImgtrainError

INGEST_CPUS = 1  # logical CPUs kept free for Ray Data's read and split tasks
RAY_LOGGERS = ("ray", "ray.train", "ray.data", "ray.tune", "ray.serve")


@dataclass
class Cluster:
    started_here: bool
    dashboard_url: str | None
    session_logs: Path | None


def required_cpus(cfg: TrainConfig, workers: int | None = None) -> float:
    workers = cfg.workers if workers is None else workers
    return workers * cfg.cpus_per_worker + (INGEST_CPUS if cfg.ingest == "ray-data" else 0)


def connect(cfg: TrainConfig, log_file: Path | None = None) -> Cluster:
    """Join ``cfg.address`` or start a private local cluster sized for the plan."""
    return start_or_join(cfg.address, required_cpus(cfg), cfg.dashboard, log_file)


def start_or_join(
    address: str | None, min_cpus: float, dashboard: bool = False, log_file: Path | None = None
) -> Cluster:
    """Join ``address``, or start a private local cluster with at least ``min_cpus`` logical CPUs."""
    import ray

    route_ray_logs(log_file)
    if ray.is_initialized():  # a cluster this process already joined (library use, tests)
        return Cluster(False, None, _session_logs())
    # Worker output stays in the session's log files (linked from the run's logs/).
    kwargs = dict(log_to_driver=False, configure_logging=False, include_dashboard=dashboard)
    try:
        if address:
            ctx = ray.init(address=address, **kwargs)
        else:
            # Logical CPUs: enough for every worker plus ingest. Threads are set per worker,
            # so logical CPUs above the physical count do not oversubscribe the cores.
            num_cpus = max(os.cpu_count() or 1, math.ceil(min_cpus) + 1)
            # One machine is never preempted; the watcher would be one more process to start.
            os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
            ctx = ray.init(address="local", num_cpus=num_cpus, **kwargs)
    except ConnectionError as e:
        raise ImgtrainError(f"cannot reach the Ray cluster at {address!r}: {e}") from None
    url = getattr(ctx, "dashboard_url", None)
    return Cluster(True, f"http://{url}" if url else None, _session_logs())


def check_resources(cfg: TrainConfig) -> None:
    """Refuse, in seconds, a plan the cluster cannot place (instead of waiting forever). An
    elastic run needs room for its fewest workers; Ray Train adds more as the cluster allows."""
    import ray

    total = ray.cluster_resources()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    cpus, gpus = total.get("CPU", 0.0), total.get("GPU", 0.0)
    workers = cfg.fewest_workers()
    if cfg.use_gpu and gpus < workers:
        raise ImgtrainError(
            f"asked for {workers} GPU worker(s) but the Ray cluster has {gpus:g} GPU(s); "
            "use --cpu, fewer --workers, or a cluster with GPUs"
        )
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


def route_ray_logs(log_file: Path | None) -> None:
    """Send Ray's driver-side Python logging to the run's log file instead of the terminal."""
    if log_file is None:
        return
    handler = logging.FileHandler(log_file)
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in RAY_LOGGERS:
        logger = logging.getLogger(name)
        for h in list(logger.handlers):
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
                logger.removeHandler(h)
        for h in list(logger.handlers):  # the previous run's file, in a long-lived process
            if isinstance(h, logging.FileHandler):
                logger.removeHandler(h)
                h.close()
        logger.addHandler(handler)
        logger.propagate = False


@contextlib.contextmanager
def ray_output_to(logs: Path):
    """Keep Ray's own output out of the terminal while Ray runs.

    File descriptor 2 goes to ``driver.err`` (the C++ core and raylet write there directly);
    ``sys.stdout`` goes to ``driver.out`` (Ray's driver prints cluster warnings, such as
    "N worker processes have been started", to it from a background thread). Whoever needs
    the real terminal meanwhile must hold on to it before entering (the progress display does).
    """
    sys.stderr.flush()
    saved = os.dup(2)
    with open(logs / "driver.err", "ab") as err, open(logs / "driver.out", "a") as out:
        os.dup2(err.fileno(), 2)
        try:
            with contextlib.redirect_stdout(out):
                yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


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
