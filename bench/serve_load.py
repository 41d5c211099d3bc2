"""Serving under load (issue 23): ``imgtrain serve`` answering PNG digits from pools of clients.

Starts the real server (``imgtrain serve RUN``, extra ``--serve-args`` passed on), then for each
level ``CONCURRENCY:REQUESTS`` a pool of client threads, each with its own keep-alive connection,
POSTs the sample's 28x28 test digits as PNG bytes to ``/predict`` as fast as answers come back
(no retries; after a 503 with ``Retry-After`` a client waits as told before its next request). Per level: throughput (answered requests per second of wall time), p50/p99 latency
of the answered requests, the status of the others, and the answers' accuracy against the labels
and their agreement with a single-image forward pass of the same model in this process (batching
must not mix up which image gets which answer). Without ``--run``, a model is trained first (the
demo recipe for ``--epochs`` epochs on the embedded sample, one process).

    .venv/bin/python bench/serve_load.py [--run RUN --storage DIR] [--levels 1:100,16:600,64:1000,256:1024]
    .venv/bin/python bench/serve_load.py --other /tmp/old   # the same against another checkout's build
"""

from __future__ import annotations

import argparse
import http.client
import io
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_versions import command  # noqa: E402
from common import SAMPLE_DATA, ensure_data, environment, write_result  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
STARTUP_S = 300


def test_digits(data: Path) -> tuple[list[bytes], list[int], "object"]:
    """(PNG bytes, labels, uint8 images) of the data set's test split."""
    import numpy as np
    from PIL import Image

    from imgtrain.inference.inputs import list_inputs, read_task

    inputs = list_inputs(str(data), "test")
    parts = [read_task({"task": [json.dumps(t)]}, (28, 28, 1), "digits") for t in inputs.tasks]
    images = np.concatenate([p["image"] for p in parts])
    labels = [int(v) for p in parts for v in p["label"]]
    pngs = []
    for image in images:
        buf = io.BytesIO()
        Image.fromarray(image[..., 0]).save(buf, format="PNG")
        pngs.append(buf.getvalue())
    return pngs, labels, images


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server did not answer within {STARTUP_S} s")


def stop_server(proc: subprocess.Popen) -> None:
    """Ctrl-C to the server's process group, as a user stops it; killed after a minute."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def client(port: int, pngs: list[bytes], order: list[int], claim, results: list) -> None:
    """POST images until the shared counter runs out; one keep-alive connection per client."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    while (k := claim()) is not None:
        i = order[k]
        started = time.perf_counter()
        try:
            conn.request("POST", "/predict", body=pngs[i], headers={"Content-Type": "image/png"})
            response = conn.getresponse()
            body = response.read()
            status, retry_after = response.status, response.getheader("Retry-After")
        except OSError as e:  # connection reset or refused under overload
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            status, body, retry_after = f"error: {type(e).__name__}", b"", None
        elapsed = time.perf_counter() - started
        index = json.loads(body)["index"] if status == 200 else None
        results.append({"image": i, "status": status, "latency_s": elapsed, "index": index,
                        "retry_after": retry_after})
        if retry_after and retry_after.isdigit():  # a well-behaved client waits as told, then goes on
            time.sleep(int(retry_after))
    conn.close()


