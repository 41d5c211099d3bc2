"""The driver side of the Ray backend: start or join Ray, run a ``TorchTrainer`` whose workers
run ``ray_worker.train_loop_per_worker``, and forward what they send (records, heartbeats) to
metrics.jsonl, the display, the trackers and the watchdog.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from imgtrain import cluster as cluster_mod
from imgtrain.checkpoint_policy import POLICY, RAY_SNAPSHOT_FILE, RAY_SNAPSHOT_PARKED
from imgtrain.config import TrainConfig
from imgtrain.data import staging
from imgtrain.errors import ImgtrainError, one_line
from imgtrain.ops import process, remote
from imgtrain.ops.files import disk_full, link_dir
from imgtrain.storage import checkpoint as ckpt
from imgtrain.storage import location, mirror, runs
from imgtrain.training import faults, tracking
from imgtrain.training.health import HEARTBEAT_S

if TYPE_CHECKING:
    from imgtrain.training.watchdog import Watchdog

log = logging.getLogger(__name__)
# How often the driver drains the monitor (records, heartbeats) and runs the watchdog: the
# ranks' step records and heartbeats arrive once a heartbeat (health.py), so a faster poll only
# woke the driver and the monitor actor for nothing (issue 51).
POLL_S = HEARTBEAT_S
POLL_FAILING_S = 30.0  # a poll failing this long is reported on the terminal


def fit(cfg: TrainConfig, manifest: dict, run_dir: Path, records, resume, callbacks: Sequence = ()) -> None:
    """Train on Ray Train workers (``ray_worker.train_loop_per_worker``); records go to ``records``,
    and Ray Train's reports to ``callbacks`` too (its ``RunConfig.callbacks``: a sweep's, for Tune)."""
    # Ray's core, raylet and driver write warnings straight to this process's stdout and
    # stderr; they go to logs/ so that the terminal shows only the progress display.
    logs = run_dir / runs.LOGS_DIR
    faults.parse(os.environ.get(faults.ENV_VAR))  # a malformed spec fails here, not on every worker
    from imgtrain.data import stream

    display = records.display
    # a local cluster started for a streamed data set: CPUs for every rank's pipeline too
    pipelines = 0 if stream.in_memory(cfg, manifest) else cfg.workers * max(1, cfg.preprocess_cpus)
    cpus = cluster_mod.required_cpus(cfg) + pipelines
    display.phase(f"joining the Ray cluster at {cfg.address}" if cfg.address else "starting Ray")
    with cluster_mod.ray_session(cfg.address, cpus, logs, "driver.log", cfg.dashboard) as cluster:
        link_dir(logs / "ray", cluster.session_logs)
        display.phase("checking resources and storage")
        cluster_mod.check_resources(cfg)
        # a data set in an object store is copied to every node by its workers
        cluster_mod.require_shared_paths(run_dir, None if remote.is_remote(cfg.data) else cfg.data, cfg.storage)
        # until the first worker reports (its phase records): placement, processes, torch imported
        workers = f"{cfg.min_workers}-{cfg.workers}" if cfg.min_workers and cfg.min_workers < cfg.workers else cfg.workers
        display.phase(f"starting {workers} worker{'s' if workers != 1 else ''}")
        display.note(f"run {cfg.name}: {run_dir}  (logs: {logs})")
        if cluster.dashboard_url:
            display.note(f"Ray dashboard: {cluster.dashboard_url}")
        teacher_logits = None
        if cfg.teacher and cfg.distill_mode == "cached":  # Ray Data batch inference, before the workers start
            from imgtrain.training import teacher_cache

            display.phase("computing the teacher's logits")
            table = teacher_cache.ensure(cfg, manifest, display.note, on_ray=True)
            teacher_cache.require_on_every_node(table, run_dir)
            teacher_logits = table.to_dict()
        _fit(cfg, manifest, run_dir, records, resume, callbacks, teacher_logits, private=cluster.private)


def _fit(cfg: TrainConfig, manifest: dict, run_dir: Path, records, resume, callbacks: Sequence,
         teacher_logits=None, private: bool = False) -> None:
    """``private``: the Ray cluster was started by this command (it ends with it)."""
    import ray
    import ray.train
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from imgtrain.training.monitor import Monitor
    from imgtrain.training.watchdog import Watchdog

    # On the driver's own node: an actor placed on another node dies with it (an elastic run
    # losing a node would go on training with nobody receiving its records). Hard affinity:
    # Ray places an actor that needs no resources on a random node despite a soft one (3 of
    # 12 landed on the driver's node in a 3-node test); the driver's node lives as long as the driver.
    monitor = Monitor.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        ray.get_runtime_context().get_node_id(), soft=False)).remote()
    watchdog = Watchdog(run_dir, cfg.stall_timeout_s, note=records.display.note)
    elastic = bool(cfg.min_workers and cfg.min_workers < cfg.workers)
    try:
        trainer = _trainer(cfg, manifest, run_dir, monitor, resume, elastic, callbacks, teacher_logits, private)
        with _forward_records(monitor, records, watchdog), _start_timeout(elastic), \
                _ray_snapshot_in_place(run_dir, remote.is_remote(cfg.storage)):
            try:
                trainer.fit()
            except KeyboardInterrupt:  # Ctrl-C (or a hangup, cli.py): the workers stop before the driver goes on
                _abort(trainer.controller)
                raise
    except ray.train.TrainingFailedError as e:
        # A checkpoint half copied when the failure struck (a full disk) must not stay visible.
        store = location.store(cfg.storage) if remote.is_remote(cfg.storage) else None
        unread = None
        try:
            if store:  # what the workers uploaded, to be judged here
                mirror.pull(store, cfg.name, only_checkpoints=True, owner=True)  # this driver holds the lock
            removed = ckpt.remove_incomplete(run_dir, keep=resume.damaged)
            for name in removed if store else ():
                mirror.delete(store, cfg.name, name)
        except ImgtrainError:  # the bucket failing too: the training failure is the one to tell
            removed, unread = [], store.uri
        if removed:
            records.display.note(f"removed incomplete checkpoint(s): {', '.join(removed)}")
        raise ImgtrainError(_failure_message(e, watchdog, run_dir, run_dir / runs.LOGS_DIR, unread)) from None
    finally:
        ray.kill(monitor)  # on a shared cluster it would outlive this run


@contextlib.contextmanager
def _ray_snapshot_in_place(run_dir: Path, in_store: bool):
    """Ray Train's record of the run's checkpoints where Ray reads and writes it while it trains,
    parked under a hidden name otherwise: beside the checkpoints, its name looks like one. (A
    driver killed meanwhile leaves it in place: Ray finds it there next time.) Not in an object
    store: Ray writes it there itself, and the working copy's is only a copy."""
    ray_name, parked = run_dir / RAY_SNAPSHOT_FILE, run_dir / RAY_SNAPSHOT_PARKED
    if not in_store and parked.is_file():
        if ray_name.exists():  # Ray's own is the newer one
            parked.unlink()
        else:
            parked.rename(ray_name)
    try:
        yield
    finally:
        if not in_store and ray_name.is_file():
            ray_name.replace(parked)


