"""``imgtrain tune``: check the request, size the concurrency to the cluster, run (or resume)
the Ray Tune experiment, and print one line per trial state change.

Each trial is a Tune function trainable (``trial.run_trial``) that runs an ordinary imgtrain
run; Ray Train's workers it starts are not counted in the trial's own resources, so the number
of trials at once is set here from the cluster's CPUs and GPUs (otherwise trials that each
hold a placement wait for each other's workers forever, ray-project/ray#54305).
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import time
from pathlib import Path

from ray.tune.schedulers import AsyncHyperBandScheduler, TrialScheduler
from ray.tune.search.basic_variant import BasicVariantGenerator

from imgtrain import cluster as cluster_mod
from imgtrain.config import TrainConfig, validate
from imgtrain.errors import ImgtrainError, one_line
from imgtrain.ops.files import link_dir
from imgtrain.storage import checkpoint as ckpt
from imgtrain.storage import location, ownership, runs
from imgtrain.sweep import state as st
from imgtrain.sweep.request import SWEEP_KEYS, SweepRequest
from imgtrain.sweep.space import METRICS, SCHEDULERS
from imgtrain.sweep.trial import EPOCHS_DONE, run_trial, to_tune
from imgtrain.training import faults, tracking

# A trial's own CPU reservation in Ray: Tune refuses 0, and its workers hold the real CPUs.
TRIAL_CPU = 0.01


def check(req: SweepRequest) -> SweepRequest:
    """Every check that needs no cluster; returns the request with absolute paths and its mode."""
    issues = []
    if not req.search:
        issues.append("nothing to search: give at least one --search NAME=FUNC(ARGS)")
    if req.trials < 1:
        issues.append(f"--trials must be at least 1, got {req.trials}")
    if req.scheduler not in SCHEDULERS:
        issues.append(f"--scheduler {req.scheduler!r} is not one of {', '.join(SCHEDULERS)}")
    if req.metric not in METRICS:
        issues.append(f"--metric {req.metric!r} is not one of {', '.join(METRICS)}")
    mode = req.mode or METRICS.get(req.metric, "max")
    if mode not in ("max", "min"):
        issues.append(f"--mode {mode!r} is not max or min")
    if req.max_concurrent < 0:
        issues.append(f"--max-concurrent must be 0 (as the cluster holds) or more, got {req.max_concurrent}")
    base = req.base
    if base.backend != "ray":
        issues.append("a sweep's trials train on Ray workers: drop --backend local")
    if base.min_workers and base.min_workers < base.workers:
        issues.append("a sweep's trials have a fixed number of workers: --workers N, not MIN-MAX")
    if not base.data:
        issues.append("--data is required")
    from imgtrain.ops.remote import is_remote

    if is_remote(base.storage) or is_remote(base.data or ""):
        issues.append("a sweep keeps its trials on local or shared storage: --storage and --data must be folders "
                      "(train single runs with --storage s3://...)")
    try:  # the base settings (the searched values were checked against their ranges when parsed)
        validate(base, issues)
    except ImgtrainError as e:
        raise ImgtrainError(str(e).replace("invalid configuration", "invalid sweep")) from None
    base = dataclasses.replace(
        base, data=str(Path(base.data).expanduser().resolve()), storage=str(location.storage_root(base.storage)),
        min_workers=0)
    return dataclasses.replace(req, base=base, mode=mode)


def tune(req: SweepRequest, say=print) -> dict:
    """Run the sweep ``req`` (or resume it: the same request again); return ``state.summary``.
    ``say`` prints a line on the terminal (Ray's output goes to the sweep's logs/)."""
    from imgtrain.data.format import verify_dataset

    req = check(req)
    base = req.base
    tracking.require(base)  # a tracker that cannot be used: one line now, not one failed trial each
    # a missing or malformed data set: one line now, not one per trial (each trial checks its hashes)
    manifest = verify_dataset(base.data, check_hashes=False)
    sweep_dir = st.sweep_path(base.storage, base.name)
    stored = _claim(sweep_dir, req)
    for sub in (st.TRIALS_DIR, st.LOGS_DIR):
        (sweep_dir / sub).mkdir(parents=True, exist_ok=True)
    state = stored or {"name": base.name, "request": req.stored(), "created": time.time(), "trials": {}}
    st.write(sweep_dir, st.mark_driver(state, "running"))
    logs = sweep_dir / st.LOGS_DIR
    try:
        per_trial = _trial_cpus(base, manifest)
        with cluster_mod.ray_session(base.address, per_trial + cluster_mod.INGEST_CPUS, logs, "driver.log") as cluster:
            link_dir(logs / "ray", cluster.session_logs)
            concurrency = plan_concurrency(base, req.max_concurrent, per_trial)
            total = req.total_trials()
            say(f"sweep {base.name}: {total} trial(s), {min(concurrency, total)} at a time, scheduler "
                f"{req.scheduler}, metric {req.metric} ({req.mode}); {'resuming; ' if stored else ''}"
                f"folder {sweep_dir} (logs: {logs})")
            _fit(req, sweep_dir, concurrency, say)
    except BaseException as e:
        st.write(sweep_dir, st.mark_driver(st.read(sweep_dir), "interrupted" if isinstance(e, KeyboardInterrupt)
                                           else "failed", error=one_line(e)))
        raise
    _mark_stopped(sweep_dir, req)
    ended = [t for t in st.read(sweep_dir)["trials"].values() if t.get("status") in ("finished", "stopped", "failed")]
    unfinished = len(ended) < req.total_trials()
    st.write(sweep_dir, st.mark_driver(st.read(sweep_dir), "interrupted" if unfinished else "finished", error=None))
    if unfinished:
        raise KeyboardInterrupt  # Tune stopped on Ctrl-C and saved its state: the CLI says how to resume
    return st.summary(base.storage, base.name)


def _claim(sweep_dir: Path, req: SweepRequest) -> dict | None:
    """The stored state of the sweep being resumed (None for a new one), after refusing a
    folder that is not a sweep, a sweep running now, and a different request under the same name."""
    name = req.base.name
    if ownership.is_run(sweep_dir):
        raise ImgtrainError(f"{sweep_dir} is an imgtrain run, not a sweep: choose another --name for the sweep")
    stored = st.read(sweep_dir)
    if stored is not None and not stored["trials"] and not st.driver_alive(stored):
        # it stopped before Tune made any trial (a plan the cluster could not hold): nothing
        # to resume, and the name is free for another request
        shutil.rmtree(sweep_dir / st.TUNE_DIR, ignore_errors=True)
        return None
    if stored is None:
        if sweep_dir.exists() and (not sweep_dir.is_dir() or any(sweep_dir.iterdir())):
            raise ImgtrainError(f"{sweep_dir} already exists and is not an imgtrain sweep (no {st.STATE_FILE}); "
                                "choose another --name or --storage")
        return None
    if st.driver_alive(stored):
        raise ImgtrainError(f"sweep {name!r} is running right now (process {stored.get('pid')} on "
                            f"{stored.get('host')}); wait for it or stop it")
    want = req.stored()
    old = stored["request"]
    diffs = [f"{k}: {old.get(k)!r} -> {want[k]!r}" for k in want if k != "base" and old.get(k) != want[k]]
    diffs += [f"{k}: {old['base'].get(k)!r} -> {v!r}" for k, v in want["base"].items()
              if k != "name" and old["base"].get(k) != v]
    if diffs:
        raise ImgtrainError(f"sweep {name!r} already exists in {sweep_dir.parent} with other settings "
                            f"({'; '.join(diffs)}); re-run it as it was to resume, or choose another --name")
    return stored


def _trial_cpus(cfg: TrainConfig, manifest: dict) -> float:
    """The CPUs one trial holds while it trains: its workers (and their data pipelines, for a
    streamed data set) plus the trial's own small reservation."""
    from imgtrain.data import stream

    pipelines = 0 if stream.in_memory(cfg, manifest) else cfg.workers * max(1, cfg.preprocess_cpus)
    return cfg.workers * cfg.cpus_per_worker + pipelines + TRIAL_CPU


