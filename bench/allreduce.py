"""All-reduce time of ResNet-18's gradients between local processes (gloo on CPU, NCCL on GPUs).

The input to the scaling model in BENCHMARKS.md: one all-reduce of 11.2 M float32 values (the
gradients DDP averages every step), timed over ``--repeats`` calls after two warm-up calls.
Usage: ``python bench/allreduce.py [--world 2] [--repeats 10]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PARAMETERS = 11_175_370  # ResNet-18 with a 1-channel conv1 and 10 classes: sum(p.numel())


def worker(rank: int, world: int, repeats: int, backend: str, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=world)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    grads = torch.ones(PARAMETERS, device=device)
    times = []
    for i in range(repeats + 2):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        dist.all_reduce(grads)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 2:
            times.append(time.perf_counter() - start)
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--backend", default="nccl" if torch.cuda.device_count() > 1 else "gloo")
    opts = parser.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, opts.world, opts.repeats, opts.backend, 29611, out))
             for r in range(opts.world)]
    for p in procs:
        p.start()
    times = out.get(timeout=600)
    for p in procs:
        p.join()
    megabytes = PARAMETERS * 4 / 1e6
    median = statistics.median(times)
    # Ring all-reduce moves 2 (N - 1) / N of the data through each process: "bus bandwidth".
    bus = megabytes * 2 * (opts.world - 1) / opts.world / median / 1e3
    print(json.dumps({"backend": opts.backend, "world": opts.world, "megabytes": megabytes,
                      "median_s": median, "min_s": min(times), "max_s": max(times), "n": len(times),
                      "bus_gb_per_s": bus}))


if __name__ == "__main__":
    main()
