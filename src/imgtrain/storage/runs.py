"""The run directory ``{storage}/{name}/``: config, metrics history, status, checkpoints.

Ray Train owns its checkpoint folders and snapshot files there; imgtrain adds
  config.json     the resolved TrainConfig, and the versions of imgtrain, torch and Ray that wrote it
  metrics.jsonl   one JSON object per line: "start", "step" and "epoch" records. Our own
                  history, complete even after Ray deletes old checkpoints
  status.json     running / finished / failed / interrupted, with pid, host and error
  logs/           driver.log and a link to the Ray session's logs
  heartbeat.json  a run in an object store only: the driver's host, pid and time, every 2 s
  .imgtrain-run   the marker that makes this directory a run (``ownership.py``), and .lock

Where the directory is, is ``location``'s; with ``--storage s3://...`` the same files live in the
object store, and these functions work on a local working copy of them, brought down first
(``mirror``).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from imgtrain.checkpoint_policy import POLICY, EarlyStop
from imgtrain.errors import ImgtrainError
from imgtrain.ops import process, remote
from imgtrain.ops.files import atomic_write_text
from imgtrain.storage import checkpoint as ckpt
from imgtrain.storage import lease, mirror, ownership
from imgtrain.storage.location import fetch, location, run_path, storage_root, store

CONFIG_FILE = ownership.CONFIG_FILE
METRICS_FILE = "metrics.jsonl"
STATUS_FILE = "status.json"
LOGS_DIR = "logs"


# ---------------------------------------------------------------- config and status

# Recorded beside the settings in config.json and in every checkpoint's meta.json: what wrote
# them. Never settings: a run made by another version (or before versions were recorded) resumes.
VERSION_KEYS = ("imgtrain_version", "torch_version", "ray_version")


def package_version(package: str) -> str | None:
    """The installed version of ``package``, or None when it is not installed."""
    import importlib.metadata

    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict:
    return {key: package_version(key.removesuffix("_version")) for key in VERSION_KEYS}


def write_config(run_dir: Path, config: dict) -> None:
    atomic_write_text(run_dir / CONFIG_FILE, json.dumps(config, indent=2, sort_keys=True))


def read_config(run_dir: Path) -> dict | None:
    """The stored config, None when there is none; an error naming the file when it is damaged."""
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        return None
    config = _read_json(path)
    if not isinstance(config, dict):
        raise ImgtrainError(f"{path} is damaged (not a JSON object); restore it, or pass --overwrite to start afresh")
    return config


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_status(run_dir: Path, status: str, **extra) -> None:
    record = {"status": status, "pid": os.getpid(), "host": socket.gethostname(), "time": time.time()}
    record.update(extra)
    atomic_write_text(run_dir / STATUS_FILE, json.dumps(record, indent=2))


def read_status(run_dir: Path) -> dict:
    path = run_dir / STATUS_FILE
    if not path.is_file():
        return {"status": "unknown"}
    status = _read_json(path)
    if not isinstance(status, dict):
        return {"status": "damaged", "error": f"{STATUS_FILE} is not valid JSON"}
    # A driver killed with SIGKILL (or its machine lost) leaves "running" behind; say what really happened.
    if status.get("status") == "running" and _driver_gone(run_dir, status):
        status["status"] = "interrupted"
    return status


def _driver_gone(run_dir: Path, status: dict) -> bool:
    """On this host the run's lock tells (a driver holds it from start to end; the kernel lets
    it go when the driver dies), and the recorded pid where the lock table cannot be read: a
    status.json naming a live process that is no driver (pid 1, a reused pid) holds nothing. The driver of a run in an object store writes a
    heartbeat there every few seconds (``mirror.mirrored``): one of that driver older than
    ``HEARTBEAT_STALE_S`` means it is gone, and so does one dated in the future (``lease``).
    Another host's driver without a heartbeat (a run on a shared folder) cannot be checked: it
    is believed."""
    if status.get("host") == socket.gethostname():
        return ownership.lock_held(run_dir) is False or not process.pid_alive(status.get("pid", -1))
    age = heartbeat_age(run_dir, status)
    return age is not None and not -lease.CLOCK_SKEW_S <= age <= lease.HEARTBEAT_STALE_S


def heartbeat_age(run_dir: Path, status: dict) -> float | None:
    """Seconds since the heartbeat of the driver ``status`` names; None without one."""
    beat = _read_json(run_dir / lease.HEARTBEAT_FILE)
    if not isinstance(beat, dict) or [beat.get("host"), beat.get("pid")] != [status.get("host"), status.get("pid")] \
            or not isinstance(beat.get("time"), (int, float)):
        return None
    return time.time() - beat["time"]


def refuse_if_trained(run_dir: Path, hint: str, this_host: bool = True, other_hosts: bool = True) -> None:
    """Raise when status.json says a live driver trains the run. On this host a dead pid reads
    as "interrupted", elsewhere a heartbeat that stopped; another host's record is otherwise
    believed unless ``other_hosts`` is False (``clean --force``). ``this_host`` False: the
    caller holds the run's lock, which settles it on this host."""
    status = read_status(run_dir)
    here = status.get("host") == socket.gethostname()
    if status.get("status") == "running" and (this_host if here else other_hosts):
        age = None if here else heartbeat_age(run_dir, status)
        beat = f" (its heartbeat {age:.0f} s ago)" if age is not None else ""
        raise ImgtrainError(f"run {run_dir.name!r} is being trained right now by process {status.get('pid')} "
                            f"on {status.get('host')}{beat}; {hint}")