def plan_concurrency(cfg: TrainConfig, asked: int, per_trial: float) -> int:
    """How many trials train at once on the cluster Ray is connected to; fails in seconds when
    one trial alone does not fit."""
    import ray

    cluster_mod.check_resources(cfg)  # one trial's workers: the same message as `imgtrain train`
    total = ray.cluster_resources()
    return trials_at_once(cfg, total.get("CPU", 0.0), total.get("GPU", 0.0), per_trial, asked)


def trials_at_once(cfg: TrainConfig, cpus: float, gpus: float, per_trial: float, asked: int = 0) -> int:
    """As many trials as ``cpus`` (one kept free for Ray Data's tasks, shared by every trial)
    and ``gpus`` hold, at most ``asked`` (0: no limit)."""
    free = cpus - (cluster_mod.INGEST_CPUS if cfg.ingest == "ray-data" else 0)
    fits = math.floor(free / per_trial + 1e-9)
    if cfg.use_gpu:
        fits = min(fits, math.floor(gpus / cfg.workers))
    if fits < 1:
        need = f"{per_trial:g} CPUs" + (f" and {cfg.workers} GPU(s)" if cfg.use_gpu else "")
        raise ImgtrainError(f"one trial needs {need} (its {cfg.workers} worker(s), their data and the trial) plus "
                            f"{cluster_mod.INGEST_CPUS} CPU kept for data ingest, but the Ray cluster has {cpus:g} "
                            f"CPUs and {gpus:g} GPUs; use fewer --workers")
    return min(fits, asked) if asked else fits