ABORT_TIMEOUT_S = 30.0  # it takes a second or two; a cluster failing too is not waited on longer


def _abort(controller) -> None:
    """Stop an interrupted run's workers, as Ray's own Ctrl-C handler would have: on a joined
    cluster they would otherwise train on until Ray notices that the driver is gone, and a
    resume started meanwhile would find them still writing checkpoints. ``controller``: None
    when the interrupt came before Ray Train started one."""
    if controller is None:
        return
    import ray

    try:  # the controller ends its own process once the workers are stopped: that error is expected
        ray.get(controller.abort.remote(), timeout=ABORT_TIMEOUT_S)
    except ray.exceptions.RayActorError:
        pass
    except Exception as e:  # noqa: BLE001 - the interrupt is what the user is told; the cluster's end follows
        log.warning("could not abort the Ray Train run: %s", one_line(e))


def _interruptible(trainer_class):
    """``trainer_class`` (Ray's TorchTrainer) with SIGINT left to imgtrain.

    Ray Train 2.60 (``ray/train/v2/api/data_parallel_trainer.py``, ``_register_sigint_handler``)
    replaces the process's SIGINT handler inside ``fit()``, just before it waits on its controller
    actor. Its handler asks the controller to abort, then calls ``sys.exit(0)``; raised in a signal
    handler during ``ray.get``, Ray's core turns that into ``SystemExit(1)``. So Ctrl-C printed
    nothing, left status.json ``failed`` ("SystemExit: 1") and exited 1. Here the handler is never
    installed: SIGINT stays Python's KeyboardInterrupt (which ``ray.get`` raises as it is), the
    controller is kept, and ``_fit`` aborts it itself, then lets the interrupt go on to the driver
    (status ``interrupted``, the display closed) and the CLI (how to resume, exit status)."""

    class Interruptible(trainer_class):
        controller = None

        def _register_sigint_handler(self, controller):
            self.controller = controller

    return Interruptible