@contextlib.contextmanager
def written_in_store(storage: str, name: str, doing: str, hint: str):
    """For a command that writes into the run ``name`` of the object store ``storage`` (``doing``:
    "calibrated"): its working copy, brought up to date (weights too), with the run's lock held
    for the block, taken in the run's turn as a driver takes it (``mirror.turn``). Refused, in
    one line, while a process on this machine holds the lock or a driver elsewhere trains the run."""
    st = store(storage)
    run_dir = run_path(storage, name)
    holder = lease.lease_holder(lease.read_beat(st, name))  # before its weights come down
    if holder:
        raise ImgtrainError(f"run {name!r} is being trained right now by {holder}; {hint}")
    with contextlib.ExitStack() as held:
        with mirror.turn(st, name):
            known = ownership.is_run(run_dir)
            if known:  # a run trained here right now: refused before its files are touched
                held.enter_context(ownership.locked(run_dir, doing))
            mirror.pull(st, name, owner=True)
            if not ownership.is_run(run_dir):
                found = ", ".join(mirror.run_names(st)) or "none"
                raise ImgtrainError(f"no run named {name!r} in {st.uri} (runs there: {found})")
            if not known:  # first brought to this machine just now
                held.enter_context(ownership.locked(run_dir, doing))
        refuse_if_trained(run_dir, hint, this_host=False)  # another host's driver, by its heartbeat
        yield run_dir


# ---------------------------------------------------------------- metrics history


class MetricsLog:
    """Append-only ``metrics.jsonl``, written by the driver as records arrive from rank 0.

    When a run restarts from a checkpoint at step S (retry or resume), records past S are
    dropped first, so every epoch appears exactly once in the history. An epoch record that
    never reached the file (the driver killed after the checkpoint was stored but before its
    record arrived) is recovered from the history the checkpoint carries, marked
    ``recovered_from``.
    """

    def __init__(self, run_dir: Path):
        self.path = run_dir / METRICS_FILE

    def append(self, record: dict) -> None:
        if record.get("kind") == "start":
            self.truncate_after(record["step"])
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()

    def truncate_after(self, step: int) -> list[dict]:
        """Drop the records past ``step`` (trained again after a restart); returns those kept."""
        kept = [r for r in read_metrics(self.path.parent)
                if r.get("kind") == "start" or is_number(r.get("step", 0)) and r.get("step", 0) <= step]
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        return kept

    def reconcile(self, step: int, history: list[dict], source: str | None) -> list[dict]:
        """Keep the records up to ``step`` and add each epoch of ``history`` (the epoch records a
        checkpoint carries) that is missing, marked ``recovered_from``; returns those added."""
        kept = self.truncate_after(step)
        have = {r.get("epoch") for r in kept if r.get("kind") == "epoch"}
        recovered = [dict(r, recovered_from=source) for r in history
                     if r.get("kind") == "epoch" and r.get("epoch") not in have and r.get("step", 0) <= step]
        if recovered:
            with open(self.path, "a") as f:
                f.write("".join(json.dumps(r) + "\n" for r in recovered))
        return recovered


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file ([] if it does not exist), skipping a last line cut
    short by a process that was killed while writing it."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def read_metrics(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / METRICS_FILE)


