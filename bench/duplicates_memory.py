"""Peak memory and time of the duplicate search when the pairs explode (issue 45, item 4):
n distinct images (different content hashes) that share one pHash are n^2 / 2 near pairs, and
so are n images whose pHashes all differ but lie within 2 bits of one another ("ball": at most
2,081 such hashes exist; n is capped there); "random" is n unrelated images, the search's
ordinary cost. Each case runs in a child process, which reports
its own peak RSS (``ru_maxrss``), for ``data inspect``'s report and ``--dedupe all`` and
``cross-split``. Synthetic fingerprints: no image is read.

    .venv/bin/python bench/duplicates_memory.py [--sizes 3000,40000] [--cases shared,ball,random]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def prints_of(case: str, n: int):
    from imgtrain.data.fingerprint import Prints

    rng = np.random.default_rng(0)
    prints = Prints.empty(n)
    prints.mode[:] = 5  # RGB: readable
    prints.content[:] = np.arange(1, n + 1, dtype=np.uint64)  # all different bytes
    centre = rng.integers(0, 2**63, 8, dtype=np.int64).astype(np.uint64)
    prints.phash[:] = centre
    if case == "random":  # unrelated images: few pairs, the search's ordinary cost
        prints.phash[:] = rng.integers(0, 2**63, (n, 8), dtype=np.int64).astype(np.uint64) << np.uint64(1)
    if case == "ball":  # every hash within 2 bits of the centre, all different
        flips = [0] + [1 << i for i in range(64)] + [(1 << i) | (1 << j) for i in range(64) for j in range(i + 1, 64)]
        prints.phash[:, 0] = centre[0] ^ np.array(flips[:n], np.uint64)
    split = np.zeros(n, np.int8)
    split[: n // 10] = 2  # a tenth in test
    return prints, split, np.arange(n) % 7


def child(case: str, n: int, what: str) -> None:
    from imgtrain.data import duplicate_drops, duplicate_report, duplicates

    prints, split, labels = prints_of(case, n)
    rank = duplicates.rank_of(split, np.arange(n))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    if what == "inspect":
        found = duplicate_report.report(prints, rank, split, labels, 4, 100_000)
        extra = {"pairs": found.pairs_total, "groups": found.groups_total, "examples": len(found.examples)}
    else:
        dropped = duplicate_drops.dropped_for(duplicates.Copies.of(prints, rank), split, 4, what)
        extra = {"dropped": int((dropped >= 0).sum())}
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"case": case, "n": n, "what": what, "seconds": round(seconds, 2),
                      "peak_rss_mib": round(peak / 1024), "rss_before_mib": round(before / 1024), **extra}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="3000,40000")
    parser.add_argument("--cases", default="shared,ball,random")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), args.child[2])
        return
    rows = []
    for case in args.cases.split(","):
        sizes = sorted({min(n, 2081) if case == "ball" else n for n in map(int, args.sizes.split(","))})
        for n in sizes:
            for what in ("inspect", "all", "cross-split"):
                out = subprocess.run([sys.executable, __file__, "--child", case, str(n), what], capture_output=True,
                                     text=True, check=True)
                rows.append(json.loads(out.stdout))
                print(out.stdout.strip(), flush=True)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import environment, write_result

    print(write_result("duplicates-memory", {"environment": environment(), "rows": rows}))

if __name__ == "__main__":
    main()
