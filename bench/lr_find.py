"""lr-find's suggestion against the default LR and a small sweep's best LR (issue 50).

For each data set: `imgtrain lr-find` (the range test, 100 steps from 1e-7 to 10) at each seed;
then short runs (`--backend local`, `--epochs E`) at each LR of a sweep spaced by about 3x, at the
default LR (3e-3) and at the suggestion, each at each seed, scored by the best epoch's validation
accuracy. The aim: the suggestion within a factor of 3 of the sweep's best LR. Also
`--batch-size auto` on this machine's CPU (the batch it picks, and the estimate against the
measured peak memory of one step at that batch).

    python bench/lr_find.py [--seeds 0,1,2] [--sweep-seeds 0] [--epochs 3] [--model resnet18]

Data sets: the embedded digits (`data prepare mnist-sample`, 3,500 train / 500 val) and
scikit-learn's 1,797 8x8 digits written as 32x32 PNG class folders (a photo set: 1,259 train /
179 val). Everything trains in this process, one run at a time.
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
from common import environment, write_result  # noqa: E402

SWEEP = (3e-4, 1e-3, 3e-3, 1e-2, 3e-2)


def prepare(root: Path) -> dict[str, Path]:
    """The two data sets, prepared under ``root``."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    mnist, digits, png = root / "mnist", root / "sklearn-digits", root / "sklearn-digits-png"
    cli = [sys.executable, "-m", "imgtrain.cli", "data", "prepare"]
    if not (mnist / "manifest.json").is_file():
        subprocess.run([*cli, "mnist-sample", str(mnist)], check=True, capture_output=True)
    if not (digits / "manifest.json").is_file():
        found = load_digits()
        for i, (image, label) in enumerate(zip(found.images, found.target)):
            (png / str(label)).mkdir(parents=True, exist_ok=True)
            pixels = Image.fromarray((image / 16 * 255).astype(np.uint8)).resize((32, 32), Image.BILINEAR)
            pixels.convert("RGB").save(png / str(label) / f"{i}.png")
        subprocess.run([*cli, "folder", str(digits), "--source", str(png)], check=True, capture_output=True)
    return {"mnist-sample": mnist, "sklearn-digits-png": digits}


def suggestion(data: Path, model: str, seed: int, out: Path) -> tuple[float, float]:
    from imgtrain.config import TrainConfig
    from imgtrain.training import lr_find

    started = time.perf_counter()
    curve, _, _ = lr_find.find(TrainConfig(data=str(data), backend="local", workers=1, model=model, seed=seed),
                               _options(out))
    return curve.suggestion, time.perf_counter() - started


def _options(out: Path):
    from imgtrain.config import LrFindOptions

    return LrFindOptions(out=out)


def accuracy(data: Path, model: str, lr: float, seed: int, epochs: int, storage: Path) -> float:
    import imgtrain
    from imgtrain.config import TrainConfig
    from imgtrain.training.progress import TrainingDisplay

    name = f"lr{lr:.2g}-s{seed}".replace(".", "_")
    result = imgtrain.train(TrainConfig(data=str(data), storage=str(storage), name=name, backend="local", workers=1,
                                        model=model, lr=lr, seed=seed, epochs=epochs),
                            display=TrainingDisplay(quiet=True), overwrite=(storage / name).exists())
    return max(r["val_accuracy"] for r in result.history)


def batch_auto(data: Path, model: str) -> dict:
    """--batch-size auto on this CPU, in a fresh process: the batch it picks and its estimate of a
    step's memory at that batch; then, in another fresh process, one step at that batch measured
    (VmHWM after it less VmRSS before the model was built)."""
    head = f"""
import json, torch
from imgtrain.config import TrainConfig
from imgtrain.data.format import verify_dataset
from imgtrain.training import batch_fit
m = verify_dataset({str(data)!r})
cfg = TrainConfig(data={str(data)!r}, name="b", backend="local", workers=1, model={model!r}, batch_size="auto")
"""
    chosen = _child(head + """
fit = batch_fit.fit(cfg, m)
fixed, per = batch_fit._measured_step(cfg, m)
print(json.dumps({"batch": fit.batch_size, "piece": fit.per_piece, "limit": fit.limit, "detail": fit.detail,
                  "estimate_mib": round((fixed + fit.per_piece * per * batch_fit.ACTIVATION_FACTOR) / 2**20, 1)}))
""")
    measured = _child(head + f"""
from pathlib import Path
Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
before = batch_fit._status_bytes("VmRSS")
batch_fit._one_step(cfg, m, torch.device("cpu"), {chosen["piece"]})
print(json.dumps({{"measured_step_mib": round((batch_fit._status_bytes("VmHWM") - before) / 2**20, 1)}}))
""")
    return {**chosen, **measured}


def _child(script: str) -> dict:
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2", help="seeds of the range test")
    parser.add_argument("--sweep", default=",".join(f"{lr:g}" for lr in SWEEP), help="the LRs of the sweep")
    parser.add_argument("--sweep-seeds", default="0", help="seeds of each sweep run")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--data", default="", help="one of the data sets only")
    parser.add_argument("--root", default="", help="where data and runs go (a temporary folder by default)")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    sweep_seeds = [int(s) for s in args.sweep_seeds.split(",")]
    sweep = tuple(float(lr) for lr in args.sweep.split(","))
    root = Path(args.root or tempfile.mkdtemp(prefix="lr-find-bench-"))
    results = {}
    for name, data in prepare(root).items():
        if args.data and name != args.data:
            continue
        found = [suggestion(data, args.model, s, root / f"{name}-{s}") for s in seeds]
        suggested = [lr for lr, _ in found]
        print(f"{name}: suggestions {suggested} ({statistics.mean(t for _, t in found):.0f} s each)", flush=True)
        lrs = sorted({*sweep, round(statistics.median(suggested), 6)})
        scores = {lr: [accuracy(data, args.model, lr, s, args.epochs, root / f"runs-{name}") for s in sweep_seeds]
                  for lr in lrs}
        for lr, acc in scores.items():
            print(f"  lr {lr:.2g}: val accuracy {statistics.mean(acc):.4f} {acc}", flush=True)
        sweep_scores = {lr: statistics.mean(scores[lr]) for lr in sweep}
        best = max(sweep_scores, key=sweep_scores.get)
        median = statistics.median(suggested)
        results[name] = {
            "suggestions": suggested, "suggestion_median": median, "range_test_s": [t for _, t in found],
            "sweep": {f"{lr:g}": acc for lr, acc in scores.items()}, "sweep_best_lr": best,
            "ratio_to_best": median / best, "within_3x": 1 / 3 <= median / best <= 3,
            "default_accuracy": sweep_scores.get(3e-3), "best_accuracy": sweep_scores[best],
            "suggestion_accuracy": statistics.mean(scores[round(median, 6)]),
            "batch_auto": batch_auto(data, args.model),
        }
        print(f"  best {best:g}; suggestion {median:.2g} = {median / best:.2f}x the best; "
              f"batch auto {results[name]['batch_auto']}", flush=True)
    payload = {"epochs": args.epochs, "model": args.model, "seeds": seeds, "sweep_seeds": sweep_seeds,
               "results": results, "environment": environment()}
    print(f"written: {write_result('lr_find' + (f'-{args.data}' if args.data else ''), payload)}")


if __name__ == "__main__":
    main()
