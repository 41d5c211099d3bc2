"""The engines (issue 38): PyTorch against ONNX Runtime, float32 and int8, on this CPU, in one run.

A model is trained first (the demo recipe on the embedded sample, ``--epochs``, one process) or
``--run`` given; it is exported as ONNX (float32) and as ONNX int8 (``--quantize int8``). Then:

* **predict**: images/s of the ``Predictor`` that ``imgtrain predict --backend local`` runs, over
  the test split's images in batches of ``--batch`` (the files' decoding left out: the same for
  every engine), ``--rounds`` rounds with the engines interleaved, the median reported;
* **serve**: requests/s of the real ``imgtrain serve`` (``--engine``), PNG digits from 1 and 64
  clients (``bench/serve_load.py``'s load generator), each engine's server started in turn for
  ``--serve-rounds`` rounds in alternating order.

    .venv/bin/python bench/engines.py [--run RUN --storage DIR] [--rounds 5] [--serve-rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SAMPLE_DATA, ensure_data, environment, write_result  # noqa: E402
from serve_load import free_port, load, stop_server, summarize_level, test_digits, wait_healthy  # noqa: E402

LEVELS = ((1, 200), (64, 1500))


def cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "imgtrain.cli", *args], check=True, stdout=subprocess.DEVNULL)


def predict_rate(predictor, images, batch: int) -> float:
    started = time.perf_counter()
    for i in range(0, len(images), batch):
        predictor.predict_proba(images[i:i + batch])
    return len(images) / (time.perf_counter() - started)


def serve_levels(target: str, engine: str, storage: str, pngs, labels, reference) -> dict:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "imgtrain.cli", "serve", target, "--storage", storage,
                             "--port", str(port), "--engine", engine], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_healthy(port, proc)
        load(port, pngs, 4, 40)  # warm-up
        return {c: summarize_level(*load(port, pngs, c, n), labels, reference) for c, n in LEVELS}
    finally:
        stop_server(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", help="a trained run (default: train one)")
    parser.add_argument("--storage", default=None)
    parser.add_argument("--data", type=Path, default=SAMPLE_DATA)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--serve-rounds", type=int, default=2)
    args = parser.parse_args()
    ensure_data(args.data)
    from imgtrain.inference.predictor import Predictor

    pngs, labels, images = test_digits(args.data)
    with tempfile.TemporaryDirectory(prefix="imgtrain-engines-") as tmp:
        storage, run = args.storage or tmp, args.run or "engines"
        if args.run is None:
            cli("train", "--data", str(args.data), "--storage", storage, "--name", run, "--backend", "local",
                "--epochs", str(args.epochs), "--quiet")
        fp32, int8 = f"{tmp}/onnx", f"{tmp}/int8"
        cli("export", run, "--storage", storage, "--format", "onnx", "--out", fp32)
        cli("export", run, "--storage", storage, "--format", "onnx", "--quantize", "int8", "--max-accuracy-drop",
            "0.05", "--out", int8)
        targets = {"torch": (f"{storage}/{run}", "torch"), "onnxruntime": (fp32, "onnxruntime"),
                   "onnxruntime int8": (int8, "onnxruntime")}
        predictors = {name: Predictor(t, engine=e) for name, (t, e) in targets.items()}
        reference = [int(p) for p in predictors["torch"].predict_proba(images).argmax(1)]
        accuracy = {name: statistics.mean(int(a) == b for a, b in zip(p.predict_proba(images).argmax(1), labels))
                    for name, p in predictors.items()}
        rates: dict[str, list[float]] = {name: [] for name in targets}
        for _ in range(args.rounds):
            for name, predictor in predictors.items():
                rates[name].append(predict_rate(predictor, images, args.batch))
        print({k: [round(v) for v in r] for k, r in rates.items()}, flush=True)
        served: dict[str, list[dict]] = {name: [] for name in targets}
        for r in range(args.serve_rounds):
            for name in (list(targets) if r % 2 == 0 else list(reversed(targets))):
                served[name].append(serve_levels(*targets[name], storage, pngs, labels, reference))
                print(name, {c: round(v["throughput"]) for c, v in served[name][-1].items()}, flush=True)
    result = {"environment": environment(), "inputs": vars(args) | {"data": str(args.data)}, "accuracy": accuracy,
              "predict_images_per_s": rates, "serve": served}
    print(f"results: {write_result('engines', result)}")
    print("\n| engine | test accuracy | predict images/s (median) | vs torch | serve req/s, 1 client | "
          "64 clients | p99 at 64 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    base = statistics.median(rates["torch"])
    for name in targets:
        med = statistics.median(rates[name])
        one = statistics.median(s[1]["throughput"] for s in served[name])
        many = statistics.median(s[64]["throughput"] for s in served[name])
        p99 = statistics.median(s[64]["p99_s"] for s in served[name])
        print(f"| {name} | {accuracy[name]:.2%} | {med:,.0f} ({min(rates[name]):,.0f}-{max(rates[name]):,.0f}) | "
              f"{med / base:.2f}x | {one:.0f} | {many:.0f} | {p99 * 1000:.0f} ms |")


if __name__ == "__main__":
    main()
