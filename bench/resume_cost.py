"""What fault tolerance costs: step checkpoints on a 2-worker run, and a resume after a driver kill.

1. Overhead of ``--checkpoint-every-steps N``: one epoch of the demo recipe on 2 workers with
   and without step checkpoints, runs interleaved; training images/s (the step checkpoints are
   written inside the timed part of the epoch).
2. Resume cost: SIGKILL ``imgtrain train`` right after a step checkpoint, start the same command
   at once, and time from the kill to the first training step of the new run (read from the
   step records the workers send, on the same machine's clock).

Both run against a Ray cluster started here beforehand (``ray start --head``), as on a cluster
where Ray outlives the driver. Usage: ``python bench/resume_cost.py [--repeats 3] [--every 10]``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SAMPLE_DATA as DATA  # noqa: E402
from common import ensure_data, environment, fmt, ray_head, summarize, write_result

from imgtrain.storage.runs import read_metrics as records  # noqa: E402


def imgtrain(*args: str) -> list[str]:
    return [sys.executable, "-m", "imgtrain.cli", "train", "--data", str(DATA), "--workers", "2",
            "--address", "auto", "--quiet", "--log-every-steps", "1", *args]


def epoch_rate(storage: Path, name: str, every: int) -> float:
    subprocess.run(imgtrain("--name", name, "--storage", str(storage), "--epochs", "1",
                            "--checkpoint-every-steps", str(every)), check=True, capture_output=True)
    return next(r["images_per_s"] for r in records(storage / name) if r["kind"] == "epoch")


def resume_seconds(storage: Path, name: str, every: int) -> float:
    args = imgtrain("--name", name, "--storage", str(storage), "--epochs", "2", "--checkpoint-every-steps", str(every))
    first = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run_dir = storage / name
    deadline = time.time() + 300
    while not any(r["kind"] == "checkpoint" for r in records(run_dir)):
        if time.time() > deadline or first.poll() is not None:
            raise RuntimeError("no step checkpoint appeared")
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    killed = time.time()
    first.wait()
    second = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            starts = [i for i, r in enumerate(records(run_dir)) if r["kind"] == "start"]
            later = [r for r in records(run_dir)[starts[-1]:] if r["kind"] == "step"] if len(starts) > 1 else []
            if later:
                return later[0]["time"] - killed
            if time.time() > deadline or second.poll() is not None:
                raise RuntimeError("the resumed run took no step")
            time.sleep(0.05)
    finally:
        second.wait(timeout=300)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--every", type=int, default=10, help="step checkpoint interval to measure")
    opts = parser.parse_args()
    ensure_data(DATA)
    with ray_head(), tempfile.TemporaryDirectory(prefix="imgtrain-bench-") as tmp:
        storage = Path(tmp)
        rates = {0: [], opts.every: []}
        for k in range(opts.repeats):
            for every in rates:  # interleaved, so that drift hits both alike
                rates[every].append(epoch_rate(storage, f"rate-{every}-{k}", every))
        resumes = [resume_seconds(storage, f"resume-{k}", opts.every) for k in range(opts.repeats)]
    base, with_steps = summarize(rates[0]), summarize(rates[opts.every])
    payload = {
        "environment": environment(),
        "config": {"data": str(DATA), "workers": 2, "batch_size": 128, "steps_per_epoch": 31,
                   "checkpoint_every_steps": opts.every, "repeats": opts.repeats},
        "epoch_images_per_s": {"no_step_checkpoints": base, f"every_{opts.every}_steps": with_steps},
        "overhead_ratio": with_steps["median"] / base["median"],
        "resume_s_kill_to_first_step": summarize(resumes),
    }
    path = write_result("resume_cost", payload)
    print(f"1 epoch, 2 workers, images/s: no step checkpoints {fmt(base)}; every {opts.every} steps "
          f"{fmt(with_steps)}; ratio {payload['overhead_ratio']:.2f}")
    print(f"driver SIGKILL -> first step of the resumed run: {fmt(summarize(resumes), 1)} s")
    print(f"results: {path}")


if __name__ == "__main__":
    os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
    main()
