"""Training speed against raw PyTorch and the tutorial pipeline, on the same data and epochs.

Rows (each run ``--repeats`` times, interleaved, so that drift hits every row alike):
  raw          bench/raw_loop.py: the recipe as a plain loop, one process, every core (the ceiling)
  local        imgtrain train --backend local
  demo         imgtrain train --workers 2, starting its own Ray (what `make demo` runs)
  tutorial     bench/tutorial_pipeline.py: the tutorial as written, starting its own Ray
  raw-ray-up   the raw loop again, while the Ray cluster of the next rows sits idle: what Ray's own
               processes (raylet, GCS, agents, internal actors) take from 2 cores
  local-ray-up  the local backend again, while the Ray cluster of the next rows sits idle: with
               ray-1 (``--rows local-ray-up,ray-1``) the two alternate, so their ratio is what the
               Ray backend adds around the same loop
  ray-1        imgtrain train --workers 1, Ray Data ingest, Ray already running
  ray-1-private  imgtrain train --workers 1 as users run it: a private Ray cluster started (and
               ended) by the command; with local (``--rows local,ray-1-private``) the two alternate
  ray-1-torch  the same with --ingest torch
  ray-2        imgtrain train --workers 2, Ray already running
  ray-2-tracked  the same, logging to MLflow (sqlite) and TensorBoard: what tracking costs, with a
               record at every step (10 times the default rate)
  ingest       bench/ingest_only.py: Ray Data -> iter_torch_batches, no model
  to-accuracy  (with --time-to-accuracy A) the demo recipe on 1 worker until its test accuracy
               first reaches A: seconds from the command's start to the end of that epoch

``--gpu``: the raw loop and every imgtrain row run on CUDA with ``--precision bf16
--data-on-device`` (one GPU per worker); the tutorial row stays as written (CPU). On a machine
with one GPU choose the 1-worker rows: ``--gpu --rows raw,local,ray-1,to-accuracy
--time-to-accuracy 0.985``.

Figures per run: steady-state training images/s (from per-step timestamps, leaving out the
first steps of each epoch and everything between epochs), seconds from the command's start to
the end of its first training step, wall seconds, and peak RSS (VmHWM) of the main process and
of each Ray Train worker. Results: ``bench/results/train_throughput-*.json`` and a Markdown
table on stdout. ``--quick``: 1 epoch of 12 steps, one run per row (about 3 minutes here).

The per-step cost of the Ray backend shows only where a step is short: ``--model timm:test_resnet
--batch-size 8 --threads-per-worker 1 --log-every-steps 10 --rows local-ray-up,ray-1`` (a step of
about 10 ms here) adds the ratio ray-1 / local and the difference per step in microseconds, each
repeat's pair taken together (the rows alternate). ``--model``, ``--batch-size`` and the threads
apply to the imgtrain rows only (the raw loop and the tutorial are ResNet-18 at 128).
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    SAMPLE_DATA,
    ensure_data,
    environment,
    fmt,
    ray_head,
    summarize,
    write_result,
)

from imgtrain.storage.runs import read_jsonl, read_metrics  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
WARMUP_STEPS = 2  # steps at the start of each epoch left out of the steady state
BATCH = 128
ROWS = ("raw", "local", "demo", "tutorial", "raw-ray-up", "local-ray-up", "ray-1", "ray-1-private", "ray-1-torch", "ray-2", "ray-2-tracked", "ingest",
        "to-accuracy")
NEEDS_CLUSTER = ("raw-ray-up", "local-ray-up", "ray-1", "ray-1-torch", "ray-2", "ray-2-tracked", "ingest", "to-accuracy")
GPU_FLAGS = ["--gpu", "--precision", "bf16", "--data-on-device"]
WORKERS = {"to-accuracy": 1, "raw": 1, "raw-ray-up": 1, "local": 1, "local-ray-up": 1, "demo": 2, "tutorial": 2, "ray-1": 1, "ray-1-private": 1, "ray-1-torch": 1, "ray-2": 2,
           "ray-2-tracked": 2}


class PeakRss:
    """Samples /proc twice a second: the peak RSS (VmHWM, a high-water mark, so no peak between
    samples is missed) of the launched process and of every Ray Train worker process, and the
    CPU seconds each has used so far (``cpu``: pid -> (kind, [(time, seconds)]))."""

    def __init__(self, root_pid: int):
        self.root_pid, self.peaks, self.stop = root_pid, {}, threading.Event()
        self.cpu: dict[int, tuple[str, list]] = {}
        self.tick = os.sysconf("SC_CLK_TCK")
        self.kinds: dict[int, str | None] = {}  # pid -> "main", "worker" or None (not measured)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            for entry in os.scandir("/proc"):
                if entry.name.isdigit():
                    self._sample(int(entry.name))
            self.stop.wait(0.5)

    def _kind(self, pid: int) -> str | None:
        # A process is classified once (reading every command line twice a second would cost
        # the machine a few percent of its CPU, which the runs being measured would lose).
        if pid not in self.kinds:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            if pid == self.root_pid:
                self.kinds[pid] = "main"
            elif cmdline.startswith("ray::RayTrainWorker"):
                self.kinds[pid] = "worker"
            elif cmdline.startswith("ray::") or "_worker.py" in cmdline:  # may become a train worker
                return None
            else:
                self.kinds[pid] = None
        return self.kinds[pid]

    def _sample(self, pid: int):
        try:
            kind = self._kind(pid)
            if kind is None:
                return
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    self.peaks[pid] = (kind, int(line.split()[1]) / 1024)
            stat = Path(f"/proc/{pid}/stat").read_text()
            utime, stime = stat[stat.rindex(")") + 2:].split()[11:13]
            self.cpu.setdefault(pid, (kind, []))[1].append((time.time(), (int(utime) + int(stime)) / self.tick))
        except (OSError, IndexError, ValueError):
            pass  # the process ended between listing and reading

    def finish(self) -> dict:
        self.stop.set()
        self.thread.join()
        out = {}
        for kind, mb in self.peaks.values():
            out[kind] = max(out.get(kind, 0.0), mb)
        return out


def run(cmd: list[str], log: Path, cwd: Path = ROOT) -> tuple[float, float, dict, str, dict]:
    """Run ``cmd`` to the end: (start time, wall seconds, peak RSS by kind, stdout, CPU samples
    by pid as ``PeakRss.cpu``)."""
    start = time.time()
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=cwd)
        rss = PeakRss(proc.pid)
        out, _ = proc.communicate()
    wall = time.time() - start
    peaks = rss.finish()
    if proc.returncode != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])  # the folder is temporary
        raise RuntimeError(f"{cmd[:4]}... exited {proc.returncode}; {log} ends:\n{tail}")
    return start, wall, peaks, out, rss.cpu


def steady_rate(steps: list[dict]) -> float:
    """Images/s over the intervals between consecutive steps of one epoch, after warm-up."""
    seconds = images = 0.0
    by_epoch: dict[int, list[dict]] = {}
    for s in steps:
        by_epoch.setdefault(s["epoch"], []).append(s)
    for epoch_steps in by_epoch.values():
        for prev, cur in list(zip(epoch_steps, epoch_steps[1:]))[WARMUP_STEPS:]:
            seconds += cur["time"] - prev["time"]
            images += cur["images"]
    return images / seconds if seconds else float("nan")


def cpu_per_step(steps: list[dict], cpu: dict, kind: str) -> float:
    """CPU milliseconds per step of the training process (the one ``kind`` process: "main"
    locally, "worker" for one Ray worker) over the steady steps of ``steady_rate``: less
    sensitive than images/s to what else the machine runs. Its CPU seconds at each end of the
    window are interpolated between the samples around it (they grow linearly while it trains)."""
    def at(samples: list, t: float) -> float:
        times = [time for time, _ in samples]
        i = min(max(bisect.bisect_left(times, t), 1), len(times) - 1)
        (t0, c0), (t1, c1) = samples[i - 1], samples[i]
        return c0 + (c1 - c0) * (t - t0) / max(t1 - t0, 1e-9)

    windows, n = [], 0
    by_epoch: dict[int, list[dict]] = {}
    for s in steps:
        by_epoch.setdefault(s["epoch"], []).append(s)
    for epoch_steps in by_epoch.values():
        steady = epoch_steps[WARMUP_STEPS:]
        if len(steady) > 1:
            windows.append((steady[0]["time"], steady[-1]["time"]))
            n += steady[-1]["step"] - steady[0]["step"]
    # the process of that kind that used the most CPU over the window: on a shared machine
    # another run's Ray Train workers may be sampled too
    used = [sum(at(samples, b) - at(samples, a) for a, b in windows)
            for k, samples in cpu.values() if k == kind and len(samples) > 1]
    return 1000 * max(used) / n if used and n else float("nan")


def figures(start: float, wall: float, peaks: dict, steps: list[dict]) -> dict:
    return {"images_per_s": steady_rate(steps), "first_step_s": steps[0]["time"] - start, "wall_s": wall,
            "peak_rss_mb": peaks, "steps": len(steps)}


def imgtrain_cmd(opts, tmp: Path, name: str, *args: str) -> list[str]:
    """``imgtrain train`` with a step record every ``--log-every-steps`` steps (the timestamps),
    into ``tmp/runs``."""
    return [sys.executable, "-m", "imgtrain.cli", "train", "--data", str(opts.data), "--name", name,
            "--storage", str(tmp / "runs"), "--log-every-steps", str(opts.log_every_steps),
            *(["--model", opts.model] if opts.model else []),
            *(["--batch-size", str(opts.batch_size)] if opts.batch_size else []),
            *(["--threads-per-worker", str(opts.threads_per_worker)] if opts.threads_per_worker else []), *(GPU_FLAGS if opts.gpu else []), *args]


def imgtrain_row(row: str, opts, tmp: Path, k: int) -> dict:
    name = f"{row}-{k}"
    cmd = imgtrain_cmd(opts, tmp, name, "--epochs", str(opts.epochs), "--seed", "0")
    if opts.limit_steps:
        cmd += ["--limit-train-batches", str(opts.limit_steps)]
    cmd += {"local": ["--backend", "local"], "local-ray-up": ["--backend", "local"], "demo": ["--workers", "2"],
            "ray-1": ["--workers", "1", "--address", "auto"],
            "ray-1-private": ["--workers", "1"],
            "ray-1-torch": ["--workers", "1", "--address", "auto", "--ingest", "torch"],
            "ray-2": ["--workers", "2", "--address", "auto"],
            "ray-2-tracked": ["--workers", "2", "--address", "auto", "--tensorboard",
                              "--mlflow", f"sqlite:///{tmp / 'mlflow.db'}"]}[row]
    # cwd: MLflow puts a sqlite store's artifacts in ./mlruns
    start, wall, peaks, _, cpu = run(cmd, tmp / f"{name}.log", cwd=tmp)
    records = read_metrics(tmp / "runs" / name)
    steps = _steps(records)
    return dict(figures(start, wall, peaks, steps), batch=_batch(records),
                cpu_ms_per_step=cpu_per_step(steps, cpu, "worker" if row.startswith("ray") else "main"))


def _steps(records: list[dict]) -> list[dict]:
    """The step records, each with the images trained since the one before (a record every N steps)."""
    batch = _batch(records)
    steps = [r for r in records if r["kind"] == "step"]
    return [dict(r, images=batch * (r["step"] - prev["step"] if prev else 1)) for prev, r in zip([None, *steps], steps)]


def _batch(records: list[dict]) -> int:
    return sum(next(r for r in records if r["kind"] == "start")["local_batch_sizes"])


def accuracy_row(opts, tmp: Path, k: int) -> dict:
    """The demo recipe (all its epochs) on 1 worker: when does test accuracy first reach the target?"""
    name = f"to-accuracy-{k}"
    cmd = imgtrain_cmd(opts, tmp, name, "--workers", "1", "--address", "auto", "--seed", "2")
    start, wall, peaks, _, _ = run(cmd, tmp / f"{name}.log")
    records = read_metrics(tmp / "runs" / name)
    reached = [r for r in records if r["kind"] == "epoch" and r["val_accuracy"] >= opts.time_to_accuracy]
    result = figures(start, wall, peaks, _steps(records))
    result["to_accuracy_s"] = reached[0]["time"] - start if reached else float("nan")
    result["best_accuracy"] = max(r["val_accuracy"] for r in records if r["kind"] == "epoch")
    return result


def raw_row(opts, tmp: Path, k: int) -> dict:
    cmd = [sys.executable, str(BENCH / "raw_loop.py"), "--data", str(opts.data), "--epochs", str(opts.epochs),
           "--limit-steps", str(opts.limit_steps), *(["--device", "cuda", "--precision", "bf16"] if opts.gpu else [])]
    start, wall, peaks, out, _ = run(cmd, tmp / f"raw-{k}-{time.time():.0f}.log")
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return figures(start, wall, peaks, [x for x in lines if "step" in x])


def tutorial_row(opts, tmp: Path, k: int) -> dict:
    out_dir = tmp / f"tutorial-{k}"
    out_dir.mkdir()
    cmd = [sys.executable, str(BENCH / "tutorial_pipeline.py"), "--data", str(opts.data), "--epochs", str(opts.epochs),
           "--out", str(out_dir), "--rows", str(opts.limit_steps * BATCH if opts.limit_steps else 0)]
    start, wall, peaks, out, _ = run(cmd, tmp / f"tutorial-{k}.log")
    info = json.loads(out.strip().splitlines()[-1])
    result = figures(start, wall, peaks, read_jsonl(Path(info["step_times"])))
    result["fit_s"] = info["fit_end"] - info["fit_start"]
    return result


def ingest_row(opts, tmp: Path, k: int) -> dict:
    cmd = [sys.executable, str(BENCH / "ingest_only.py"), "--data", str(opts.data), "--address", "auto",
           "--passes", "3" if opts.quick else "10"]
    start, wall, peaks, out, _ = run(cmd, tmp / f"ingest-{k}.log")
    lines = {x["source"]: x for x in map(json.loads, out.strip().splitlines())}
    return {"images_per_s": lines["blocks"]["images_per_s"], "parquet_images_per_s": lines["parquet"]["images_per_s"],
            "first_batch_s": lines["blocks"]["first_batch_s"], "wall_s": wall, "peak_rss_mb": peaks}


def measure(row: str, opts, tmp: Path, k: int) -> dict:
    if row in ("raw", "raw-ray-up"):
        return raw_row(opts, tmp, k)
    if row == "tutorial":
        return tutorial_row(opts, tmp, k)
    if row == "ingest":
        return ingest_row(opts, tmp, k)
    if row == "to-accuracy":
        return accuracy_row(opts, tmp, k)
    return imgtrain_row(row, opts, tmp, k)


def settle() -> None:
    """Wait (30 s at most) until the machine is nearly idle: on 2 cores, the workers and Ray
    actors a previous run leaves winding down took up to a third of the CPU from the next row."""
    deadline = time.time() + 30
    while time.time() < deadline and cpu_busy(1.0) > 0.15:
        pass


def cpu_busy(seconds: float) -> float:
    """Share of the machine's CPU time spent busy over the next ``seconds`` (from /proc/stat)."""
    def sample():
        values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(values), values[3] + values[4]  # total, idle + iowait

    total0, idle0 = sample()
    time.sleep(seconds)
    total1, idle1 = sample()
    return 1 - (idle1 - idle0) / max(total1 - total0, 1)


