"""Start-up: seconds until the quick commands answer and until the first training step, for two
source trees run alternately (the machine drifts), n rounds; medians and min-max.

    python bench/startup.py --before /path/to/other/src [--also NAME=SRC ...] [--rounds 3]

Quick commands: ``--version``, ``--help``, ``train --help``, a refusal (``--data`` that does not
exist). Training: ``imgtrain train --data D --name x --workers 2`` (it starts its own Ray) and the
same with ``--ingest torch`` (no Ray Data) and with ``--backend local``, each stopped at its first step: the first step record's timestamp
(metrics.jsonl, ``--log-every-steps 1``) less the command's start. The display's phase lines
(``starting Ray: 8.0 s``, printed when stdout is not a terminal) say where the time went.
Run it alone: another Ray on the machine, or tests, change every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SAMPLE_DATA, ensure_data, environment, fmt, summarize, write_result  # noqa: E402

HERE = Path(__file__).resolve().parents[1] / "src"
PHASE = re.compile(r"^(?P<name>[a-z][^:]*): (?P<s>\d+\.\d) s$")
QUICK = {"version": ["--version"], "help": ["--help"], "train-help": ["train", "--help"],
         "refusal": ["train", "--name", "x", "--data", "/nonexistent/data"]}


def quick(src: Path, args: list[str]) -> float:
    with tempfile.TemporaryDirectory() as here:  # the refusal's ./runs, were it made
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "imgtrain.cli", *args], env=_env(src), cwd=here, capture_output=True,
                       timeout=300)
        return time.perf_counter() - start


def first_step(src: Path, data: Path, extra: list[str]) -> tuple[float, dict[str, float]]:
    """(seconds to the first step, {phase: seconds}) of one training command, stopped there."""
    with tempfile.TemporaryDirectory() as storage:
        metrics = Path(storage) / "x" / "metrics.jsonl"
        start = time.time()
        proc = subprocess.Popen([sys.executable, "-m", "imgtrain.cli", "train", "--data", str(data), "--name", "x",
                                 "--workers", "2", "--log-every-steps", "1", "--storage", storage, *extra],
                                env=_env(src), cwd=storage, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            while (found := _first_step_time(metrics)) is None:
                if proc.poll() is not None:
                    raise RuntimeError(f"the run ended before its first step: {proc.stdout.read()[-2000:]}")
                time.sleep(0.05)
        finally:
            os.killpg(proc.pid, signal.SIGINT)  # as Ctrl-C: Ray is shut down before the next run
            try:
                out, _ = proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, _ = proc.communicate()
        phases = {m["name"]: float(m["s"]) for line in out.splitlines() if (m := PHASE.match(line.strip()))}
        return found - start, phases


def _first_step_time(metrics: Path) -> float | None:
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:  # the line being written
            continue
        if record.get("kind") == "step":
            return record["time"]
    return None


def _env(src: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(src), "COLUMNS": "200"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="the other tree's src/ folder")
    parser.add_argument("--also", action="append", default=[], metavar="NAME=SRC", help="one more tree, run alike")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--data", type=Path, default=SAMPLE_DATA)
    parser.add_argument("--skip-training", action="store_true", help="the quick commands only")
    args = parser.parse_args()
    ensure_data(args.data)
    trees = {"before": args.before.resolve(), "after": HERE,
             **{name: Path(src).resolve() for name, src in (a.split("=", 1) for a in args.also)}}
    seconds: dict[str, dict[str, list[float]]] = {t: {} for t in trees}
    phases: dict[str, dict[str, dict[str, list[float]]]] = {t: {} for t in trees}
    for round_ in range(args.rounds):
        for row, command in QUICK.items():
            for tree, src in trees.items():
                seconds[tree].setdefault(row, []).append(quick(src, command))
        training = {"ray": [], "ray, --ingest torch": ["--ingest", "torch"], "local": ["--backend", "local"]}
        for row, extra in ({} if args.skip_training else training).items():
            for tree, src in trees.items():
                took, found = first_step(src, args.data, extra)
                seconds[tree].setdefault(f"first step, {row}", []).append(took)
                for name, s in found.items():
                    phases[tree].setdefault(row, {}).setdefault(name, []).append(s)
                print(f"round {round_ + 1} {tree} {row}: first step {took:.1f} s {found}", flush=True)
    results = {t: {row: summarize(v) for row, v in rows.items()} for t, rows in seconds.items()}
    phase_stats = {t: {row: {n: summarize(v) for n, v in p.items()} for row, p in rows.items()}
                   for t, rows in phases.items()}
    path = write_result("startup", {"environment": environment(), "trees": {t: str(s) for t, s in trees.items()},
                                    "rounds": args.rounds, "seconds": results, "phases": phase_stats})
    others = [t for t in trees if t != "before"]
    print("| command | before, s | " + " | ".join(f"{t}, s | {t} / before" for t in others) + " |")
    print("|---|---|" + "---|---|" * len(others))
    for row, b in results["before"].items():
        cells = [f"{fmt(results[t][row], 2)} | {results[t][row]['median'] / b['median']:.2f}" for t in others]
        print(f"| {row} | {fmt(b, 2)} | " + " | ".join(cells) + " |")
    print(f"results: {path}")


if __name__ == "__main__":
    main()