# The numbers an epoch record holds (``loop.end_epoch``). metrics.jsonl is input like any file of
# a run (a bucket's, a copied folder's): a record whose epoch is not a count, or with anything but
# a number under one of these keys, is skipped, as a line cut short is; readers of the history
# rely on the types (a record may lack a key: one an older imgtrain wrote).
EPOCH_NUMBERS = ("step", "train_loss", "train_accuracy", "val_loss", "val_accuracy", "val_f1_macro", "images_per_s",
                 "epoch_time_s", "lr", "data_wait_fraction", "val_map")  # val_map: a multi-label run's


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_epoch_record(r: dict) -> bool:
    return (r.get("kind") == "epoch" and isinstance(r.get("epoch"), int) and not isinstance(r["epoch"], bool)
            and r["epoch"] >= 0 and all(is_number(r[k]) for k in EPOCH_NUMBERS if k in r))


def epoch_history(run_dir: Path) -> list[dict]:
    """The per-epoch records, one per epoch (the last one written wins)."""
    by_epoch = {r["epoch"]: r for r in read_metrics(run_dir) if is_epoch_record(r)}
    return [by_epoch[e] for e in sorted(by_epoch)]


def average_record(run_dir: Path) -> dict | None:
    """The record of the run's average checkpoint (--average-last), the last one written whose
    checkpoint the run still has (a run continued for more epochs may have let an older one go)."""
    def kept(r: dict) -> bool:
        name = r.get("checkpoint")
        parsed = POLICY.parse(name) if isinstance(name, str) else None
        return bool(parsed and parsed.average and (run_dir / name).is_dir())

    found = [r for r in read_metrics(run_dir) if r.get("kind") == "average"
             and all(is_number(r[k]) for k in EPOCH_NUMBERS if k in r) and kept(r)]
    return found[-1] if found else None


def early_stop(config: dict, history: list[dict]) -> EarlyStop | None:
    """Whether a run with this config (config.json or a checkpoint's) and epoch history stopped
    early (--early-stop): the rule the training loop applies before each epoch, on the same
    records. None when it trains (or trained) every epoch."""
    patience, delta, epochs = (config.get(k) for k in ("early_stop", "early_stop_min_delta", "epochs"))
    if not (is_number(patience) and is_number(delta) and is_number(epochs)) or not history:
        return None
    if history[-1].get("epoch", -1) + 1 >= epochs:  # every epoch trained: nothing was stopped
        return None
    return POLICY.for_config(config).stopped_early(history, int(patience), float(delta))


# ---------------------------------------------------------------- inspecting runs


@dataclass
class RunResult:
    """What ``imgtrain.train`` returns, and what ``runs show`` prints."""

    name: str
    path: Path
    status: str
    config: dict
    history: list[dict] = field(default_factory=list)
    best_checkpoint: Path | None = None
    latest_checkpoint: Path | None = None
    error: str | None = None
    location: str | None = None  # the object store's URI of a run that lives in one
    average: dict | None = None  # the record of the average checkpoint (--average-last)

    @property
    def stopped_early(self) -> EarlyStop | None:
        """Why the run stopped before its last epoch (--early-stop), or None."""
        return early_stop(self.config, self.history)

    @property
    def metrics(self):
        """Per-epoch metrics as a pandas DataFrame (one row per epoch)."""
        import pandas as pd

        return pd.DataFrame(self.history)

    @property
    def final_accuracy(self) -> float | None:
        return self.history[-1].get("val_accuracy") if self.history else None

    @property
    def best_record(self) -> dict | None:
        """The record (an epoch's, or the average's) of the best checkpoint: its epoch, its
        validation figures and the split they are on; None without one (no checkpoint, or only
        one saved within an epoch, before any validation)."""
        name = self.best_checkpoint.name if self.best_checkpoint else None
        found = [r for r in (*self.history, *([self.average] if self.average else [])) if r.get("checkpoint") == name]
        return found[-1] if name and found else None

    @property
    def validation_split(self) -> str:
        """The split training validated on: val when the data set has one, else test."""
        return self.history[-1].get("val_split", "test") if self.history else "test"

    def to_json(self) -> dict:
        keep = ("epoch", "step", "train_loss", "train_accuracy", "val_loss", "val_accuracy", "val_f1_macro",
                "lr", "epoch_time_s", "images_per_s", "world_size", "checkpoint")
        keep += ("val_map",) * any("val_map" in r for r in self.history)  # multi-label runs only
        stop = self.stopped_early
        return {
            "name": self.name, "path": str(self.path), "location": self.location or str(self.path),
            "status": self.status,
            "epochs_completed": len(self.history), "epochs": self.config.get("epochs"),
            "metrics": [{k: r.get(k) for k in keep} for r in self.history],
            "best_checkpoint": str(self.best_checkpoint) if self.best_checkpoint else None,
            "latest_checkpoint": str(self.latest_checkpoint) if self.latest_checkpoint else None,
            "best_val_accuracy": max((r["val_accuracy"] for r in self.history if "val_accuracy" in r), default=None),
            "select_metric": POLICY.for_config(self.config).metric,
            "val_split": self.validation_split,  # the split the figures above (and the best checkpoint) are on
            "stopped_early": stop.to_json() if stop else None,
            "average": {k: self.average.get(k) for k in ("epochs", "val_loss", "val_accuracy", "val_f1_macro",
                                                         "checkpoint")} if self.average else None,
            "config": self.config, "error": self.error,
        }


