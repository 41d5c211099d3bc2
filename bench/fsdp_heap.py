"""Where an FSDP worker's memory goes step by step, without Ray: two processes (gloo), ResNet-50
on random 28x28 batches of 16 per rank, AdamW and the weight average, 4 steps; each rank's
``RssAnon`` after every stage, then after ``malloc_trim(0)`` (what glibc's heap held freed).
``--mmap-threshold BYTES`` sets glibc's ``M_MMAP_THRESHOLD`` first (what ``--strategy fsdp``
workers do, ``fsdp.return_freed_memory``); 0 keeps glibc's dynamic default (issue 20).

    python bench/fsdp_heap.py [--strategy ddp|fsdp] [--mmap-threshold 131072]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, write_result  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))


def rss_anon_mb() -> int:
    line = next(line for line in open(f"/proc/{os.getpid()}/status") if line.startswith("RssAnon:"))
    return int(line.split()[1]) // 1024


def rank_main(rank: int, world: int, strategy: str, threshold: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    from imgtrain.models.zoo import build_from_args
    from imgtrain.training import fsdp
    from imgtrain.training.recipe import WeightAverage

    if threshold:
        ctypes.CDLL("libc.so.6").mallopt(-3, threshold)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29563")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    args = {"architecture": "resnet50", "in_channels": 1, "num_classes": 10, "stem": "standard", "image_size": [28, 28]}
    log = [("start", rss_anon_mb())]
    torch.manual_seed(0)
    net = build_from_args(args)
    if strategy == "ddp":
        model, ema = nn.parallel.DistributedDataParallel(net), WeightAverage(net, 0.98)
    else:
        model = fsdp.shard(net, torch.device("cpu"), "fp32")
        ema = WeightAverage(model, 0.98, fsdp.shard(build_from_args(args), torch.device("cpu"), "fp32"))
    del net
    log.append(("model and average", rss_anon_mb()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(4):
        x, y = torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,))
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        ema.update()
        log.append((f"step {step}", rss_anon_mb()))
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    log.append(("after malloc_trim", rss_anon_mb()))
    Path(out, f"rank{rank}.txt").write_text("\n".join(f"{k}\t{v}" for k, v in log))
    dist.destroy_process_group()


def main() -> None:
    import tempfile

    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), default="fsdp")
    parser.add_argument("--mmap-threshold", type=int, default=0)
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(rank_main, args=(2, opts.strategy, opts.mmap_threshold, out), nprocs=2)
        ranks = {r: [line.split("\t") for line in Path(out, f"rank{r}.txt").read_text().splitlines()] for r in (0, 1)}
    table = {stage: [int(ranks[r][i][1]) for r in (0, 1)] for i, (stage, _) in enumerate(ranks[0])}
    for stage, values in table.items():
        print(f"{stage:>20}: {values[0]} / {values[1]} MB")
    print(f"results: {write_result('fsdp_heap', {'environment': environment(), 'inputs': vars(opts), 'rss_anon_mb': table})}")


if __name__ == "__main__":
    main()
