"""FSDP against DDP: peak memory of each training worker and images/s, for a larger model
(issue 20).

Each round trains the same short run once with ``--strategy ddp`` and once with ``--strategy
fsdp`` (alternating, so a busy machine slows both alike): ``--workers`` Ray workers on the
embedded MNIST sample (28x28), a local Ray cluster per run, ``--steps`` steps of ``--batch`` images, one epoch, then the
usual validation and checkpoint. Both use contiguous weights (``--no-channels-last``: FSDP2
shards contiguous parameters only), so the strategy is the only difference.

Memory: each worker process's anonymous resident memory (``RssAnon``, as
``tests/conftest.peak_rss_of``: torch's shared libraries are not what differs), sampled from
/proc every 20 ms; the peak over the training steps (up to rank 0's last step record) and over
the whole run (validation and the checkpoint included). images/s: the median of rank 0's
step records after the first ``--warmup`` steps.

    python bench/fsdp_memory.py [--model resnet50] [--workers 2] [--steps 12] [--batch 32] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SAMPLE_DATA, ensure_data, environment, write_result  # noqa: E402


def rss_anon(pid: int) -> int | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    # None for a process on its way out (no RssAnon line)
    return next((int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("RssAnon:")), None)


def train(storage: Path, name: str, strategy: str, args) -> dict:
    cmd = [sys.executable, "-m", "imgtrain.cli", "train", "--data", str(args.data), "--storage", str(storage),
           "--name", name, "--model", args.model, "--strategy", strategy, "--workers", str(args.workers),
           "--epochs", "1", "--limit-train-batches", str(args.steps), "--batch-size", str(args.batch),
           "--no-channels-last", "--log-every-steps", "1", "--quiet"]
    run_dir = storage / name
    samples: list[tuple[float, int, int]] = []  # (time, rank, RssAnon bytes)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while proc.poll() is None:
        workers_file = run_dir / "workers.json"
        try:
            workers = json.loads(workers_file.read_text())["workers"] if workers_file.is_file() else []
        except (OSError, ValueError):
            workers = []
        now = time.time()
        for w in workers:
            if (rss := rss_anon(w["pid"])) is not None:
                samples.append((now, w["rank"], rss))
        time.sleep(0.02)
    if proc.returncode:
        raise SystemExit(f"{strategy} run failed: {proc.stderr.strip().splitlines()[-1]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    training_ends = steps[-1]["time"]
    ranks = sorted({rank for _, rank, _ in samples})
    return {
        "peak_rss_training_mb": {r: max(m for t, k, m in samples if k == r and t <= training_ends) / 2**20 for r in ranks},
        "peak_rss_run_mb": {r: max(m for _, k, m in samples if k == r) / 2**20 for r in ranks},
        "images_per_s": statistics.median(s["images_per_s"] for s in steps[args.warmup:]),
        "samples": len(samples),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--data", type=Path, default=SAMPLE_DATA)
    args = parser.parse_args()
    ensure_data(args.data)
    result = {"environment": environment(), "inputs": {k: str(v) for k, v in vars(args).items()},
              "command": " ".join(sys.argv), "runs": {"ddp": [], "fsdp": []}}
    # Each run starts (and stops) its own local Ray cluster: `ray stop` of a shared head would
    # stop every Ray process on the machine, other people's included.
    with tempfile.TemporaryDirectory(prefix="imgtrain-fsdp-") as tmp:
        for i in range(args.rounds):
            for strategy in ("ddp", "fsdp"):
                found = train(Path(tmp), f"{strategy}-{i}", strategy, args)
                result["runs"][strategy].append(found)
                print(strategy, found, flush=True)
    print(f"results: {write_result('fsdp_memory', result)}")
    print("\n| strategy | peak RssAnon per worker, training steps (MB) | whole run, with validation and "
          "checkpoint (MB) | images/s |\n|---|---|---|---|")
    for strategy, found in result["runs"].items():
        training = [m for r in found for m in r["peak_rss_training_mb"].values()]
        whole = [m for r in found for m in r["peak_rss_run_mb"].values()]
        rates = [r["images_per_s"] for r in found]
        print(f"| {strategy} | {min(training):.0f}-{max(training):.0f} | {min(whole):.0f}-{max(whole):.0f} | "
              f"{statistics.median(rates):.1f} ({min(rates):.1f}-{max(rates):.1f}) |")


if __name__ == "__main__":
    main()
