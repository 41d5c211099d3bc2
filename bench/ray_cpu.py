"""Where Ray's per-step cost goes: CPU seconds of every process, per second of training.

For each repeat, the local backend beside an idle Ray cluster (``local-ray-up``) and one Ray
Train worker (``ray-1``) run one after the other on the same cluster (``bench/common.py``
``ray_head``, as ``bench/train_throughput.py``). A sampler reads /proc twice a second: the CPU
time (user + system) of the training command and its children, and of every process of the
cluster (its GCS, raylet, agents, log monitor, and the raylet's workers: Ray Train's controller,
the training worker, imgtrain's Monitor actor, Ray Data's actors, idle prestarted workers). Row
``ray-1-own``: one worker on a Ray cluster the command starts itself (as ``make demo``), its
processes counted with the idle cluster's under the same names. Each
process's CPU seconds over the steady training windows (as ``train_throughput.cpu_per_step``)
are divided by the windows' wall seconds. CPU seconds change less than wall time when other
work shares the machine.

``--py-spy S``: one more ray-1 run, with py-spy recording the worker, the Train controller and
the driver for S seconds in its steady state (on-CPU samples, all threads); the top functions
of each, by the share of its samples, are printed and stored.

    .venv/bin/python bench/ray_cpu.py --model timm:test_resnet --batch-size 8 --threads-per-worker 1 \\
        --log-every-steps 10 --epochs 1 --limit-steps 400 --repeats 3 --py-spy 8
"""

from __future__ import annotations

import argparse
import bisect
import collections
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_throughput as tt  # noqa: E402
from common import PORT, SAMPLE_DATA, _session_of_port, ensure_data, environment, ray_head, summarize, write_result  # noqa: E402

from imgtrain.storage.runs import read_metrics  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
TRAINING = ("driver (imgtrain train)", "ray::RayTrainWorker")  # whose threads are sampled too
DAEMONS = (("gcs_server", "gcs_server"), ("/raylet", "raylet"), ("dashboard/agent.py", "dashboard agent"),
           ("runtime_env/agent/main.py", "runtime env agent"), ("log_monitor.py", "log monitor"),
           ("autoscaler/_private/monitor.py", "autoscaler monitor"), ("dashboard/dashboard.py", "dashboard"))


def label(pid: int, root: int) -> str:
    """A process's part, from its command line (a Ray worker's is its actor's name)."""
    if pid == root:
        return "driver (imgtrain train)"
    args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    line = " ".join(args)
    if line.startswith("ray::"):
        return "ray::" + line[5:].split()[0].split(".")[0]
    for marker, name in DAEMONS:
        if marker in line:
            return name
    if "default_worker.py" in line:
        return "ray worker (starting)"
    return Path(args[0]).name + (" " + Path(args[1]).name if len(args) > 1 and args[1] else "")


