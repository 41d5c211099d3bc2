"""A/B: two builds of imgtrain (this checkout and another one) trained alternately on one cluster.

Measures whether a change costs training speed: `imgtrain train --workers 2` on the same data,
epochs and seed, the two builds interleaved run by run so that the machine's drift hits both
alike (which one goes first alternates). The other build is a checkout of another commit with its
own virtual environment (without one, its ``src`` runs on this Python), e.g.

    git clone -q . /tmp/old && git -C /tmp/old checkout -q f65bcf5 && make -C /tmp/old install
    .venv/bin/python bench/ab_versions.py --other /tmp/old --log-every-steps 1 10

Figures per run: steady images/s from the step records with ``--log-every-steps 1`` (as
``train_throughput.py``), else the mean of the epoch records' training images/s. ``--gpu``: one
worker on CUDA with bf16 and the data on the device, as ``train_throughput.py --gpu``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
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
from train_throughput import GPU_FLAGS, ROOT, _steps, settle, steady_rate  # noqa: E402

from imgtrain.storage.runs import epoch_history, read_metrics  # noqa: E402


def rate(run_dir: Path, every: int) -> float:
    records = read_metrics(run_dir)
    if every == 1:
        return steady_rate(_steps(records))
    epochs = [r["images_per_s"] for r in records if r["kind"] == "epoch"]
    return sum(epochs) / len(epochs)


def command(checkout: Path) -> tuple[list[str], dict]:
    """How to run the build in ``checkout``: its own virtual environment, else its source on this Python."""
    venv_python = checkout / ".venv" / "bin" / "python"
    if venv_python.exists():
        return [str(venv_python), "-m", "imgtrain.cli"], dict(os.environ)
    path = os.pathsep.join(filter(None, [str(checkout / "src"), os.environ.get("PYTHONPATH")]))
    return [sys.executable, "-m", "imgtrain.cli"], dict(os.environ, PYTHONPATH=path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--other", type=Path, required=True, help="checkout of the other build (with its .venv, if any)")
    parser.add_argument("--log-every-steps", type=int, nargs="+", default=[10])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--data", type=Path, default=SAMPLE_DATA)
    parser.add_argument("--other-data", type=Path, help="the other build's copy of the data set, prepared by it "
                        "(where the data format changed between them); default: --data")
    parser.add_argument("--gpu", action="store_true", help="1 worker on CUDA, bf16, data on the device")
    parser.add_argument("--own-ray", action="store_true", help="each run starts its own Ray, as `make demo` does "
                        "(needed when the other build has no virtual environment: a shared cluster's workers "
                        "would import this build)")
    opts = parser.parse_args()
    opts.data, other = opts.data.resolve(), opts.other.resolve()
    ensure_data(opts.data)
    data = {"this": opts.data, "other": (opts.other_data or opts.data).resolve()}
    if not (data["other"] / "manifest.json").is_file():
        imgtrain, env = command(other)
        subprocess.run([*imgtrain, "data", "prepare", "mnist-sample", str(data["other"])], cwd=other, env=env, check=True)
    builds = {"this": ROOT, "other": other}
    runs = {f"{b}@{every}": [] for every in opts.log_every_steps for b in builds}
    accuracy = {b: [] for b in builds}  # the last epoch's validation accuracy of each run
    began = time.time()
    cluster = contextlib.nullcontext() if opts.own_ray else ray_head()
    with tempfile.TemporaryDirectory(prefix="imgtrain-ab-") as tmp, cluster:
        for every in opts.log_every_steps:
            for k in range(opts.repeats):
                order = list(builds.items()) if k % 2 == 0 else list(builds.items())[::-1]  # ABBA: no order bias
                for build, checkout in order:
                    settle()
                    name = f"{build}-{every}-{k}"
                    imgtrain, env = command(checkout)
                    args = ["--data", str(data[build]), "--name", name, "--storage", f"{tmp}/runs",
                            "--epochs", str(opts.epochs), "--seed", "0",
                            *([] if opts.own_ray else ["--address", "auto"]),
                            "--log-every-steps", str(every), "--quiet",
                            *(["--workers", "1", *GPU_FLAGS] if opts.gpu else ["--workers", "2"])]
                    done = subprocess.run([*imgtrain, "train", *args], cwd=checkout, env=env, capture_output=True, text=True)
                    if done.returncode:
                        sys.exit(f"{name} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
                    runs[f"{build}@{every}"].append(rate(Path(tmp) / "runs" / name, every))
                    accuracy[build].append(epoch_history(Path(tmp) / "runs" / name)[-1]["val_accuracy"])
                    print(f"  {name}: {runs[f'{build}@{every}'][-1]:.0f} images/s, accuracy {accuracy[build][-1]:.2%}",
                          file=sys.stderr, flush=True)
    other_sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=other, capture_output=True, text=True).stdout
    results = {key: summarize(values) for key, values in runs.items()}
    results |= {f"accuracy:{build}": summarize(values) for build, values in accuracy.items()}
    path = write_result("ab_versions", {"environment": environment(), "other": {"path": str(other), "git": other_sha.strip()},
                                        "config": vars(opts) | {"data": str(opts.data), "other": str(other), "other_data": str(data["other"])},
                                        "results": results, "bench_seconds": time.time() - began})
    for every in opts.log_every_steps:
        this, that = runs[f"this@{every}"], runs[f"other@{every}"]
        pairs = ", ".join(f"{a / b:.2f}" for a, b in zip(this, that))
        print(f"--log-every-steps {every}: this {fmt(results[f'this@{every}'])}, other {fmt(results[f'other@{every}'])} "
              f"images/s; this/other per pair: {pairs}")
    print(f"final accuracy: this {fmt(results['accuracy:this'], 4)}, other {fmt(results['accuracy:other'], 4)}")
    print(f"n = {opts.repeats} per build, median (min-max); results: {path}")


if __name__ == "__main__":
    main()