def trial_name(trial) -> str:
    """'trial-00003': the trial's counter (stable across a restore: Tune saves trial ids)."""
    return "trial-" + trial.trial_id.rsplit("_", 1)[-1]


def _fit(req: SweepRequest, sweep_dir: Path, concurrency: int, say):
    """Tuner.fit() of a new or restored experiment (the Reporter keeps sweep.json)."""
    import ray
    from ray import tune
    from ray.tune.schedulers import FIFOScheduler

    from imgtrain.sweep.reporter import Reporter, set_output

    base = req.base
    threads = base.threads_per_worker
    if not threads and len([n for n in ray.nodes() if n.get("Alive")]) == 1:
        # one machine: its cores shared by every trial's workers (the default would give each
        # trial's workers every core, and OpenMP spins against the other trials')
        threads = max(1, (os.cpu_count() or 1) // (concurrency * base.workers))
    sweep = {"base": {**base.to_dict(), "threads_per_worker": threads},
             "trials_dir": str(sweep_dir / st.TRIALS_DIR), "logs_dir": str(sweep_dir / st.LOGS_DIR),
             # a fault injected into this command (tests) reaches its trials as `imgtrain train`'s
             # reaches its workers: the processes of a joined cluster have the cluster's environment
             "fault": os.environ.get(faults.ENV_VAR)}
    trainable = tune.with_resources(tune.with_parameters(run_trial, sweep=sweep), {"cpu": TRIAL_CPU})
    set_output(say)
    Trials.cap = concurrency
    Asha.trials_dir = sweep_dir / st.TRIALS_DIR
    experiment = sweep_dir / st.TUNE_DIR
    if tune.Tuner.can_restore(str(experiment)):
        tuner = tune.Tuner.restore(str(experiment), trainable=trainable, resume_unfinished=True, resume_errored=True)
    else:
        scheduler = Asha(base.epochs) if req.scheduler == "asha" \
            else FIFOScheduler()
        tuner = tune.Tuner(
            trainable,
            param_space={name: d.domain() for name, d in req.search.items()},
            tune_config=tune.TuneConfig(
                metric=req.metric, mode=req.mode, num_samples=req.trials, scheduler=scheduler,
                # the same trials for the same seed; Tune ignores max_concurrent_trials beside a
                # search_alg given (it only warns, in the logs): the generator holds the limit
                search_alg=Trials(random_state=base.seed, max_concurrent=concurrency),
                reuse_actors=False,  # a fresh process per trial run
                trial_name_creator=trial_name, trial_dirname_creator=trial_name,
            ),
            run_config=tune.RunConfig(
                name=st.TUNE_DIR, storage_path=str(sweep_dir), verbose=0,
                callbacks=[Reporter(str(sweep_dir), base.epochs, req.metric)],
            ),
        )
    tuner.fit()


class Asha(AsyncHyperBandScheduler):
    """ASHA, except at the last epoch: ASHA stops a trial that reaches max_t (and may put a rung
    there: max_t 4, reduction 4), and Tune then ends the trial's process before its run writes
    that it finished (status.json would stay "running"). The run ends by itself there.

    And with its rungs whole after a resume: Tune saves the searcher and the callbacks with the
    experiment, never the scheduler, and a restore rebuilds it as first built, rungs empty (a
    trial resumed after Ctrl-C was then trained to the end, its epoch-1 accuracy 0.07 against
    the finished trial's 0.95). Each trial Tune adds, the restored ones too, is given the epochs
    its run has recorded, as if Tune had just reported them. (A rung its run passed as the sweep
    stopped, before Tune heard of it, is recorded, not judged: such a trial goes on.)"""

    trials_dir: Path | None = None  # set in this process before every fit (a class attribute: never pickled)

    def __init__(self, epochs: int):
        super().__init__(time_attr=EPOCHS_DONE, max_t=epochs, grace_period=1)
        self.epochs = epochs

    def on_trial_add(self, tune_controller, trial):
        super().on_trial_add(tune_controller, trial)
        run_dir = Asha.trials_dir / str(trial) if Asha.trials_dir else None
        if run_dir is None or not ownership.is_run(run_dir):
            return  # a new trial
        bracket = self._trial_info[trial.trial_id]
        for result in map(to_tune, runs.epoch_history(run_dir)):
            if self._metric in result:
                bracket.on_result(trial, result[EPOCHS_DONE], self._metric_op * result[self._metric])

    def on_trial_result(self, tune_controller, trial, result):
        action = super().on_trial_result(tune_controller, trial, result)
        return TrialScheduler.CONTINUE if result.get(EPOCHS_DONE, 0) >= self.epochs else action


class Trials(BasicVariantGenerator):
    """Tune's trial generator with the concurrency this cluster holds: a restore puts back every
    attribute the generator saved, its concurrency limit too, which may not fit this cluster."""

    cap = 0  # set in this process before every fit (a class attribute: never pickled)

    def set_state(self, state):
        super().set_state(state)
        if Trials.cap:
            self.max_concurrent = Trials.cap


def _mark_stopped(sweep_dir: Path, req: SweepRequest) -> None:
    """Trials the scheduler stopped early: their runs say so (the trial's process was ended
    mid-run, its status.json still says running, or failed when it noticed its workers go),
    and their metrics.jsonl holds every epoch their checkpoints hold."""
    state = st.read(sweep_dir)
    for name, entry in state["trials"].items():
        run_dir = sweep_dir / st.TRIALS_DIR / name
        if entry.get("status") == "stopped" and ownership.is_run(run_dir):
            _recover_history(run_dir)
            runs.write_status(run_dir, "stopped", reason=f"stopped early by {req.scheduler.upper()} after epoch "
                              f"{entry.get('epochs_done')} of {req.base.epochs}")


def _recover_history(run_dir: Path) -> None:
    """Tune hears of an epoch from Ray Train's controller as soon as its checkpoint is
    reported; rank 0 sends the epoch's record to the trial's driver only after that. A scheduler
    that stops the trial on that result can end the driver before the record arrives (seen
    in CI): the run's latest checkpoint carries the record, as for a killed driver."""
    latest = next(reversed(ckpt.verified(run_dir)[0]), None)  # the newest whose files are whole
    if latest:
        meta = ckpt.read_meta(latest)
        runs.MetricsLog(run_dir).reconcile(meta.get("step", 0), ckpt.history(meta), latest.name)


def request_from(config_file: Path | None, settings: dict, search: list[str], sweep: dict) -> SweepRequest:
    """A SweepRequest from a TOML file (top level: training settings as for ``train --config``;
    ``[search]``: NAME = "FUNC(ARGS)"; ``[sweep]``: trials, scheduler, metric, mode,
    max_concurrent) and the flags, which override the file (``--search`` replaces or adds one
    setting's dimension)."""
    from imgtrain.config import resolve
    from imgtrain.configfile import check_values, read_table
    from imgtrain.sweep import space

    file_settings, dims, file_sweep, problems = {}, {}, {}, []
    if config_file:
        raw = read_table(config_file)
        dims = space.from_table(raw.pop("search", {}), str(config_file))
        table = raw.pop("sweep", {})
        for key, value in (table.items() if isinstance(table, dict) else []):
            key = key.replace("-", "_")
            kind = SWEEP_KEYS.get(key)
            if kind is None:
                problems.append(f"unknown [sweep] key {key!r} (known: {', '.join(SWEEP_KEYS)})")
            elif not isinstance(value, kind) or isinstance(value, bool):
                problems.append(f"[sweep] {key} must be {'an integer' if kind is int else 'a string'}, got {value!r}")
            else:
                file_sweep[key] = value
        file_settings, more = check_values(raw)
        problems += more
    if problems:
        raise ImgtrainError(f"{config_file}: " + "; ".join(problems))
    dims.update(space.parse_all(search))
    base = resolve({**file_settings, **settings})
    given = {**file_sweep, **{k: v for k, v in sweep.items() if v is not None}}
    return SweepRequest(base=base, search=dims, **given)
