"""Shared benchmark plumbing: environment facts, statistics, result files, tables.

A benchmark states its hardware, n, median and spread, and stores its inputs with its results.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
SAMPLE_DATA = Path(__file__).resolve().parent.parent / "data" / "mnist-sample"
PORT = "6391"  # the benchmarks' own head node, away from Ray's default 6379


def ensure_data(data: Path) -> None:
    """Prepare the embedded sample at ``data`` unless it is there already."""
    if not (data / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "imgtrain.cli", "data", "prepare", "mnist-sample", str(data)], check=True)


@contextlib.contextmanager
def ray_head(cpus: int = 4):
    """A Ray cluster started here (``ray start --head``, 4 logical CPUs unless told) for ``--address
    auto``, as on a cluster where Ray outlives the driver; ready once a first task has run; stopped
    on exit. GPUs are detected. Only its own processes are stopped: ``ray stop`` would stop every
    Ray cluster on a shared machine."""
    ray = str(Path(sys.executable).parent / "ray")
    session = None
    try:
        subprocess.run([ray, "start", "--head", f"--port={PORT}", f"--num-cpus={cpus}", "--include-dashboard=false"],
                       check=True, capture_output=True)
        session = _session_of_port(PORT)  # its daemons name it: how its processes are found
        script = "import ray; ray.init(address='auto', log_to_driver=False); ray.get(ray.remote(lambda: 1).remote())"
        subprocess.run([sys.executable, "-c", script], check=True, capture_output=True)
        yield
    finally:
        if session:
            _stop_cluster(session)


def _session_of_port(port: str) -> str | None:
    """The session folder of the cluster whose GCS listens on ``port`` (from its command line)."""
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                args = Path(f"/proc/{entry.name}/cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            if f"--gcs_server_port={port}" in args:
                return next((a.split("=", 1)[1] for a in args if a.startswith("--session-dir=")), None)
    return None


def _stop_cluster(session: str) -> None:
    """Stop the processes of the cluster whose session folder is ``session`` (its daemons name it
    on their command lines; its workers are their children), and nothing else."""
    def family() -> set[int]:
        parents, found = {}, set()
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    stat = Path(f"/proc/{entry.name}/stat").read_text()
                    parents[int(entry.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
                    if session.encode() in Path(f"/proc/{entry.name}/cmdline").read_bytes():
                        found.add(int(entry.name))
                except (OSError, ValueError):
                    pass
        grew = True
        while grew:
            children = {pid for pid, parent in parents.items() if parent in found} - found
            found |= children
            grew = bool(children)
        return found - {os.getpid()}

    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 0.0)):
        pids = family()
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        deadline = time.time() + wait
        while time.time() < deadline and family():
            time.sleep(0.2)


def environment() -> dict:
    import ray
    import torch

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        sha = ""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu, "cores": os.cpu_count(), "gpu": gpu, "python": platform.python_version(),
            "torch": torch.__version__, "ray": ray.__version__, "git": sha,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def summarize(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values), "values": values}


def write_result(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path


def fmt(stat: dict, digits: int = 0) -> str:
    """'1234 (1200-1250)': median and min-max."""
    return f"{stat['median']:.{digits}f} ({stat['min']:.{digits}f}-{stat['max']:.{digits}f})"
