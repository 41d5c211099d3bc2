"""Knowledge distillation (issue 50 item 1): a small student distilled from a bigger teacher
against the same student trained alone, at the same epochs, and the cost of the cached mode
against the online one.

For each data set: the teacher (``--teacher-model``, default resnet18) trained once, seed 0,
``--teacher-epochs`` epochs with imgtrain's defaults; then for each seed the student
(``--student``, default timm's test_resnet, 0.4 M parameters) trained alone and distilled
(``--teacher``, everything else the defaults: augmentation on, so the mode is online, T 1,
weight 0.5; ``--also T:W,...`` adds other recipes beside them, reported apart), interleaved;
``--no-augment`` and ``--mixup ALPHA`` change every student alike. Each run's best checkpoint
(chosen on the val split) is scored on the test split, which nothing was tuned on. The cost:
seed 0 again with ``--no-augment``, distilled in each mode (the cached run reading a table
computed just before, timed on its own: the cache pass), seconds per training epoch.

    python bench/distill.py [--seeds 0,1,2] [--epochs 3] [--teacher-epochs 3]

Data sets: the embedded digits (`data prepare mnist-sample`, written under ``--root``: the cache
goes beside the data set; 3,500 train / 500 val / 1,000 test) and scikit-learn's 1,797 8x8 digits written as
32x32 PNG class folders (1,259 train / 179 val / 359 test), and a photo set: 32x32 crops of ten of
scikit-image's photographs, labelled by photograph, each split from its own band of every
photograph (bench/photo_crops.py: 2,000 train / 500 val / 1,000 test). One torch thread, every
run in this process, one at a time.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, write_result  # noqa: E402
from lr_find import prepare  # noqa: E402 - the same two data sets
from photo_crops import prepare as prepare_photos  # noqa: E402 - a photo set: crops of scikit-image's photographs

def train(data: Path, storage: Path, name: str, model: str, epochs: int, seed: int, **more):
    import imgtrain
    from imgtrain.config import TrainConfig
    from imgtrain.training.progress import TrainingDisplay

    cfg = TrainConfig(data=str(data), storage=str(storage), name=name, backend="local", workers=1, model=model,
                      epochs=epochs, seed=seed, threads_per_worker=1, **more)
    started = time.perf_counter()
    result = imgtrain.train(cfg, display=TrainingDisplay(quiet=True), overwrite=(storage / name).exists())
    wall = time.perf_counter() - started
    train_s = [r["train_samples"] / r["images_per_s"] for r in result.history]
    return result, wall, statistics.mean(train_s)


def recipe(args) -> dict:
    """The distillation settings the command line names; the others are imgtrain's defaults."""
    named = {"distill_temperature": args.temperature, "distill_weight": args.weight}
    return {k: v for k, v in named.items() if v is not None}


def students(args) -> dict:
    """What every student run shares, alone or distilled: augmentation, and mixup where asked for."""
    return {"augment": args.augment, "mixup": args.mixup}


def test_accuracy(result) -> float:
    import imgtrain
    from imgtrain.inference.options import InferenceOptions

    return imgtrain.evaluate(str(result.path), split="test", options=InferenceOptions(backend="local", threads=1)).accuracy


def stat(values: list[float]) -> dict:
    return {"mean": statistics.mean(values), "min": min(values), "max": max(values), "values": values}


def bench_one(label: str, data: Path, storage: Path, args) -> dict:
    teacher, t_wall, t_epoch = train(data, storage, "teacher", args.teacher_model, args.teacher_epochs, 0,
                                     stem=args.teacher_stem)
    teacher_acc = test_accuracy(teacher)
    print(f"[{label}] teacher {args.teacher_model}: test {teacher_acc:.4f} ({t_wall:.0f} s)", flush=True)
    alone, taught, seconds = [], [], {"alone": [], "distilled": []}
    val = {"alone": [], "distilled": []}  # the best epoch's val accuracy: what a user could choose by
    also = {}
    for seed in args.seeds:
        a, _, a_epoch = train(data, storage, f"alone-s{seed}", args.student, args.epochs, seed, **students(args))
        d, _, d_epoch = train(data, storage, f"distilled-s{seed}", args.student, args.epochs, seed,
                              **students(args), teacher=str(teacher.path), **recipe(args))
        val["alone"].append(max(r["val_accuracy"] for r in a.history))
        val["distilled"].append(max(r["val_accuracy"] for r in d.history))
        alone.append(test_accuracy(a))
        taught.append(test_accuracy(d))
        seconds["alone"].append(a_epoch)
        seconds["distilled"].append(d_epoch)
        print(f"[{label}] seed {seed}: alone {alone[-1]:.4f}, distilled {taught[-1]:.4f} "
              f"({a_epoch:.1f} / {d_epoch:.1f} s an epoch)", flush=True)
        for t, w in args.also:  # other recipes beside the defaults, reported apart (never used to choose them)
            o, _, _ = train(data, storage, f"also-T{t:g}-w{w:g}-s{seed}", args.student, args.epochs, seed,
                            **students(args), teacher=str(teacher.path), distill_temperature=t, distill_weight=w)
            row = also.setdefault(f"T {t:g}, weight {w:g}", {"test": [], "val": []})
            row["test"].append(test_accuracy(o))
            row["val"].append(max(r["val_accuracy"] for r in o.history))
            print(f"[{label}] seed {seed}: T {t:g}, weight {w:g}: {row['test'][-1]:.4f}", flush=True)
    margins = [d - a for a, d in zip(alone, taught)]
    also = {k: {"test": stat(v["test"]), "val": stat(v["val"]),
                "margin": stat([d - a for a, d in zip(alone, v["test"])])} for k, v in also.items()}
    cost = None if args.skip_cost else cost_of_modes(data, storage, teacher, args)
    print(f"[{label}] cost: {cost}", flush=True)
    if not args.seeds:  # --cost-only
        return {"teacher": {"model": args.teacher_model, "test_accuracy": teacher_acc}, "cost": cost}
    return {"teacher": {"model": args.teacher_model, "stem": args.teacher_stem, "epochs": args.teacher_epochs, "test_accuracy": teacher_acc,
                        "train_s_per_epoch": t_epoch},
            "student": args.student, "epochs": args.epochs, "alone": stat(alone), "distilled": stat(taught),
            "margin": stat(margins), "val": {k: stat(v) for k, v in val.items()}, "train_s_per_epoch": {k: stat(v) for k, v in seconds.items()}, "also": also, "cost": cost}


