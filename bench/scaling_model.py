"""Data-parallel ResNet-18 on paper: throughput and efficiency at 1, 2, 8 and 64 devices.

A step on each of N devices with b images each takes

    t_step = fixed + b * per_image + exposed all-reduce
    all-reduce = 2 (N - 1) / N * S / bus_bandwidth + 2 * ceil(log2 N) * latency

S = the gradients, 11.2 M float32 values (44.7 MB). ``fixed`` is the work that does not shrink
with the batch (optimizer and weight average over every parameter, kernel launches). DDP
overlaps the all-reduce with the backward pass (about 2/3 of the batch's compute), so the
exposed part lies between none of it (full overlap) and all of it (none): both are printed.
Communication stops dominating at the per-device batch where the compute equals the
all-reduce: b* = (all-reduce - fixed) / per_image.

Inputs come from measurements (``bench/train_throughput.py``, ``bench/allreduce.py``) or, where
no such hardware was at hand, from stated estimates; pass your own with the flags.
"""

from __future__ import annotations

import argparse
import math

GRADIENT_BYTES = 11_175_370 * 4


def allreduce_s(n: int, bus_gb_s: float, latency_us: float) -> float:
    if n == 1:
        return 0.0
    return 2 * (n - 1) / n * GRADIENT_BYTES / (bus_gb_s * 1e9) + 2 * math.ceil(math.log2(n)) * latency_us * 1e-6


def rows(per_image_us: float, fixed_ms: float, batch: int, links: dict[int, tuple[float, float]]):
    """(N, images/s without overlap, with overlap, efficiency both ways, all-reduce ms, b*) per N."""
    compute = fixed_ms * 1e-3 + batch * per_image_us * 1e-6
    single = batch / compute
    for n, (bus, latency) in sorted(links.items()):
        comm = allreduce_s(n, bus, latency)
        hidden = min(comm, 2 / 3 * batch * per_image_us * 1e-6)
        worst, best = n * batch / (compute + comm), n * batch / (compute + comm - hidden)
        b_star = max(0.0, (comm - fixed_ms * 1e-3) / (per_image_us * 1e-6))
        yield n, worst, best, worst / (n * single), best / (n * single), comm * 1e3, b_star


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-image-us", type=float, required=True, help="compute per image, microseconds")
    parser.add_argument("--fixed-ms", type=float, required=True, help="per-step work independent of the batch")
    parser.add_argument("--batch", type=int, default=128, help="images per device per step")
    parser.add_argument("--link", action="append", default=[], metavar="N:GB/s:latency_us",
                        help="bus bandwidth and per-hop latency at N devices (repeatable)")
    opts = parser.parse_args()
    links = {}
    for spec in opts.link or ["1:1:0"]:
        n, bus, latency = spec.split(":")
        links[int(n)] = (float(bus), float(latency))
    links.setdefault(1, (1.0, 0.0))
    print("| devices | all-reduce, ms | images/s (no overlap - full overlap) | efficiency | "
          "per-device batch where compute = all-reduce |")
    print("|---|---|---|---|---|")
    for n, worst, best, eff_worst, eff_best, comm_ms, b_star in rows(opts.per_image_us, opts.fixed_ms, opts.batch, links):
        print(f"| {n} | {comm_ms:.2f} | {worst:,.0f} - {best:,.0f} | {eff_worst:.0%} - {eff_best:.0%} | "
              f"{b_star:,.0f} (global {n * b_star:,.0f}) |")


if __name__ == "__main__":
    main()