def load(port: int, pngs: list[bytes], concurrency: int, requests: int) -> tuple[list[dict], float]:
    order = [k % len(pngs) for k in range(requests)]
    lock, counter, results = threading.Lock(), [0], []

    def claim():
        with lock:
            if counter[0] >= requests:
                return None
            counter[0] += 1
            return counter[0] - 1

    threads = [threading.Thread(target=client, args=(port, pngs, order, claim, results)) for _ in range(concurrency)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - started


def summarize_level(results: list[dict], wall: float, labels: list[int], reference: list[int]) -> dict:
    answered = [r for r in results if r["status"] == 200]
    latencies = sorted(r["latency_s"] for r in answered)
    others: dict[str, int] = {}
    for r in results:
        if r["status"] != 200:
            others[str(r["status"])] = others.get(str(r["status"]), 0) + 1
    rejected = [r for r in results if r["status"] in (503, 429)]
    pct = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else None  # noqa: E731
    return {
        "requests": len(results), "answered": len(answered), "wall_s": wall,
        "throughput": len(answered) / wall, "p50_s": pct(0.50), "p99_s": pct(0.99), "others": others,
        "rejected_with_retry_after": sum(r["retry_after"] is not None for r in rejected),
        "rejected_p99_s": sorted(r["latency_s"] for r in rejected)[int(0.99 * len(rejected))] if rejected else None,
        "accuracy": statistics.mean(r["index"] == labels[r["image"]] for r in answered) if answered else None,
        "agreement": statistics.mean(r["index"] == reference[r["image"]] for r in answered) if answered else None,
    }


def reference_answers(run: str, storage: str, images) -> list[int]:
    """The model's answer for each image, one image at a time in this process."""
    from imgtrain.inference.predictor import Predictor

    predictor = Predictor(run, storage=storage)
    return [int(predictor.predict_proba(images[k:k + 1]).argmax()) for k in range(len(images))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", help="a trained run (default: train one)")
    parser.add_argument("--storage", default=None)
    parser.add_argument("--data", type=Path, default=SAMPLE_DATA)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--levels", default="1:100,16:600,64:1000,256:1024",
                        help="CONCURRENCY:REQUESTS, comma separated")
    parser.add_argument("--serve-args", default="", help="more `imgtrain serve` options")
    parser.add_argument("--other", type=Path, help="serve with another checkout's build instead of this one")
    args = parser.parse_args()
    ensure_data(args.data)
    pngs, labels, images = test_digits(args.data)
    with tempfile.TemporaryDirectory(prefix="imgtrain-serve-load-") as tmp:
        storage = args.storage or tmp
        run = args.run
        if run is None:
            run = "serve-load"
            subprocess.run([sys.executable, "-m", "imgtrain.cli", "train", "--data", str(args.data), "--storage",
                            storage, "--name", run, "--backend", "local", "--epochs", str(args.epochs), "--quiet"],
                           check=True)
        reference = reference_answers(run, storage, images)
        cli, env = command(args.other) if args.other else ([sys.executable, "-m", "imgtrain.cli"], dict(os.environ))
        port = free_port()
        serve = subprocess.Popen([*cli, "serve", run, "--storage", storage, "--port", str(port),
                                  *args.serve_args.split()], env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True, start_new_session=True)
        result = {"environment": environment(), "inputs": {k: str(v) for k, v in vars(args).items()}, "levels": {}}
        try:
            wait_healthy(port, serve)
            load(port, pngs, 4, 40)  # warm-up: connections, the first batches
            for level in args.levels.split(","):
                concurrency, requests = (int(v) for v in level.split(":"))
                results, wall = load(port, pngs, concurrency, requests)
                result["levels"][concurrency] = found = summarize_level(results, wall, labels, reference)
                print(concurrency, {k: v for k, v in found.items()}, flush=True)
        finally:
            stop_server(serve)
    print(f"results: {write_result('serve_load', result)}")
    print("\n| concurrent clients | requests | throughput | p50 latency | p99 latency | not answered | accuracy |")
    print("|---|---|---|---|---|---|---|")
    for concurrency, f in result["levels"].items():
        ms = lambda s: "-" if s is None else f"{s * 1000:.0f} ms" if s < 1 else f"{s:.1f} s"  # noqa: E731
        others = ", ".join(f"{n} x {status}" for status, n in f["others"].items()) or "0"
        accuracy = "-" if f["accuracy"] is None else f"{f['accuracy']:.1%} ({f['agreement']:.1%} agree)"
        print(f"| {concurrency} | {f['requests']:,} | {f['throughput']:.0f} req/s | {ms(f['p50_s'])} | "
              f"{ms(f['p99_s'])} | {others} | {accuracy} |")


if __name__ == "__main__":
    main()