def summary(runs: list[dict]) -> dict:
    keys = ["images_per_s", "first_step_s", "wall_s", "fit_s", "parquet_images_per_s", "first_batch_s",
            "to_accuracy_s", "best_accuracy"]
    out = {key: summarize([r[key] for r in runs]) for key in keys if key in runs[0]}
    kinds = {kind for r in runs for kind in r["peak_rss_mb"]}
    out["peak_rss_mb"] = {kind: summarize([r["peak_rss_mb"].get(kind, 0.0) for r in runs]) for kind in sorted(kinds)}
    return out


def table(results: dict) -> str:
    raw = results["raw"]["images_per_s"]["median"] if "raw" in results else float("nan")
    lines = ["| row | workers | steady images/s, total | per worker | ratio to raw | first step, s | wall, s "
             "| peak RSS, MB: main / each worker |", "|---|---|---|---|---|---|---|---|"]
    for row in ROWS:
        if row not in results or row == "ingest":
            continue
        s, w = results[row], WORKERS[row]
        per = {k: v / w for k, v in s["images_per_s"].items() if k != "values" and k != "n"}
        rss = s["peak_rss_mb"]
        worker_rss = fmt(rss["worker"]) if "worker" in rss else "-"
        lines.append(f"| {row} | {w} | {fmt(s['images_per_s'])} | {fmt(per)} | {s['images_per_s']['median'] / raw:.2f} "
                     f"| {fmt(s['first_step_s'], 1)} | {fmt(s['wall_s'], 1)} | {fmt(rss['main'])} / {worker_rss} |")
    if "ingest" in results:
        s = results["ingest"]
        lines.append(f"| ingest only (in-memory blocks; Parquet: {fmt(s['parquet_images_per_s'])}) | - "
                     f"| {fmt(s['images_per_s'])} | - | {s['images_per_s']['median'] / raw:.1f} | "
                     f"{fmt(s['first_batch_s'], 1)} (first batch) | {fmt(s['wall_s'], 1)} | {fmt(s['peak_rss_mb']['main'])} / - |")
    return "\n".join(lines)


