"""Checkpoints to S3: how long one takes to upload, and what uploading costs the step rate.

A real S3 server (moto's, in this process, on 127.0.0.1) stands in for the bucket. Two figures:

  upload        one ResNet-18 checkpoint (model.pt, train_state.pt with AdamW's state, meta.json)
                copied to the bucket with pyarrow's copy_files, which Ray Train's upload uses;
                a copy to a local folder beside it, for scale
  step rate     the same short run (2 workers, a checkpoint every --every steps) with
                --storage a local folder and --storage s3://..., alternated: median images/s of
                the steps, from metrics.jsonl. The workers upload in the background (async)

moto runs on the same cores as training here, so the S3 rows carry the server's work too.

    .venv/bin/python bench/s3_checkpoints.py --repeats 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SAMPLE_DATA, ensure_data, environment, fmt, summarize, write_result

from imgtrain.storage import location, runs


def start_s3() -> tuple[object, dict]:
    import pyarrow.fs as pafs
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"IMGTRAIN_S3_ENDPOINT": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "bench",
           "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1"}
    os.environ.update(env)
    pafs.S3FileSystem(endpoint_override=f"{host}:{port}", scheme="http", region="us-east-1",
                      allow_bucket_creation=True).create_dir("bench")
    return server, env


def step_rate(run_dir: Path) -> float:
    rates = [r["images_per_s"] for r in runs.read_metrics(run_dir) if r.get("kind") == "step" and r.get("images_per_s")]
    return statistics.median(rates[1:] or rates)


def upload_seconds(checkpoint: Path, tmp: str) -> tuple[float, float]:
    import pyarrow.fs as pafs

    from imgtrain.ops import remote

    started = time.monotonic()
    pafs.copy_files(str(checkpoint), f"bench/upload/{time.monotonic_ns()}", source_filesystem=pafs.LocalFileSystem(),
                    destination_filesystem=remote.s3_filesystem())
    s3 = time.monotonic() - started
    target = f"{tmp}/copy-{time.monotonic_ns()}"
    os.makedirs(target)
    started = time.monotonic()
    pafs.copy_files(str(checkpoint), target, source_filesystem=pafs.LocalFileSystem(),
                    destination_filesystem=pafs.LocalFileSystem())
    return s3, time.monotonic() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=SAMPLE_DATA)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--every", type=int, default=8, help="steps between checkpoints")
    p.add_argument("--limit-train-batches", type=int, default=32)
    a = p.parse_args()
    ensure_data(a.data)
    server, _ = start_s3()
    figures = {k: [] for k in ("local_images_per_s", "s3_images_per_s", "upload_s3_s", "copy_local_s")}
    common = ["--data", str(a.data), "--workers", "2", "--epochs", "1", "--quiet", "--log-every-steps", "1",
              "--limit-train-batches", str(a.limit_train_batches), "--checkpoint-every-steps", str(a.every)]
    try:
        with tempfile.TemporaryDirectory(prefix="s3-bench-") as tmp:
            os.environ["IMGTRAIN_CACHE"] = f"{tmp}/cache"
            for i in range(a.repeats):
                for kind in (["local", "s3"] if i % 2 == 0 else ["s3", "local"]):
                    storage = tmp if kind == "local" else "s3://bench/runs"
                    name = f"{kind}{i}"
                    subprocess.run([sys.executable, "-m", "imgtrain.cli", "train", "--name", name, "--storage", storage,
                                    *common], check=True, stdout=subprocess.DEVNULL)
                    figures[f"{kind}_images_per_s"].append(step_rate(location.run_path(storage, name)))
                    print(kind, round(figures[f"{kind}_images_per_s"][-1]), "images/s", flush=True)
            checkpoint = runs.load_run(tmp, "local0").latest_checkpoint
            for _ in range(3):
                s3, local = upload_seconds(checkpoint, tmp)
                figures["upload_s3_s"].append(s3)
                figures["copy_local_s"].append(local)
            size = sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file())
    finally:
        server.stop()
    stats = {k: summarize(v) for k, v in figures.items()}
    path = write_result("s3_checkpoints", {"args": vars(a) | {"data": str(a.data)}, "environment": environment(),
                                           "checkpoint_bytes": size, "figures": stats, "raw": figures})
    print(f"checkpoint: {size / 2**20:.0f} MiB")
    for k, s in stats.items():
        print(f"{k:20s} {fmt(s, 2)}")
    print(f"written {path}")


if __name__ == "__main__":
    main()
