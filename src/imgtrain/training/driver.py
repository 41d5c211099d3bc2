"""The driver: checks the request, prepares the run directory, starts the workers, shows progress.

``train(cfg)`` is the whole ``imgtrain train`` verb. With ``backend="ray"`` it runs
``train_loop.train_loop_per_worker`` on Ray Train workers; with ``backend="local"`` it runs the
same loop in this process with plain PyTorch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import shutil
import socket
import threading
import time
from pathlib import Path

import torch

from imgtrain.ops import cluster as cluster_mod
from imgtrain import runs
from imgtrain import checkpoint as ckpt
from imgtrain.training import faults
from imgtrain.ops import ownership
from imgtrain.training import tracking
from imgtrain.config import TrainConfig, changed_fields, steps_per_epoch, validate
from imgtrain.training.progress import TrainingDisplay
from imgtrain.errors import ImgtrainError

POLL_S = 0.5


@dataclasses.dataclass
class Resume:
    """What the driver found in the run directory before starting the workers."""

    checkpoint: Path | None = None  # the newest checkpoint that passes verification
    damaged: list[str] = dataclasses.field(default_factory=list)  # names of those that fail it

    def to_worker(self) -> dict:
        return {"fallback": str(self.checkpoint) if self.checkpoint else None, "damaged": self.damaged}


def train(cfg: TrainConfig, display: TrainingDisplay | None = None, overwrite: bool = False) -> runs.RunResult:
    """Train (or resume) the run ``cfg.name``; return its result. Raises ImgtrainError on bad input.

    ``overwrite`` replaces an existing run of that name and starts afresh; the old run is
    deleted once the new one has its first checkpoint, and restored if it fails before that.
    """
    validate(cfg)
    tracking.require(cfg)  # a tracker asked for but not installed: before anything else
    display = display or TrainingDisplay()
    if cfg.data:
        cfg = dataclasses.replace(cfg, data=str(Path(cfg.data).expanduser().resolve()))
    run_dir = runs.run_path(cfg.storage, cfg.name)
    with contextlib.ExitStack() as held:  # the run's lock, held until training ends
        plan = _plan(cfg, run_dir, overwrite, display, held)
        replaced = ownership.Replacement(run_dir) if plan.replace else None
        if replaced:
            display.note(f"replacing the previous run {cfg.name!r} and starting afresh; the old run is deleted "
                         "once this run has its first checkpoint")
        try:
            if not ownership.is_run(run_dir):  # a new run (or the old one just moved aside)
                ownership.claim(run_dir)
                held.enter_context(ownership.locked(run_dir, "trained"))
            _probe_storage(run_dir)
            return _execute(plan, run_dir, display, replaced)
        finally:
            if replaced and not replaced.done:  # the new run failed before its first checkpoint
                replaced.rollback()
                display.note(f"the previous run {cfg.name!r} was restored ({run_dir})")


@dataclasses.dataclass
class _Plan:
    """What ``train`` found and decided before touching the run directory."""

    cfg: TrainConfig
    manifest: dict
    stored: dict | None  # the config of the run being resumed; None for a new run
    replace: bool  # --overwrite of an existing run
    resume: Resume
    complete: bool = False  # every epoch is trained already: only its history is put right


def _plan(cfg: TrainConfig, run_dir: Path, overwrite: bool, display, held: contextlib.ExitStack) -> _Plan:
    """Every check that can fail, before anything is written."""
    from imgtrain.data.format import verify_dataset

    exists = ownership.is_run(run_dir)
    if not exists and (run_dir.is_symlink() or run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir()))):
        raise ImgtrainError(f"{run_dir} already exists and is not an imgtrain run (no {ownership.MARKER_FILE}); "
                            "imgtrain does not write into other folders: choose another --name or --storage")
    stored, resume = None, Resume()
    if exists:
        held.enter_context(ownership.locked(run_dir, "trained"))  # refuses a run in use on this machine
        status = runs.read_status(run_dir)
        # On this host the lock is the truth; a driver on another host may share a file system
        # whose locks do not reach across machines: its "running" is believed.
        if status.get("status") == "running" and status.get("host") != socket.gethostname():
            raise ImgtrainError(
                f"run {cfg.name!r} is being trained right now by process {status.get('pid')} on "
                f"{status.get('host')}; wait for it or stop it (if that process is gone, delete {run_dir / runs.STATUS_FILE})"
            )
        if not ownership.is_marked(run_dir):
            ownership.mark(run_dir)  # a run made before markers: adopted
        if overwrite and not cfg.data:
            raise ImgtrainError("--overwrite starts the run afresh: pass --data as well")
        stored = None if overwrite else runs.read_config(run_dir)
    if stored is not None:
        if not cfg.data:  # `imgtrain train --name X` alone resumes X
            cfg = dataclasses.replace(cfg, data=stored["data"])
        changed = changed_fields(stored, cfg.to_dict())
        if changed:
            diffs = ", ".join(f"{k}: {stored[k]!r} -> {getattr(cfg, k)!r}" for k in changed)
            raise ImgtrainError(
                f"run {cfg.name!r} already exists in {run_dir.parent} with a different config ({diffs}); "
                "choose another --name, rerun with the original settings to resume it, or pass --overwrite "
                "to delete it and start afresh"
            )
        resume = _find_resume_point(run_dir, display)
        meta = ckpt.read_meta(resume.checkpoint) if resume.checkpoint else {}
        if meta.get("epoch", -1) + 1 >= cfg.epochs:
            display.note(f"run {cfg.name!r} is already complete ({cfg.epochs} epochs); nothing to train")
            return _Plan(cfg, meta.get("data") or {}, stored, False, resume, complete=True)
    if not cfg.data:
        raise ImgtrainError("--data is required for a new run (a directory made by `imgtrain data prepare`)")
    manifest = verify_dataset(cfg.data)
    n_train = manifest["splits"]["train"]["num_samples"]
    if steps_per_epoch(n_train, cfg.batch_size) == 0:
        raise ImgtrainError(
            f"--batch-size {cfg.batch_size} is larger than the {n_train} training samples; use a smaller batch size"
        )
    if cfg.backend == "ray" and cfg.address:  # an unreachable cluster: say so before making the run
        cluster_mod.check_joinable(cfg.address)
    if cfg.backend == "local" and cfg.use_gpu and not torch.cuda.is_available():
        raise ImgtrainError("--gpu asked for, but PyTorch sees no CUDA device here; use --cpu")
    return _Plan(cfg, manifest, stored, exists and overwrite, resume)


def _find_resume_point(run_dir: Path, display) -> Resume:
    good, bad = ckpt.verified(run_dir)
    for path, why in bad:  # never resume from damaged weights: fall back to the previous good one
        display.note(f"warning: skipping checkpoint {path.name}: {why}")
    latest = good[-1] if good else None
    if bad:
        display.note(f"resuming from {latest.name}" if latest else "no good checkpoint left: starting from scratch")
    return Resume(latest, [p.name for p, _ in bad])


def _execute(plan: _Plan, run_dir: Path, display, replaced: ownership.Replacement | None) -> runs.RunResult:
    cfg, manifest = plan.cfg, plan.manifest
    runs.write_config(run_dir, tracking.public_config(cfg))
    runs.write_status(run_dir, "running", started=time.time())
    try:
        trackers = tracking.open_trackers(cfg, run_dir, manifest, display.note)
    except ImgtrainError as e:  # a tracking URI that does not work: fail before any training
        _record_status(run_dir, "failed", error=str(e))
        raise
    records = Records(run_dir, display, trackers, on_checkpoint=replaced.commit if replaced else None)
    if plan.resume.checkpoint is not None:  # the history up to it, whatever the last driver wrote
        meta = ckpt.read_meta(plan.resume.checkpoint)
        records.recover(meta.get("step", 0), ckpt.history(meta), plan.resume.checkpoint.name)
    if plan.stored is not None and not plan.complete:
        display.note(f"resuming run {cfg.name!r} {_resume_point(plan.resume.checkpoint)} ({run_dir})")
    try:
        if not plan.complete:
            train_with = _train_local if cfg.backend == "local" else _train_ray
            train_with(cfg, manifest, run_dir, records, plan.resume)
    except BaseException as e:  # a truthful status behind, whatever the failure
        status = "interrupted" if isinstance(e, KeyboardInterrupt) else "failed"
        error = str(e) if isinstance(e, ImgtrainError) else f"{type(e).__name__}: {e}"
        _record_status(run_dir, status, **({} if status == "interrupted" else {"error": error}))
        records.finish(status)
        if replaced and ckpt.verified(run_dir)[0]:
            replaced.commit()  # the new run can be resumed: the old one goes as asked
        raise
    finally:
        display.close()
    if replaced:
        replaced.commit()
    result = runs.load_run(cfg.storage, cfg.name)
    runs.write_status(run_dir, "finished", val_accuracy=result.final_accuracy)
    records.finish("finished", result.best_checkpoint)
    result.status = "finished"
    return result


class Records:
    """Where the ranks' records go: metrics.jsonl, the progress display and the trackers.
    ``on_checkpoint`` runs once, when the first checkpoint of this session is stored."""

    def __init__(self, run_dir: Path, display: TrainingDisplay, trackers: list, on_checkpoint=None):
        self.log, self.display, self.trackers = runs.MetricsLog(run_dir), display, trackers
        self.on_checkpoint = on_checkpoint

    def send(self, record: dict) -> None:
        if record.get("checkpoint") and self.on_checkpoint:
            self.on_checkpoint()
            self.on_checkpoint = None
        if record.get("kind") == "start":  # a worker group starts: from a checkpoint, maybe a retry
            record = dict(record)
            history, source = record.pop("history", []), record.get("restored_from")
            self.log.append(record)
            self._to_screen_and_trackers(record)
            self.recover(record["step"], history, source)
            return
        self.log.append(record)
        self._to_screen_and_trackers(record)

    def recover(self, step: int, history: list[dict], source: str | None) -> None:
        """Put back the epoch records up to ``step`` that the checkpoint ``source`` holds and
        metrics.jsonl lacks (a driver killed between the checkpoint and its record)."""
        recovered = self.log.reconcile(step, history, source)
        if recovered:
            epochs = ", ".join(str(r["epoch"] + 1) for r in recovered)
            self.display.note(f"recovered the record of epoch {epochs} from {source} (the previous driver "
                              "stopped before writing it)")
        for lost in recovered:  # after the start record: TensorBoard purges what lies past it first
            for tracker in self.trackers:
                tracker.log(lost)

    def _to_screen_and_trackers(self, record: dict) -> None:
        self.display.update(record)
        for tracker in self.trackers:
            tracker.log(record)

    def finish(self, status: str, best_checkpoint: Path | None = None) -> None:
        for tracker in self.trackers:
            tracker.finish(status, best_checkpoint)


def _record_status(run_dir: Path, status: str, **extra) -> None:
    # On a full disk this write fails too; the error being raised matters more.
    with contextlib.suppress(OSError):
        runs.write_status(run_dir, status, **extra)


def _resume_point(checkpoint: Path | None) -> str:
    """'at epoch E, step S from checkpoint_...' (1-based epoch, as the display counts them)."""
    if checkpoint is None:
        return "from the start"
    meta = ckpt.read_meta(checkpoint)
    epoch = (meta.get("in_epoch") or {}).get("epoch", meta.get("epoch", -1) + 1)
    return f"at epoch {epoch + 1}, step {meta.get('step', 0)} from {checkpoint.name}"


def _probe_storage(run_dir: Path) -> None:
    try:
        (run_dir / runs.LOGS_DIR).mkdir(exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ImgtrainError(
            f"cannot write to storage {run_dir.parent}: {e.strerror or e}; choose a writable --storage"
        ) from None


# ---------------------------------------------------------------- Ray Train backend


def _train_ray(cfg: TrainConfig, manifest: dict, run_dir: Path, records: Records, resume: Resume) -> None:
    # Ray's core, raylet and driver write warnings straight to this process's stdout and
    # stderr; they go to logs/ so that the terminal shows only the progress display.
    logs = run_dir / runs.LOGS_DIR
    records.display.pin_output()
    with cluster_mod.ray_output_to(logs):
        _fit(cfg, manifest, run_dir, records, resume)


def _fit(cfg: TrainConfig, manifest: dict, run_dir: Path, records: Records, resume: Resume) -> None:
    import ray
    import ray.train
    from ray.train.torch import TorchTrainer
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from imgtrain.training.monitor import Monitor
    from imgtrain.training.watchdog import Watchdog
    from imgtrain.training.ray_backend import train_loop_per_worker

    logs = run_dir / runs.LOGS_DIR
    display = records.display
    fault = os.environ.get(faults.ENV_VAR)
    faults.parse(fault)  # a malformed spec fails here, not on every worker
    cluster = cluster_mod.connect(cfg, logs / "driver.log")
    try:
        _link_session_logs(logs, cluster.session_logs)
        cluster_mod.check_resources(cfg)
        cluster_mod.require_shared_paths(run_dir, cfg.data)
        display.note(f"run {cfg.name}: {run_dir}  (logs: {logs})")
        if cluster.dashboard_url:
            display.note(f"Ray dashboard: {cluster.dashboard_url}")
        # On the driver's own node: an actor placed on another node dies with it (an elastic run
        # losing a node would go on training with nobody receiving its records). Hard affinity:
        # Ray places an actor that needs no resources on a random node despite a soft one (3 of
        # 12 landed on the driver's node in a 3-node test); the driver's node lives as long as the driver.
        monitor = Monitor.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            ray.get_runtime_context().get_node_id(), soft=False)).remote()
        watchdog = Watchdog(run_dir, cfg.stall_timeout_s, note=display.note)
        elastic = cfg.min_workers and cfg.min_workers < cfg.workers
        trainer = TorchTrainer(
            train_loop_per_worker,
            # the workers never see tracking credentials (meta.json stores this config)
            train_loop_config={"cfg": tracking.public_config(cfg), "manifest": manifest, "monitor": monitor,
                               "resume": resume.to_worker(), "run_dir": str(run_dir), "fault": fault},
            scaling_config=ray.train.ScalingConfig(
                num_workers=(cfg.min_workers, cfg.workers) if elastic else cfg.workers, use_gpu=cfg.use_gpu,
                resources_per_worker={"CPU": cfg.cpus_per_worker, **({"GPU": 1} if cfg.use_gpu else {})},
                **({"elastic_resize_monitor_interval_s": ELASTIC_CHECK_S} if elastic else {}),
            ),
            run_config=ray.train.RunConfig(
                name=cfg.name, storage_path=str(run_dir.parent),
                failure_config=ray.train.FailureConfig(max_failures=cfg.max_failures),
                checkpoint_config=ray.train.CheckpointConfig(
                    num_to_keep=cfg.num_to_keep, checkpoint_score_attribute="val_accuracy",
                    checkpoint_score_order="max",
                ),
            ),
            datasets=_datasets(cfg),
            # Every worker gets the whole data set and takes its rows of each global batch
            # itself (worker._ray_data_ingest): exact resumption at any world size.
            dataset_config=ray.train.DataConfig(datasets_to_split=[]),
        )
        try:
            with _forward_records(monitor, records, watchdog), _start_timeout(elastic):
                trainer.fit()
        except ray.train.TrainingFailedError as e:
            # A checkpoint half copied when the failure struck (a full disk) must not stay visible.
            removed = ckpt.remove_incomplete(run_dir, keep=resume.damaged)
            if removed:
                display.note(f"removed incomplete checkpoint(s): {', '.join(removed)}")
            raise ImgtrainError(_failure_message(e, watchdog.incident, run_dir, logs)) from None
        finally:
            ray.kill(monitor)  # on a shared cluster it would outlive this run
    finally:
        cluster_mod.shutdown(cluster)


# How often an elastic run checks whether more workers fit (Ray's default is 60 s).
ELASTIC_CHECK_S = 10.0
# How long an elastic run waits for its workers' placement before trying again with the workers
# the cluster has then. Ray Train sizes the group from a view of the cluster refreshed every 20 s,
# so right after a node dies it still counts that node and, with Ray's 60 s default, sat idle
# for a minute before shrinking (measured: 72 s from the node's loss to one worker training).
ELASTIC_START_TIMEOUT_S = 20
START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"  # read by Ray Train in fit()


@contextlib.contextmanager
def _start_timeout(elastic: bool):
    """Ray's worker-group start timeout for this fit(): shorter when elastic, unless the user set one."""
    if not elastic or START_TIMEOUT_ENV in os.environ:
        yield
        return
    os.environ[START_TIMEOUT_ENV] = str(ELASTIC_START_TIMEOUT_S)
    try:
        yield
    finally:
        os.environ.pop(START_TIMEOUT_ENV, None)


