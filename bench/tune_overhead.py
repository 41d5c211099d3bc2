"""What a sweep adds per trial: one `imgtrain tune` trial against the same `imgtrain train` run.

Both commands start their own local Ray cluster and train the same settings (the sweep
"searches" one value, lr=choice(LR), one trial, FIFO); they alternate, which goes first
alternating too, so that the machine's drift hits both alike. Figures per pair:

  command       wall time of the whole command (Ray start, checks, training, shutdown)
  run           the run's own time: config.json written to status.json finished (the same code)
  trial         the trial as Tune saw it: started to finished (sweep.json)

    .venv/bin/python bench/tune_overhead.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SAMPLE_DATA, ensure_data, environment, fmt, summarize, write_result

from imgtrain.storage import runs


def timed(args: list[str]) -> float:
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "imgtrain.cli", *args], check=True, stdout=subprocess.DEVNULL)
    return time.monotonic() - started


def run_seconds(run_dir: Path) -> float:
    """config.json is written as the run starts (driver._execute), status.json as it finishes."""
    return runs.read_status(run_dir)["time"] - (run_dir / runs.CONFIG_FILE).stat().st_mtime


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=SAMPLE_DATA)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--limit-train-batches", type=int, default=20)
    p.add_argument("--lr", default="0.003")
    a = p.parse_args()
    ensure_data(a.data)
    common = ["--data", str(a.data), "--workers", str(a.workers), "--epochs", str(a.epochs),
              "--limit-train-batches", str(a.limit_train_batches)]
    figures = {k: [] for k in ("train_command", "train_run", "tune_command", "tune_trial", "tune_run")}
    with tempfile.TemporaryDirectory(prefix="tune-overhead-") as tmp:
        for i in range(a.repeats):
            order = ["train", "tune"] if i % 2 == 0 else ["tune", "train"]
            for kind in order:
                name = f"{kind}{i}"
                if kind == "train":
                    figures["train_command"].append(timed(["train", "--name", name, "--storage", tmp, "--lr", a.lr,
                                                           "--quiet", *common]))
                    figures["train_run"].append(run_seconds(Path(tmp) / name))
                else:
                    figures["tune_command"].append(timed(["tune", "--name", name, "--storage", tmp, "--search",
                                                          f"lr=choice({a.lr})", "--scheduler", "fifo", *common]))
                    state = json.loads((Path(tmp) / name / "sweep.json").read_text())
                    trial = next(iter(state["trials"].values()))
                    figures["tune_trial"].append(trial["ended"] - trial["started"])
                    figures["tune_run"].append(run_seconds(Path(tmp) / name / "trials" / "trial-00000"))
                print(kind, {k: round(v[-1], 1) for k, v in figures.items() if v}, flush=True)
    stats = {k: summarize(v) for k, v in figures.items()}
    path = write_result("tune_overhead", {"args": vars(a) | {"data": str(a.data)}, "environment": environment(),
                                          "figures": stats})
    for k, s in stats.items():
        print(f"{k:14s} {fmt(s, 1)} s")
    print(f"written {path}")


if __name__ == "__main__":
    main()