def cost_of_modes(data: Path, storage: Path, teacher, args) -> dict:
    """Seed 0 without augmentation: the cache pass, then an epoch's training seconds in each mode."""
    from imgtrain.config import TrainConfig
    from imgtrain.data.format import load_manifest
    from imgtrain.training import distill, teacher_cache

    manifest = load_manifest(data)
    cfg = distill.resolved(TrainConfig(data=str(data), teacher=str(teacher.path), augment=False), manifest, None,
                           lambda _: None)
    shutil.rmtree(data / teacher_cache.FOLDER, ignore_errors=True)
    started = time.perf_counter()
    teacher_cache.ensure(cfg, manifest, lambda _: None, on_ray=False)
    cache_s = time.perf_counter() - started
    out = {"cache_pass_s": cache_s, "rows": manifest["splits"]["train"]["num_samples"]}
    for mode in ("cached", "online"):
        result, wall, epoch_s = train(data, storage, f"cost-{mode}", args.student, args.epochs, 0, augment=False,
                                      teacher=str(teacher.path), distill_mode=mode)
        out[mode] = {"train_s_per_epoch": epoch_s, "wall_s": wall, "test_accuracy": test_accuracy(result)}
    result, wall, epoch_s = train(data, storage, "cost-alone", args.student, args.epochs, 0, augment=False)
    out["alone"] = {"train_s_per_epoch": epoch_s, "wall_s": wall, "test_accuracy": test_accuracy(result)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--teacher-epochs", type=int, default=3)
    parser.add_argument("--teacher-model", default="resnet18")
    parser.add_argument("--student", default="timm:test_resnet")
    parser.add_argument("--teacher-stem", default="auto", help="the teacher's --stem (small: a CIFAR ResNet's)")
    parser.add_argument("--no-augment", dest="augment", action="store_false",
                        help="the students without augmentation (so distilled from the cache)")
    parser.add_argument("--mixup", type=float, default=0.0,
                        help="the students' --mixup alpha (mixed images: the teacher's targets are soft)")
    parser.add_argument("--temperature", type=float, default=None, help="default: imgtrain's --distill-temperature")
    parser.add_argument("--weight", type=float, default=None, help="default: imgtrain's --distill-weight")
    parser.add_argument("--also", default="", help="other recipes run beside the defaults: T:weight,...")
    parser.add_argument("--skip-cost", action="store_true", help="leave out the cached-against-online runs")
    parser.add_argument("--cost-only", action="store_true", help="only the cached-against-online runs")
    parser.add_argument("--only", default="", help="one data set: mnist-sample, sklearn-digits-png or photo-crops")
    parser.add_argument("--root", default="", help="where data and runs go (default: a temporary folder)")
    args = parser.parse_args()
    args.seeds = [] if args.cost_only else [int(s) for s in args.seeds.split(",")]
    args.also = [tuple(float(v) for v in r.split(":")) for r in args.also.split(",") if r]
    import torch

    torch.set_num_threads(1)
    root = Path(args.root or tempfile.mkdtemp(prefix="distill-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    sets = prepare(root)  # in root: the teacher's table is written beside each
    if args.only in ("", "photo-crops"):
        sets["photo-crops"] = prepare_photos(root)
    started = time.perf_counter()
    results = {}
    for label in ("sklearn-digits-png", "mnist-sample", "photo-crops"):
        if args.only and label != args.only:
            continue
        results[label] = bench_one(label, sets[label], root / "runs" / label, args)
    from imgtrain.config import TrainConfig

    defaults = TrainConfig()
    distilled_recipe = {"distill_temperature": defaults.distill_temperature, "distill_weight": defaults.distill_weight,
                        **recipe(args)}
    payload = {"environment": environment(), "args": {k: v for k, v in vars(args).items()},
               "distilled_recipe": distilled_recipe,
               "results": results, "total_s": time.perf_counter() - started}
    print(write_result("distill", payload))
    for label, r in results.items() if args.seeds else ():
        print(f"{label}: teacher {r['teacher']['test_accuracy']:.4f}; alone {r['alone']['mean']:.4f} "
              f"({r['alone']['min']:.4f}-{r['alone']['max']:.4f}), distilled {r['distilled']['mean']:.4f} "
              f"({r['distilled']['min']:.4f}-{r['distilled']['max']:.4f}), margin {r['margin']['mean']:+.4f} "
              f"({r['margin']['min']:+.4f} to {r['margin']['max']:+.4f}); val: alone {r['val']['alone']['mean']:.4f}, "
              f"distilled {r['val']['distilled']['mean']:.4f}")


if __name__ == "__main__":
    main()