def _datasets(cfg: TrainConfig):
    """Ray Data ingest: the train split, handed whole to every worker."""
    if cfg.ingest != "ray-data":
        return None
    import ray.data

    from imgtrain.data.dataset import ray_dataset

    ray.data.DataContext.get_current().enable_progress_bars = False
    return {"train": ray_dataset(cfg.data, "train")}


def _failure_message(error: Exception, incident: str | None, run_dir: Path, logs: Path) -> str:
    cause = _root_cause(error)
    if incident:
        cause = f"{incident} ({cause})"
    elif _disk_full(error):
        cause = (f"the disk holding {run_dir.parent} is full (No space left on device); "
                 "free space or choose another --storage")
    latest = next(reversed(ckpt.verified(run_dir)[0]), None)
    saved = (f"; the run resumes from {latest.name} when you run the same command again"
             if latest else "; no checkpoint was saved")
    return f"training failed: {cause}{saved}; logs: {logs}"


def _disk_full(error: BaseException) -> bool:
    seen = set()
    stack = [error, *(getattr(error, "worker_failures", None) or {}).values()]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in str(e):
            return True
        stack += [getattr(e, "cause", None), e.__cause__, e.__context__]
    return False


def _root_cause(error: Exception) -> str:
    failures = getattr(error, "worker_failures", None) or {}
    for rank, exc in sorted(failures.items()):
        cause = exc
        while getattr(cause, "cause", None) is not None:  # RayTaskError wraps the user's exception
            cause = cause.cause
        if isinstance(cause, ImgtrainError):
            return str(cause)
        lines = [line for line in str(cause).strip().splitlines() if line.strip()]
        return f"rank {rank}: {type(cause).__name__}: {lines[-1] if lines else ''}"
    text = str(error).strip().splitlines()
    return text[-1] if text else type(error).__name__


