"""Batch evaluation throughput: imgtrain's inference against the ceiling and the tutorial.

Rows, all on the same checkpoint and the same in-memory uint8 images (the embedded test split
repeated up to --images), one Ray cluster started once for the whole run:
  plain loop       one process, torch.inference_mode(), batches of --batch-size, every core
  imgtrain local   imgtrain's Predictor in this process (evaluate/predict --backend local)
  imgtrain ray xN  imgtrain's Ray Data actor pool with N actors (the default path of evaluate)
  tutorial actor   the tutorial's per-image ``ray.get(worker.predict.remote(x))``, on a subset
Figures, each over n runs as median (min-max), with the ratio of medians to the plain loop:
  end to end   images/s over the whole call (Ray rows include starting their actors)
  startup      seconds for a call on one batch: actor start, imports, checkpoint load
  steady       images/s once running: (N - one batch) / (time for N - time for one batch)

    .venv/bin/python bench/eval_throughput.py --run demo [--storage runs] [--images 20000]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, fmt, summarize, write_result  # noqa: E402


def plain_loop(loaded, images: np.ndarray, batch_size: int) -> float:
    import torch

    model, prep = loaded.model, loaded.preprocess
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(images), batch_size):
            model(prep(images[i : i + batch_size])).argmax(1)
    return len(images) / (time.perf_counter() - start)


def imgtrain_times(loaded, images: np.ndarray, opts) -> tuple[float, float]:
    """Seconds for one batch, then for all of ``images``, through imgtrain's run_predictor."""
    from imgtrain.inference.batch import run_predictor

    times = []
    for subset in (images[: opts.batch_size], images):
        start = time.perf_counter()
        frame = run_predictor(loaded, {"id": np.arange(len(subset))}, subset, opts)
        times.append(time.perf_counter() - start)
        assert len(frame) == len(subset)
    return times[0], times[1]


def tutorial_rate(checkpoint: Path, images: np.ndarray) -> float:
    """The tutorial's pattern: one remote call and one ray.get per image."""
    import ray
    import torch

    from imgtrain.models.resnet18 import build_resnet18

    @ray.remote(num_cpus=1)
    class ModelWorker:
        def __init__(self, path):
            torch.set_num_threads(os.cpu_count() or 1)
            self.model = build_resnet18()
            self.model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
            self.model.eval()

        @torch.inference_mode()
        def predict(self, batch):
            x = torch.as_tensor(batch)
            if x.ndim == 3:
                x = x.unsqueeze(0)
            return self.model(x).argmax(1).tolist()

    start = time.perf_counter()
    worker = ModelWorker.remote(str(checkpoint / "model.pt"))
    for img in images:
        x = torch.from_numpy(img).permute(2, 0, 1).float().div(255).sub(0.5).div(0.5)  # ToTensor+Normalize
        ray.get(worker.predict.remote(x))
    rate = len(images) / (time.perf_counter() - start)
    ray.kill(worker)
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", default="demo")
    parser.add_argument("--storage", default="runs")
    parser.add_argument("--images", type=int, default=20_000)
    parser.add_argument("--tutorial-images", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import ray
    import torch

    from imgtrain.data.format import read_split
    from imgtrain.inference.batch import InferenceOptions
    from imgtrain.inference.predictor import load_checkpoint

    torch.set_num_threads(os.cpu_count() or 1)
    loaded = load_checkpoint(args.run, storage=args.storage)
    _, test_images, _ = read_split(loaded.meta["config"]["data"], "test")
    reps = -(-args.images // len(test_images))
    images = np.ascontiguousarray(np.concatenate([test_images] * reps)[: args.images])
    os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        n, bs = len(images), args.batch_size
        results = {}
        plain = [plain_loop(loaded, images, bs) for _ in range(args.repeats)]
        results["plain loop"] = {"end_to_end": summarize(plain), "steady": summarize(plain)}
        imgtrain_rows = {
            "imgtrain local": InferenceOptions(backend="local", batch_size=bs),
            "imgtrain ray x1": InferenceOptions(concurrency=1, batch_size=bs),
            "imgtrain ray x2": InferenceOptions(concurrency=2, batch_size=bs),
        }
        for name, opts in imgtrain_rows.items():
            runs = [imgtrain_times(loaded, images, opts) for _ in range(args.repeats)]
            results[name] = {
                "end_to_end": summarize([n / total for _, total in runs]),
                "startup_s": summarize([one for one, _ in runs]),
                "steady": summarize([(n - bs) / (total - one) for one, total in runs]),
            }
        tutorial = [tutorial_rate(loaded.path, images[: args.tutorial_images]) for _ in range(args.repeats)]
        results["tutorial actor"] = {"end_to_end": summarize(tutorial), "steady": summarize(tutorial)}
    finally:
        ray.shutdown()

    base = results["plain loop"]["end_to_end"]["median"]
    print(f"\n{n} images, batch {bs}, n={args.repeats}, {os.cpu_count()} cores; "
          f"tutorial row on {args.tutorial_images} images\n")
    print("| path | end to end, images/s | ratio | startup, s | steady, images/s | ratio |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        startup = fmt(r["startup_s"], 1) if "startup_s" in r else "-"
        print(f"| {name} | {fmt(r['end_to_end'])} | {r['end_to_end']['median'] / base:.2f} | {startup} "
              f"| {fmt(r['steady'])} | {r['steady']['median'] / base:.2f} |")
    path = write_result("eval_throughput", {"args": vars(args), "checkpoint": str(loaded.path),
                                            "environment": environment(), "results": results})
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