def _lighter(trainer_class, private: bool):
    """``trainer_class`` without Ray Train's placement-group cleaner on a ``private`` cluster.

    The cleaner (Ray 2.60 ``PlacementGroupCleanerCallback``) is a detached actor that asks the
    GCS every second, for the whole run, whether the Train controller still lives, to free its
    placement groups if it died without doing so (issue 51: the cleaner and the GCS were among
    the largest CPU users beside the worker). A private cluster, its placement groups with it,
    ends with this command, so there is nothing for it to clean. A joined cluster keeps it as
    Ray made it: a slower check would also slow every run's end, as its stop waits out one
    check interval."""
    if not private:
        return trainer_class

    class Lighter(trainer_class):
        def _create_default_callbacks(self):
            callbacks = super()._create_default_callbacks()
            try:
                from ray.train.v2._internal.callbacks.placement_group_callback import (
                    PlacementGroupCleanerCallback,
                )
            except ImportError:  # another Ray version: its own defaults
                return callbacks
            return [c for c in callbacks if not isinstance(c, PlacementGroupCleanerCallback)]

    return Lighter


def _trainer(cfg: TrainConfig, manifest: dict, run_dir: Path, monitor, resume, elastic: bool, callbacks: Sequence,
             teacher_logits=None, private: bool = False):
    """The TorchTrainer of this run: its workers, checkpoints kept, failures retried, data."""
    import ray.train
    from ray.train.torch import TorchTrainer

    from imgtrain.training.ray_worker import train_loop_per_worker

    return _lighter(_interruptible(TorchTrainer), private)(
        train_loop_per_worker,
        # the workers never see tracking credentials (meta.json stores this config)
        train_loop_config={"cfg": tracking.public_config(cfg), "manifest": manifest, "monitor": monitor,
                           "resume": resume.to_worker(), "run_dir": str(run_dir),
                           "fault": os.environ.get(faults.ENV_VAR),
                           # where the table is (logits_table.Ref), never its numbers: each worker reads its rows
                           "teacher_logits": teacher_logits},
        scaling_config=ray.train.ScalingConfig(
            num_workers=(cfg.min_workers, cfg.workers) if elastic else cfg.workers, use_gpu=cfg.use_gpu,
            resources_per_worker={"CPU": cfg.cpus_per_worker, **({"GPU": 1} if cfg.use_gpu else {})},
            **({"elastic_resize_monitor_interval_s": ELASTIC_CHECK_S} if elastic else {}),
        ),
        run_config=ray.train.RunConfig(
            name=cfg.name, **_storage(cfg, run_dir),
            failure_config=ray.train.FailureConfig(max_failures=cfg.max_failures),
            # as the local backend's retention, by the run's --select-metric
            checkpoint_config=POLICY.for_metric(cfg.select_metric).keeping(cfg.num_to_keep).ray_config(),
            callbacks=list(callbacks),
        ),
        datasets=_datasets(cfg, manifest),
        # Every worker gets the whole data set and takes its rows of each global batch
        # itself (ray_worker._ray_data_ingest): exact resumption at any world size.
        dataset_config=ray.train.DataConfig(datasets_to_split=[]),
    )


def _storage(cfg: TrainConfig, run_dir: Path) -> dict:
    """Where Ray Train keeps the run: the storage folder, or the object store itself (the
    workers upload their checkpoints there; credentials stay in each node's environment)."""
    if remote.is_remote(cfg.storage):
        store = location.store(cfg.storage)
        return {"storage_path": store.root, "storage_filesystem": store.fs}
    return {"storage_path": str(run_dir.parent)}


# How often an elastic run checks whether more workers fit (Ray's default is 60 s).
ELASTIC_CHECK_S = 10.0
# How long an elastic run waits for its workers' placement before trying again with the workers
# the cluster has then. Ray Train sizes the group from a view of the cluster refreshed every 20 s,
# so right after a node dies it still counts that node and, with Ray's 60 s default, sat idle
# for a minute before shrinking (measured: 72 s from the node's loss to one worker training).
ELASTIC_START_TIMEOUT_S = 20
START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"  # read by Ray Train in fit()


