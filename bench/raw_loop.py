"""The ceiling: imgtrain's training recipe as a plain PyTorch loop in one process.

Same model (ResNet-18, 1-channel conv1), global batch, optimizer (AdamW + one-cycle), batch
augmentation, weight moving average and memory layout as ``imgtrain train``; the training
split held in memory as uint8 tensors and shuffled each epoch. No Ray, no DDP, no
checkpoints, no evaluation: what is left is the arithmetic every framework has to do.

Prints one JSON line per step ({"step", "epoch", "time", "images"}) and a last line with the
peak RSS. Used by ``bench/train_throughput.py``; runs alone too:
``python bench/raw_loop.py --data data/mnist-sample --epochs 1``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

T0 = time.time()  # before the imports: time to first step counts them, as it does for imgtrain

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from imgtrain.data.format import load_manifest, read_split  # noqa: E402
from imgtrain.data.tensors import random_affine, to_model_input  # noqa: E402
from imgtrain.models.resnet18 import build_resnet18  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--limit-steps", type=int, default=0, help="steps per epoch (0 = the whole split)")
    parser.add_argument("--threads", type=int, default=0, help="0 = every core")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--compile", action="store_true")
    opts = parser.parse_args()

    torch.set_num_threads(opts.threads or os.cpu_count() or 1)
    torch.manual_seed(0)
    device = torch.device(opts.device)
    manifest = load_manifest(opts.data)
    mean, std = manifest["normalize"]["mean"], manifest["normalize"]["std"]
    _, images, labels = (torch.from_numpy(a) for a in read_split(opts.data, "train"))
    images, labels = images.to(device), labels.to(device)  # the whole split on the device

    model = build_resnet18(manifest["channels"], manifest["num_classes"]).to(device, memory_format=torch.channels_last)
    forward = torch.compile(model) if opts.compile else model
    steps = len(labels) // opts.batch_size
    steps = min(steps, opts.limit_steps) if opts.limit_steps else steps
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=opts.epochs * steps, pct_start=0.15)
    criterion = nn.CrossEntropyLoss(reduction="sum")
    averaged = [p.detach().clone() for p in model.parameters()]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=opts.precision == "bf16")
    step = 0
    for epoch in range(opts.epochs):
        order = torch.randperm(len(labels), device=device)
        for i in range(steps):
            index = order[i * opts.batch_size : (i + 1) * opts.batch_size]
            x = to_model_input(images[index], mean, std)
            x = random_affine(x, torch.rand(len(index), 4, device=device) * 2 - 1, 10.0, 0.1, 0.1)
            y = labels[index]
            with autocast:
                loss = criterion(forward(x.contiguous(memory_format=torch.channels_last)), y) / len(y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            with torch.no_grad():
                torch._foreach_lerp_(averaged, [p.detach() for p in model.parameters()], 0.02)
            loss.item()  # imgtrain reads the loss every step too; on a GPU this is the sync point
            step += 1
            print(json.dumps({"step": step, "epoch": epoch, "time": time.time(), "images": len(y)}), flush=True)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"done": True, "started": T0, "peak_rss_mb": peak_mb}), flush=True)


if __name__ == "__main__":
    main()