def locate(run: str | Path, storage: str) -> Path:
    """A run's directory from its name in ``storage``, or from a path to the run directory
    itself (which wins when both could be meant)."""
    target = Path(str(run)).expanduser()
    if ownership.is_run(target):
        return target.resolve()
    return load_run(storage, str(run)).path  # "no run named ..." with the list of runs


def resolve_checkpoint(run_or_checkpoint, checkpoint: str = "best", storage: str = "./runs") -> Path:
    """A verified checkpoint directory from: a checkpoint directory, a run directory, or a run
    name in ``storage``; ``checkpoint`` picks best/latest/average in a run, or is itself a checkpoint
    path. A named checkpoint that fails its sha256 is an error naming the file; a damaged
    best/latest is skipped (with a warning) for the best/latest of those that verify."""
    if checkpoint not in ckpt.CHOICES:
        path = Path(checkpoint).expanduser()
        if not path.is_dir():
            raise ImgtrainError(f"checkpoint {path} does not exist; pass best, latest, average or a checkpoint "
                                "directory")
        ckpt.verify(path)
        return path.resolve()
    target = Path(str(run_or_checkpoint)).expanduser()
    if (target / ckpt.META_FILE).is_file():
        ckpt.verify(target)
        return target.resolve()
    run_dir = locate(run_or_checkpoint, storage)
    return ckpt.choose(run_dir, checkpoint, run_dir.name)


def load_run(storage: str, name: str) -> RunResult:
    run_dir = fetch(storage, name)
    if not ownership.is_run(run_dir):
        known = ", ".join(sorted(r.name for r in list_runs(storage))) or "none"
        where = store(storage).uri if remote.is_remote(storage) else storage_root(storage)
        raise ImgtrainError(f"no run named {name!r} in {where} (runs there: {known})")
    return read_run(run_dir, storage)


def read_run(run_dir: Path, storage: str | None = None) -> RunResult:
    """The run in ``run_dir`` (its working copy, for a run in an object store ``storage``)."""
    status = read_status(run_dir)
    try:
        config = read_config(run_dir) or {}
    except ImgtrainError as e:  # listed as damaged, never a crash of `runs list`
        status = {"status": "damaged", "error": str(e)}
        config = {}
    best, latest = ckpt.best_and_latest(run_dir)
    return RunResult(
        name=run_dir.name, path=run_dir, status=status.get("status", "unknown"), config=config,
        history=epoch_history(run_dir), best_checkpoint=best, latest_checkpoint=latest,
        error=status.get("error"), average=average_record(run_dir),
        location=location(storage, run_dir.name) if storage and remote.is_remote(storage) else None,
    )


def list_runs(storage: str) -> list[RunResult]:
    if remote.is_remote(storage):  # each run's small files and checkpoint metadata, not the weights
        st = store(storage)
        names = mirror.run_names(st)
        for name in names:
            mirror.pull(st, name, checkpoints=False)
        found = [read_run(st.local / n, storage) for n in names if ownership.is_run(st.local / n)]
        return sorted(found, key=lambda r: _mtime(r.path / CONFIG_FILE) or _mtime(r.path))
    root = storage_root(storage)
    if not root.is_dir():
        return []
    found = [read_run(d) for d in sorted(root.iterdir()) if ownership.is_run(d)]
    return sorted(found, key=lambda r: _mtime(r.path / CONFIG_FILE) or _mtime(r.path))


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None
