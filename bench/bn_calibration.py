"""Why BatchNorm calibration (``--bn-calibration``) helps: a trained run's final model.pt as saved,
then with its BatchNorm statistics recomputed from N training images as evaluation sees them
(no augmentation), and from the same images through the training augmentation (issue 18).

Trains nothing when ``--run`` names a finished run of the default model on a digits data set
trained without calibration; otherwise trains one with `make demo`'s command, ``--bn-calibration
0`` and ``--extra`` on ``--data``. Accuracy is on the data set's test split. docs/NOTES.md's table:
runs of the recipe before (``--extra "--max-rotate-deg 10 --max-scale 0.1"``) on the other splits.

    python bench/bn_calibration.py [--data DIR] [--seed 0] [--extra "..."] [--run RUN_DIR] [--images 512,1024,4000]
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SAMPLE_DATA, ensure_data, environment, write_result  # noqa: E402

from imgtrain.checkpoint_policy import POLICY  # noqa: E402
from imgtrain.data.format import read_split  # noqa: E402
from imgtrain.data.tensors import random_affine, to_model_input  # noqa: E402
from imgtrain.models.resnet18 import build_resnet18  # noqa: E402
from imgtrain.storage import checkpoint as ckpt  # noqa: E402


def accuracy(model, images, labels) -> float:
    model.eval()
    with torch.no_grad():
        predicted = torch.cat([model(to_model_input(images[i:i + 500], [0.5], [0.5])).argmax(1)
                               for i in range(0, len(images), 500)])
    return (predicted == labels).double().mean().item()


def recompute(model, images, affine: dict | None, seed: int = 0) -> None:
    """BatchNorm statistics from ``images`` in batches of 128, through the run's affine when given."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.reset_running_stats()
            m.momentum = None  # equal batches: the plain average of their statistics
    model.train()
    with torch.no_grad():
        for i in range(0, len(images), 128):
            x = to_model_input(images[i:i + 128], [0.5], [0.5])
            model(random_affine(x, torch.rand(len(x), 4, generator=g) * 2 - 1, **affine) if affine else x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=SAMPLE_DATA)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run", type=Path, help="a finished run (else one is trained)")
    parser.add_argument("--extra", default="", help="more train options for the run it trains")
    parser.add_argument("--images", default="512,1024,4000")
    args = parser.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory(prefix="imgtrain-bn-") as tmp:
        run = args.run
        if run is None:
            if args.data == SAMPLE_DATA:
                ensure_data(SAMPLE_DATA)
            subprocess.run([sys.executable, "-m", "imgtrain.cli", "train", "--data", str(args.data), "--storage", tmp,
                            "--name", "bn", "--workers", "2", "--seed", str(args.seed), "--bn-calibration", "0",
                            "--quiet", *shlex.split(args.extra)], check=True, capture_output=True)
            run = Path(tmp) / "bn"
        final = max(p for p in run.iterdir() if POLICY.is_checkpoint(p.name) and p.is_dir())
        config = ckpt.read_meta(final)["config"]
        data = config["data"]
        affine = {k: config[k] for k in ("max_rotate_deg", "max_shift", "max_scale")}
        _, test_x, test_y = map(torch.from_numpy, read_split(data, "test"))
        _, train_x, _ = map(torch.from_numpy, read_split(data, "train"))  # written in a seeded random order
        model = build_resnet18()
        saved = ckpt.load_model_state(final)
        model.load_state_dict(saved)
        found = {"as saved": accuracy(model, test_x, test_y)}
        for n in map(int, args.images.split(",")):
            for augment in (False, True):
                model.load_state_dict(saved)
                recompute(model, train_x[:n], affine if augment else None)
                found[f"{n} {'augmented' if augment else 'as evaluated'}"] = accuracy(model, test_x, test_y)
    for k, v in found.items():
        print(f"{k:>20}: {v:.2%}")
    write_result("bn_calibration", {"environment": environment(), "inputs": {**vars(args), "data": str(data),
                                                                            "run": str(args.run)}, "accuracy": found})


if __name__ == "__main__":
    main()
