"""sweep.json, and what ``imgtrain tune show`` makes of it and of the trials' runs."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from imgtrain.errors import ImgtrainError
from imgtrain.ops.files import atomic_write_text
from imgtrain.storage import location, runs

STATE_FILE = "sweep.json"
TRIALS_DIR = "trials"
TUNE_DIR = "tune"  # Ray Tune's experiment folder
LOGS_DIR = "logs"


def sweep_path(storage: str, name: str) -> Path:
    return location.run_path(storage, name)


def read(sweep_dir: Path) -> dict | None:
    path = sweep_dir / STATE_FILE
    if not path.is_file():
        return None
    try:
        state = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ImgtrainError(f"{path} cannot be read ({e}); the sweep's trials are runs in {sweep_dir / TRIALS_DIR}")
    return state


def write(sweep_dir: Path, state: dict) -> None:
    atomic_write_text(sweep_dir / STATE_FILE, json.dumps(state, indent=2))


def update_trial(sweep_dir: Path, name: str, **fields) -> None:
    """Merge ``fields`` into the trial's entry (only the sweep's driver writes this file)."""
    state = read(sweep_dir)
    state["trials"].setdefault(name, {}).update(fields)
    state["updated"] = time.time()
    write(sweep_dir, state)


def mark_driver(state: dict, status: str, **extra) -> dict:
    state.update(status=status, pid=os.getpid(), host=socket.gethostname(), updated=time.time(), **extra)
    return state


def driver_alive(state: dict) -> bool:
    """A sweep driver on this host whose process still runs (a dead one was interrupted)."""
    if state.get("status") != "running":
        return False
    if state.get("host") != socket.gethostname():
        return True  # another machine's: cannot tell, assume it runs
    try:
        os.kill(int(state.get("pid", -1)), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError):
        return True
    return True


# ---------------------------------------------------------------- imgtrain tune show


def summary(storage: str, name: str) -> dict:
    """The sweep as ``tune show --json`` prints it: every trial with its searched values, status,
    epochs and best metric (read from the trial run's metrics.jsonl), and the best trial."""
    sweep_dir = sweep_path(storage, name)
    state = read(sweep_dir)
    if state is None:
        raise ImgtrainError(f"no sweep named {name!r} in {location.storage_root(storage)} (no {STATE_FILE} in {sweep_dir})")
    request, metric = state["request"], state["request"]["metric"]
    sign = 1 if request["mode"] == "max" else -1
    alive = driver_alive(state)
    status = state["status"] if alive or state["status"] != "running" else "interrupted"
    trials = []
    for trial_name, entry in sorted(state["trials"].items()):
        run_dir = sweep_dir / TRIALS_DIR / trial_name
        history = runs.epoch_history(run_dir) if run_dir.is_dir() else []
        scored = [r for r in history if isinstance(r.get(metric), (int, float))]
        best = max(scored, key=lambda r: sign * r[metric]) if scored else None
        trial_status = entry.get("status", "pending")
        if trial_status in ("pending", "running") and status != "running":
            trial_status = "interrupted"
        trials.append({
            "name": trial_name, "params": entry.get("params", {}), "status": trial_status,
            "epochs_done": len(history), "epochs": request["base"]["epochs"],
            "best_metric": best[metric] if best else None, "best_epoch": best["epoch"] + 1 if best else None,
            "checkpoint": _checkpoint(run_dir, best), "run_dir": str(run_dir), "error": entry.get("error"),
            # the trial's last start to its end, as Tune saw them (a resumed trial: its last part)
            "wall_s": round(entry["ended"] - entry["started"], 1) if entry.get("ended") and entry.get("started") else None,
        })
    ranked = [t for t in trials if t["best_metric"] is not None]
    best_trial = max(ranked, key=lambda t: sign * t["best_metric"]) if ranked else None
    best = None
    if best_trial:
        config = runs.read_config(Path(best_trial["run_dir"])) or {}
        best = {"name": best_trial["name"], "params": best_trial["params"], "best_metric": best_trial["best_metric"],
                "best_epoch": best_trial["best_epoch"], "checkpoint": best_trial["checkpoint"],
                "run_dir": best_trial["run_dir"],
                "config": {k: v for k, v in config.items() if k not in runs.VERSION_KEYS}}
    return {"name": name, "path": str(sweep_dir), "status": status, "metric": metric, "mode": request["mode"],
            "scheduler": request["scheduler"], "search": request["search"], "trials_storage": str(sweep_dir / TRIALS_DIR),
            "trials": trials, "best": best}


def _checkpoint(run_dir: Path, best_epoch: dict | None) -> str | None:
    """The checkpoint of the trial's best epoch while the run keeps it, else the run's best
    (ranked by the run's --select-metric: pass the sweep's --metric as --select-metric too, and
    the run keeps the checkpoint of the epoch the sweep ranks best)."""
    if best_epoch and best_epoch.get("checkpoint") and (run_dir / best_epoch["checkpoint"]).is_dir():
        return str(run_dir / best_epoch["checkpoint"])
    if not run_dir.is_dir():
        return None
    found = runs.load_run(str(run_dir.parent), run_dir.name).best_checkpoint if (run_dir / runs.CONFIG_FILE).is_file() else None
    return str(found) if found else None