def ray_cost(local: list[dict], ray: list[dict]) -> dict:
    """Ray one-worker against the local backend, repeat by repeat (run k of each row came one
    after the other): the ratio of images/s and what Ray adds to each step, in microseconds."""
    pairs = list(zip(local, ray))
    return {"ratio": summarize([r["images_per_s"] / lo["images_per_s"] for lo, r in pairs]),
            "cpu_ratio": summarize([lo["cpu_ms_per_step"] / r["cpu_ms_per_step"] for lo, r in pairs]),
            "cpu_ms_per_step": {row: summarize([r["cpu_ms_per_step"] for r in runs]) for row, runs in
                                (("local", local), ("ray", ray))},
            "step_us": summarize([r["batch"] * 1e6 * (1 / r["images_per_s"] - 1 / lo["images_per_s"]) for lo, r in pairs])}


def targets(results: dict, runs: dict | None = None) -> list[tuple[str, bool, str]]:
    """The issue's targets, each as (what, met, the measured figure)."""
    med = {row: s["images_per_s"]["median"] for row, s in results.items()}
    checks = []
    if {"raw", "ray-1"} <= med.keys():
        r = med["ray-1"] / med["raw"]
        checks.append(("1 worker >= 90% of raw", r >= 0.9, f"{r:.2f}"))
    if runs and {"local-ray-up", "ray-1"} <= med.keys():
        r = ray_cost(runs["local-ray-up"], runs["ray-1"])["ratio"]["median"]
        checks.append(("1 worker on Ray >= 97% of the local backend (interleaved)", r >= 0.97, f"{r:.3f}"))
    if {"raw-ray-up", "ray-1"} <= med.keys():
        r = med["ray-1"] / med["raw-ray-up"]
        checks.append(("(diagnostic) 1 worker / raw with the Ray cluster idle", r >= 0.9, f"{r:.2f}"))
    if {"raw", "ray-2"} <= med.keys():
        r = med["ray-2"] / med["raw"]
        checks.append(("2 workers >= 70% of raw", r >= 0.7, f"{r:.2f}"))
    if {"ray-2", "ray-2-tracked"} <= med.keys():
        r = med["ray-2-tracked"] / med["ray-2"]
        checks.append(("MLflow + TensorBoard cost <= 5% of 2-worker speed", r >= 0.95, f"{r:.2f}"))
    if {"ingest", "ray-1"} <= med.keys():
        r = med["ingest"] / med["ray-1"]
        checks.append(("ingest >= 10x one worker's consumption", r >= 10, f"{r:.1f}x"))
    if {"demo", "tutorial"} <= results.keys():
        r = results["tutorial"]["wall_s"]["median"] / results["demo"]["wall_s"]["median"]
        checks.append(("demo recipe >= 4x faster than the tutorial, end to end", r >= 4, f"{r:.2f}x"))
    for row, limit in (("ray-1", 10), ("ray-2", 10), ("demo", 20)):
        if row in results:
            t = results[row]["first_step_s"]["median"]
            checks.append((f"{row}: first step <= {limit} s", t <= limit, f"{t:.1f} s"))
    worker_peaks = [s["peak_rss_mb"]["worker"]["max"] for s in results.values() if "worker" in s["peak_rss_mb"]]
    if worker_peaks:
        checks.append(("peak RSS per training worker <= 1.5 GB", max(worker_peaks) <= 1536, f"{max(worker_peaks):.0f} MB"))
    return checks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 epoch of 12 steps, one run per row")
    parser.add_argument("--repeats", type=int, default=None, help="runs per row (default 3; 1 with --quick)")
    parser.add_argument("--epochs", type=int, default=None, help="default 2 (1 with --quick)")
    parser.add_argument("--limit-steps", type=int, default=None, help="steps per epoch; 0 = all (12 with --quick)")
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated subset of: " + ", ".join(ROWS))
    parser.add_argument("--data", type=Path, default=SAMPLE_DATA)
    parser.add_argument("--model", default=None, help="the imgtrain rows' model (default: imgtrain's, resnet18)")
    parser.add_argument("--batch-size", type=int, default=0, help="the imgtrain rows' global batch (0: imgtrain's choice)")
    parser.add_argument("--threads-per-worker", type=int, default=0, help="the imgtrain rows' torch threads (0: imgtrain's choice)")
    parser.add_argument("--log-every-steps", type=int, default=1,
                        help="the imgtrain rows' step records, the timestamps of the steady rate (default 1)")
    parser.add_argument("--gpu", action="store_true", help="CUDA, bf16 and data on the device for raw and imgtrain")
    parser.add_argument("--time-to-accuracy", type=float, default=0.0, metavar="A",
                        help="add the to-accuracy row: seconds until test accuracy first reaches A (e.g. 0.985)")
    opts = parser.parse_args()
    opts.data = opts.data.resolve()
    opts.repeats = opts.repeats or (1 if opts.quick else 3)
    opts.epochs = opts.epochs or (1 if opts.quick else 2)
    opts.limit_steps = opts.limit_steps if opts.limit_steps is not None else (12 if opts.quick else 0)
    rows = [r for r in opts.rows.split(",") if r and (r != "to-accuracy" or opts.time_to_accuracy)]
    unknown = set(rows) - set(ROWS)
    if unknown:
        parser.error(f"unknown rows: {', '.join(sorted(unknown))}")
    ensure_data(opts.data)

    began = time.time()
    runs: dict[str, list[dict]] = {r: [] for r in rows}
    def measure_all(phase: list[str], tmp: Path) -> None:
        for k in range(opts.repeats):
            for row in phase:
                settle()  # the previous run's processes (Ray's included) have wound down
                runs[row].append(measure(row, opts, tmp, k))
                print(f"  {row} #{k + 1}: {runs[row][-1]['images_per_s']:.0f} images/s", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="imgtrain-bench-") as tmp:
        # Rows that start their own Ray first, then the ones that join a running cluster.
        measure_all([r for r in rows if r not in NEEDS_CLUSTER], Path(tmp))
        clustered = [r for r in rows if r in NEEDS_CLUSTER]
        if clustered:
            with ray_head():
                measure_all(clustered, Path(tmp))
    results = {row: summary(r) for row, r in runs.items()}
    checks = targets(results, runs)
    if {"local-ray-up", "ray-1"} <= runs.keys():
        results["ray-1-vs-local"] = ray_cost(runs["local-ray-up"], runs["ray-1"])
    if {"local", "ray-1-private"} <= runs.keys():
        results["ray-1-private-vs-local"] = ray_cost(runs["local"], runs["ray-1-private"])
    payload = {
        "environment": environment(),
        "config": {"data": str(opts.data), "epochs": opts.epochs, "gpu": opts.gpu,
                   "time_to_accuracy": opts.time_to_accuracy, "limit_steps": opts.limit_steps,
                   "global_batch": opts.batch_size or "imgtrain's choice", "model": opts.model or "resnet18",
                   "threads_per_worker": opts.threads_per_worker, "log_every_steps": opts.log_every_steps, "repeats": opts.repeats, "quick": opts.quick, "warmup_steps": WARMUP_STEPS},
        "results": results, "runs": runs,
        "targets": [{"target": t, "met": met, "measured": m} for t, met, m in checks],
        "bench_seconds": time.time() - began,
    }
    path = write_result("train_throughput" + ("-quick" if opts.quick else ""), payload)
    print(table(results))
    print()
    for what, met, measured in checks:
        print(f"{'met   ' if met else 'MISSED'} {what}: {measured}")
    if "to-accuracy" in results:
        s = results["to-accuracy"]
        print(f"time to {opts.time_to_accuracy:.1%} test accuracy: {fmt(s['to_accuracy_s'], 1)} s "
              f"(best {fmt(s['best_accuracy'], 4)})")
    for key in ("ray-1-vs-local", "ray-1-private-vs-local"):
        if key not in results:
            continue
        s = results[key]
        print(f"{key}, pair by pair: {fmt(s['ratio'], 3)}; Ray adds {fmt(s['step_us'])} us per step")
        print(f"CPU ms per step of the training process: local {fmt(s['cpu_ms_per_step']['local'], 2)}, "
              f"ray-1's worker {fmt(s['cpu_ms_per_step']['ray'], 2)}; local / ray-1 pair by pair {fmt(s['cpu_ratio'], 3)}")
    print(f"\nn = {opts.repeats} per row, median (min-max); {time.time() - began:.0f} s; results: {path}")


if __name__ == "__main__":
    os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
    main()