def _link_session_logs(logs: Path, session_logs: Path | None) -> None:
    link = logs / "ray"
    if session_logs is None:
        return
    with contextlib.suppress(OSError):
        if link.is_symlink():
            link.unlink()
        link.symlink_to(session_logs, target_is_directory=True)


@contextlib.contextmanager
def _forward_records(monitor, records: Records, watchdog):
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
        warned = False
        while not stop.wait(POLL_S):
            try:
                deliver()
                watchdog.check()
            except ray.exceptions.RayActorError as e:  # the mailbox is gone: say so once
                if not warned:
                    records.display.note(f"warning: progress records no longer arrive ({type(e).__name__}); "
                                         "training goes on, but metrics.jsonl and the trackers miss them")
                warned = True
            except Exception:  # a slow round trip: the records wait in the mailbox for the next one
                pass

    thread = threading.Thread(target=poll, name="imgtrain-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        with contextlib.suppress(Exception):
            deliver()  # the last records sent before fit() returned


# ---------------------------------------------------------------- local backend


def _train_local(cfg: TrainConfig, manifest: dict, run_dir: Path, records: Records, resume: Resume) -> None:
    """The same loop in this process, no Ray: the tutorial's single-device baseline."""
    from imgtrain.data.format import read_split
    from imgtrain.data.order import ordered_batches, sort_by_id
    from imgtrain.training.loop import Hooks, run_loop

    device = torch.device("cuda" if cfg.use_gpu else "cpu")
    torch.set_num_threads(cfg.threads_per_worker or os.cpu_count() or 1)
    rows = sort_by_id(*map(torch.from_numpy, read_split(cfg.data, "train")))
    test = [t for t in map(torch.from_numpy, read_split(cfg.data, "test"))]
    records.display.note(f"run {cfg.name}: {run_dir}  (local backend, {device})")
    for stale in run_dir.glob(f".{ckpt.PREFIX}*.tmp"):  # a copy cut short by a killed driver
        shutil.rmtree(stale, ignore_errors=True)

    steps = max(1, steps_per_epoch(len(rows[0]), cfg.batch_size, cfg.limit_train_batches))
    train_batches = ordered_batches(rows, cfg.seed, cfg.batch_size, steps, world_size=1, rank=0, device=device,
                                    on_device=cfg.data_on_device)

    def val_batches():
        for start in range(0, len(test[0]), cfg.eval_batch_size):
            sl = slice(start, start + cfg.eval_batch_size)
            yield {"id": test[0][sl], "image": test[1][sl].to(device), "label": test[2][sl].to(device)}

    fault = faults.parse(os.environ.get(faults.ENV_VAR))

    @contextlib.contextmanager
    def restored_checkpoint():
        yield str(resume.checkpoint) if resume.checkpoint else None  # verified by train()

    def report(metrics: dict, save_dir: str | None, name: str) -> None:
        target = run_dir / name
        tmp = run_dir / f".{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            shutil.copytree(save_dir, tmp)
            faults.maybe_fire(fault, 0, metrics["step"], run_dir, "saving")  # half copied into the run
        except (OSError, shutil.Error) as e:
            shutil.rmtree(tmp, ignore_errors=True)  # never leave half a checkpoint behind
            if _disk_full(e):
                raise ImgtrainError(f"cannot save checkpoint {name}: the disk holding {run_dir.parent} is "
                                    "full (No space left on device); free space or choose another --storage") from None
            raise
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)  # complete or invisible
        ckpt.retain(run_dir, cfg.num_to_keep, ignore=resume.damaged)

    hooks = Hooks(
        rank=0, world_size=1, device=device, prepare_model=lambda m: m.to(device), damaged=resume.damaged,
        train_batches=train_batches, val_batches=val_batches, all_reduce_sum=lambda t: t,
        restored_checkpoint=restored_checkpoint, report=report, send=records.send,
        run_dir=run_dir, fault=fault,
    )
    run_loop(TrainConfig(**tracking.public_config(cfg)), manifest, hooks)  # meta.json stores it