class CpuSampler:
    """Every ``period`` s: the cumulative CPU seconds of each process of the cluster (descendants
    of the processes naming ``session`` on their command line) and of ``root``'s tree."""

    def __init__(self, root: int, session: str, period: float = 0.5):
        self.root, self.session, self.period = root, session, period
        self.samples: dict[int, list[tuple[float, float]]] = collections.defaultdict(list)
        self.labels: dict[int, str] = {}
        # the training process's threads (Ray's C++ threads, torch's, Python's): tid -> samples
        self.threads: dict[tuple[int, int], list[tuple[float, float]]] = collections.defaultdict(list)
        self.thread_names: dict[tuple[int, int], str] = {}
        self.cluster_roots: set[int] = set()
        self.seen: set[int] = set()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            self._sample()
            self.stop.wait(self.period)

    def _sample(self):
        now, stats = time.time(), {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                fields = stat[stat.rindex(")") + 2:].split()
                stats[pid] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK)
                if pid not in self.seen:  # each process's command line read once
                    self.seen.add(pid)
                    if self.session in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                        self.cluster_roots.add(pid)
            except (OSError, ValueError, IndexError):
                continue
        mine = {self.root} | self.cluster_roots
        changed = True
        while changed:  # descendants
            grown = {pid for pid, (ppid, _) in stats.items() if ppid in mine}
            changed = not grown <= mine
            mine |= grown
        for pid in mine:
            if pid in stats:
                try:
                    self.labels[pid] = label(pid, self.root)  # a worker's title changes (IDLE -> an actor)
                except OSError:
                    continue
                self.samples[pid].append((now, stats[pid][1]))
                if self.labels[pid] in TRAINING:
                    self._sample_threads(pid, now)

    def _sample_threads(self, pid: int, now: float):
        for entry in os.scandir(f"/proc/{pid}/task"):
            try:
                stat = Path(f"/proc/{pid}/task/{entry.name}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            key = (pid, int(entry.name))
            name = stat[stat.index("(") + 1:stat.rindex(")")].rstrip("0123456789")
            # torch's threads inherit the process's name: the main thread (an actor's task loop in a
            # Ray worker, whose training runs in a thread of its own) is told apart by its id
            self.thread_names[key] = f"{name} (main thread)" if key[1] == pid else name
            self.threads[key].append((now, (int(fields[11]) + int(fields[12])) / TICK))

    def used_by_thread(self, windows: list[tuple[float, float]]) -> dict[str, float]:
        """The training process's CPU seconds over ``windows``, by thread name (numbers dropped)."""
        out: dict[str, float] = collections.defaultdict(float)
        for key, samples in self.threads.items():
            out[self.thread_names[key]] += sum(_at(samples, b) - _at(samples, a) for a, b in windows)
        return dict(out)

    def finish(self):
        self.stop.set()
        self.thread.join()

    def used(self, windows: list[tuple[float, float]]) -> dict[str, float]:
        """CPU seconds over ``windows``, summed by label."""
        out: dict[str, float] = collections.defaultdict(float)
        for pid, samples in self.samples.items():
            out[self.labels[pid]] += sum(_at(samples, b) - _at(samples, a) for a, b in windows)
        return dict(out)


def _at(samples: list, t: float) -> float:
    """CPU seconds at ``t``, interpolated; 0 before a process's first sample, its last after its end."""
    times = [s for s, _ in samples]
    if t <= times[0]:
        return samples[0][1] if t >= times[0] - 1.0 else 0.0  # started within a sample period: counted from then
    if t >= times[-1]:
        return samples[-1][1]
    i = bisect.bisect_left(times, t)
    (t0, c0), (t1, c1) = samples[i - 1], samples[i]
    return c0 + (c1 - c0) * (t - t0) / max(t1 - t0, 1e-9)


# each row's imgtrain train arguments
ROW_ARGS = {"local-ray-up": ["--backend", "local"], "ray-1": ["--workers", "1", "--address", "auto"],
            "ray-1-own": ["--workers", "1"]}


def windows_of(steps: list[dict]) -> list[tuple[float, float]]:
    by_epoch: dict[int, list[dict]] = {}
    for s in steps:
        by_epoch.setdefault(s["epoch"], []).append(s)
    return [(e[tt.WARMUP_STEPS]["time"], e[-1]["time"]) for e in by_epoch.values() if len(e) > tt.WARMUP_STEPS + 1]


def one_run(row: str, opts, tmp: Path, k: int, session: str, py_spy: float = 0.0) -> dict:
    name = f"{row}-{k}{'-spy' if py_spy else ''}"
    cmd = tt.imgtrain_cmd(opts, tmp, name, "--epochs", str(opts.epochs), "--seed", "0")
    cmd += ["--limit-train-batches", str(opts.limit_steps)] if opts.limit_steps else []
    base, _, tree = row.partition("@")
    cmd += ROW_ARGS[base]
    env = dict(os.environ, **({"PYTHONPATH": opts.before_src} if tree == "before" else {}))
    with open(tmp / f"{name}.log", "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, cwd=tmp, env=env)
        sampler = CpuSampler(proc.pid, session)
        profiles = _profile(proc, sampler, tmp / "runs" / name, py_spy, tmp) if py_spy else {}
        proc.wait()
    sampler.finish()
    if proc.returncode:
        raise RuntimeError(f"{name} exited {proc.returncode}: {(tmp / f'{name}.log').read_text()[-2000:]}")
    records = read_metrics(tmp / "runs" / name)
    steps = tt._steps(records)
    windows = windows_of(steps)
    seconds = sum(b - a for a, b in windows)
    if not seconds:
        raise SystemExit(f"{name}: no steady training window (each epoch needs more than {tt.WARMUP_STEPS + 1} "
                         "steps): raise --limit-steps")
    n_steps = sum(e - s for s, e in ((next(x["step"] for x in steps if x["time"] == a),
                                      next(x["step"] for x in steps if x["time"] == b)) for a, b in windows))
    return {"images_per_s": tt.steady_rate(steps), "train_s": seconds, "steps": n_steps,
            "cpu_per_train_s": {lab: cpu / seconds for lab, cpu in sampler.used(windows).items()},
            "threads_cpu_per_train_s": {name: cpu / seconds for name, cpu in sampler.used_by_thread(windows).items()},
            "profiles": profiles}


def _profile(proc, sampler: CpuSampler, run_dir: Path, seconds: float, tmp: Path) -> dict:
    """py-spy on the worker, the controller and the driver once the run trains steadily."""
    spy = str(Path(sys.executable).parent / "py-spy")
    while proc.poll() is None:  # steady: a few step records written
        if (run_dir / "metrics.jsonl").is_file() and \
                sum('"kind": "step"' in line for line in (run_dir / "metrics.jsonl").read_text().splitlines()) >= 3:
            break
        time.sleep(0.5)
    targets = {"ray::RayTrainWorker": None, "ray::TrainController": None, "driver (imgtrain train)": None}
    for pid, lab in list(sampler.labels.items()):
        if lab in targets:
            targets[lab] = pid
    spies = {}
    for lab, pid in targets.items():
        if pid:
            out = tmp / f"spy-{pid}.txt"
            spies[lab] = (out, subprocess.Popen([spy, "record", "--pid", str(pid), "--duration", str(int(seconds)),
                                                 "--rate", "200", "--format", "raw", "--nonblocking", "--threads",
                                                 "--output", str(out)], stdout=subprocess.DEVNULL,
                                                stderr=subprocess.DEVNULL))
    result = {}
    for lab, (out, spy_proc) in spies.items():
        spy_proc.wait()
        result[lab] = top_functions(out.read_text() if out.is_file() else "")
    return result


STEP_FRAME = "train_epoch (imgtrain/training/loop.py"  # on the stack: the training step (and its data)


def top_functions(raw: str, n: int = 15) -> dict:
    """From py-spy's collapsed stacks: each thread's share of the samples, the share inside the
    training loop (``STEP_FRAME``), and, outside it, the stacks' last three frames with the
    largest shares: what runs in this process besides the step."""
    total, inside, threads, outside = 0, 0, collections.Counter(), collections.Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        count = int(count)
        total += count
        frames = stack.split(";")
        thread = frames[0].split(": ", 1)[-1] if ": " in frames[0] else frames[0]
        threads[thread] += count
        if any(f.startswith(STEP_FRAME) for f in frames):
            inside += count
        else:
            outside[f"[{thread}] " + " < ".join(reversed(frames[-3:]))] += count
    share = (lambda c: c / total) if total else (lambda c: 0.0)
    return {"samples": total, "in_training_loop": share(inside),
            "threads": {t: share(c) for t, c in threads.most_common(8)},
            "outside_loop": {k: share(c) for k, c in outside.most_common(n)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--limit-steps", type=int, default=400)
    parser.add_argument("--data", type=Path, default=SAMPLE_DATA)
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch-size", type=int, default=0)
    parser.add_argument("--threads-per-worker", type=int, default=0)
    parser.add_argument("--log-every-steps", type=int, default=10)
    parser.add_argument("--rows", default="local-ray-up,ray-1")
    parser.add_argument("--py-spy", type=float, default=0.0, metavar="S", help="profile one more ray-1 run for S s")
    parser.add_argument("--before-src", default="", metavar="DIR",
                        help="rows ending in @before (local-ray-up@before, ray-1-own@before) run imgtrain from DIR "
                             "(an older src/); not ray-1: its workers are the running cluster's, with its sources")
    parser.add_argument("--tag", default="", help="a name for this source tree in the result file")
    opts = parser.parse_args()
    opts.gpu = False
    opts.data = opts.data.resolve()
    ensure_data(opts.data)
    rows = opts.rows.split(",")
    unknown = [r for r in rows if r.partition("@")[0] not in ROW_ARGS]
    if unknown:
        parser.error(f"unknown row(s) {', '.join(unknown)}: choose from {', '.join(ROW_ARGS)} "
                     "(with @before for a --before-src tree)")
    runs: dict[str, list[dict]] = {r: [] for r in rows}
    began = time.time()
    with tempfile.TemporaryDirectory(prefix="imgtrain-raycpu-") as tmp, ray_head():
        session = _session_of_port(PORT)
        for k in range(opts.repeats):
            for row in rows:
                time.sleep(2)  # the previous run winds down (settle() would wait its 30 s here: the machine is shared)
                runs[row].append(one_run(row, opts, Path(tmp), k, session))
                r = runs[row][-1]
                print(f"  {row} #{k + 1}: {r['images_per_s']:.0f} images/s, "
                      f"{sum(r['cpu_per_train_s'].values()):.3f} CPU s per training s", file=sys.stderr, flush=True)
        spy = one_run(rows[-1] if "ray-1" not in rows else "ray-1", opts, Path(tmp), 0, session, opts.py_spy) if opts.py_spy else None
    labels = sorted({lab for rs in runs.values() for r in rs for lab in r["cpu_per_train_s"]})
    table = {lab: {row: summarize([r["cpu_per_train_s"].get(lab, 0.0) for r in rs]) for row, rs in runs.items()}
             for lab in labels}
    ms_per_step = {lab: {row: summarize([1000 * r["cpu_per_train_s"].get(lab, 0.0) * r["train_s"] / r["steps"]
                                         for r in rs]) for row, rs in runs.items()} for lab in labels}
    totals = {row: summarize([sum(r["cpu_per_train_s"].values()) for r in rs]) for row, rs in runs.items()}
    per_step = {row: summarize([1000 * sum(r["cpu_per_train_s"].values()) * r["train_s"] / r["steps"] for r in rs])
                for row, rs in runs.items()}
    payload = {"environment": environment(), "tag": opts.tag,
               "config": {k: str(v) for k, v in vars(opts).items()}, "table": table, "ms_per_step": ms_per_step, "totals": totals,
               "cpu_ms_per_step_all_processes": per_step, "runs": runs, "py_spy": spy and spy["profiles"],
               "bench_seconds": time.time() - began}
    path = write_result("ray_cpu", payload)
    print(f"| process | {' | '.join(rows)} | CPU ms per step: {' | '.join(rows)} |  (CPU s per training s, "
          f"median (min-max), n = {opts.repeats})")
    print("|---|" + "---:|" * 2 * len(rows))
    for lab in sorted(labels, key=lambda x: -table[x][rows[-1]]["median"]):
        print(f"| {lab or '(no command line)'} | " + " | ".join(
            f"{table[lab][r]['median']:.4f} ({table[lab][r]['min']:.4f}-{table[lab][r]['max']:.4f})" for r in rows)
            + " | " + " | ".join(f"{ms_per_step[lab][r]['median']:.3f}" for r in rows) + " |")
    print("| all | " + " | ".join(f"{totals[r]['median']:.3f} ({totals[r]['min']:.3f}-{totals[r]['max']:.3f})"
                                 for r in rows) + " |")
    print("| CPU ms per step, all | " + " | ".join(f"{per_step[r]['median']:.2f}" for r in rows) + " |")
    print("| images/s | " + " | ".join(f"{summarize([x['images_per_s'] for x in runs[r]])['median']:.0f}"
                                      for r in rows) + " |")
    names = sorted({n for rs in runs.values() for r in rs for n in r["threads_cpu_per_train_s"]})
    print("\nThreads of the training process (driver locally, the worker on Ray), CPU ms per step:")
    for name in sorted(names, key=lambda x: -max(summarize([r["threads_cpu_per_train_s"].get(x, 0.0) * r["train_s"]
                                                            / r["steps"] for r in rs])["median"] for rs in runs.values())):
        vals = [summarize([1000 * r["threads_cpu_per_train_s"].get(name, 0.0) * r["train_s"] / r["steps"] for r in rs])
                for rs in runs.values()]
        if max(v["median"] for v in vals) >= 0.005:
            print(f"| {name} | " + " | ".join(f"{v['median']:.3f} ({v['min']:.3f}-{v['max']:.3f})" for v in vals) + " |")
    if spy:
        for who, prof in spy["profiles"].items():
            print(f"\npy-spy, {who}: {prof['samples']} on-CPU samples, {prof['in_training_loop']:.1%} in the "
                  "training loop; threads: " + ", ".join(f"{t} {s:.1%}" for t, s in prof["threads"].items()))
            for f, s in prof["outside_loop"].items():
                print(f"  {s:6.1%}  {f}")
    print(f"\n{time.time() - began:.0f} s; results: {path}")


if __name__ == "__main__":
    os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
    main()