def _start_timeout(elastic: bool):
    """Ray's worker-group start timeout for this fit(): shorter when elastic, unless the user set one."""
    return process.environment(**({START_TIMEOUT_ENV: str(ELASTIC_START_TIMEOUT_S)} if elastic else {}))


def _datasets(cfg: TrainConfig, manifest: dict):
    """Ray Data ingest of a small data set: the train split, handed whole to every worker (a
    streamed data set is read by each worker's own pipeline, ``ingest.py``)."""
    from imgtrain.data import stream

    if cfg.ingest != "ray-data" or not stream.in_memory(cfg, manifest):
        return None
    from imgtrain.data.dataset import ray_dataset

    return {"train": ray_dataset(staging.local_data(cfg.data), "train")}


def _failure_message(error: Exception, watchdog: Watchdog, run_dir: Path, logs: Path, unread: str | None = None) -> str:
    """``unread``: the object store whose checkpoints could not be listed just now."""
    cause = _root_cause(error, skip_ranks=watchdog.killed_ranks)
    if watchdog.incident:
        cause = f"{watchdog.incident} ({cause})" if cause else watchdog.incident
    elif disk_full(error):
        cause = (f"the disk holding {run_dir.parent} is full (No space left on device); "
                 "free space or choose another --storage")
    latest = next(reversed(ckpt.verified(run_dir)[0]), None)
    if unread:  # the store itself is unreachable: its latest checkpoint is where the run goes on
        saved = (f"; {unread} could not be read just now: when it can, the same command resumes from the "
                 "latest checkpoint that reached it")
    else:
        saved = (f"; the run resumes from {latest.name} when you run the same command again"
                 if latest else "; no checkpoint was saved")
    return f"training failed: {cause}{saved}; logs: {logs}"


def _root_cause(error: Exception, skip_ranks: set[int] = frozenset()) -> str:
    """The first failing rank's own words; ranks the watchdog killed are skipped (Ray would call
    their death a possible OOM kill), so a stall reads as the stall plus what the others saw."""
    failures = getattr(error, "worker_failures", None) or {}
    if failures and set(failures) <= set(skip_ranks):
        return ""
    for rank, exc in sorted(failures.items()):
        if rank in skip_ranks:
            continue
        cause = exc
        while getattr(cause, "cause", None) is not None:  # RayTaskError wraps the user's exception
            cause = cause.cause
        if isinstance(cause, ImgtrainError):
            return str(cause)
        lines = [line for line in str(cause).strip().splitlines() if line.strip()]
        return f"rank {rank}: {type(cause).__name__}: {lines[-1] if lines else ''}"
    text = str(error).strip().splitlines()
    return text[-1] if text else type(error).__name__


@contextlib.contextmanager
def _forward_records(monitor, records, watchdog):
    """While training runs, move records from the monitor actor to metrics.jsonl, the display
    and the trackers, and heartbeats to the watchdog."""
    import ray

    stop = threading.Event()

    def deliver():
        sent, beats = ray.get(monitor.drain.remote(), timeout=30)
        for record in sent:
            records.send(record)
        watchdog.observe(beats)

    def poll():
        warned, failing_since = False, None
        while not stop.wait(POLL_S):
            try:
                deliver()
                watchdog.check()
                failing_since = None
            except ray.exceptions.RayActorError as e:  # the mailbox is gone: say so once
                if not warned:
                    records.display.note(f"warning: progress records no longer arrive ({type(e).__name__}); "
                                         "training goes on, but metrics.jsonl and the trackers miss them")
                warned = True
            except Exception as e:  # a slow round trip: the records wait in the mailbox for the next one
                log.warning("progress poll failed: %s", one_line(e), exc_info=True)
                failing_since = failing_since or time.monotonic()
                if not warned and time.monotonic() - failing_since > POLL_FAILING_S:
                    # never a silent end of hang detection: the watchdog runs in this loop
                    records.display.note(f"warning: progress records and hang detection have failed for "
                                         f"{POLL_FAILING_S:.0f} s ({type(e).__name__}: {one_line(e, 200)}); "
                                         "training goes on; see logs/driver.log")
                    warned = True

    thread = threading.Thread(target=poll, name="imgtrain-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        with contextlib.suppress(Exception):
            deliver()  # the last records sent before fit() returned


