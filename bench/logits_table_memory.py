"""Peak RSS of the cached teacher logits' table (issue 50): writing a large synthetic table batch by
batch, and looking up random batches of it by row id, each in a process of its own (VmHWM, the
process's own peak), against the table's size on disk; beside them, what the table held whole
(the former ``.npz``: np.load) and a lookup through a memory map's fancy indexing take.

    PYTHONPATH=src python bench/logits_table_memory.py [--rows 200000] [--classes 1000] [--batches 1000]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys
import numpy as np
from imgtrain.training import logits_table

def peak():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")) << 10

how, folder, n, k, batches = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
ref = logits_table.Ref(folder + "/t.ids.npy", folder + "/t.logits.npy", n, k)
ids = np.arange(n, dtype=np.int64) * 2 + 1  # a training split's ids: sorted, with gaps
wanted = [np.random.default_rng(s).choice(ids, 256) for s in range(batches)]
before = peak()
if how == "write":  # as the teacher's pass returns them: batches of 256 in any order
    def arriving(rng=np.random.default_rng(0)):
        for first in rng.permutation(-(-n // 256)) * 256:
            part = ids[first:first + 256]
            yield part, np.broadcast_to(part[:, None].astype(np.float32), (len(part), k)).copy()
    logits_table.write(ref, ids, arriving())
elif how == "lookup":  # what a worker's steps do
    table = logits_table.read(ref)
    for w in wanted:
        assert (table.rows_of(w)[:, 0] == w).all()
elif how == "mmap":  # np.load(mmap_mode="r") and fancy indexing: every page touched stays mapped
    ids_map, logits = np.load(ref.ids, mmap_mode="r"), np.load(ref.logits, mmap_mode="r")
    for w in wanted:
        assert (logits[np.searchsorted(ids_map, w)][:, 0] == w).all()
else:  # "whole": the former table, held by the driver and every worker
    logits = np.load(ref.logits)
print(json.dumps({"grew_mb": (peak() - before) / 2**20}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--batches", type=int, default=1000)
    args = ap.parse_args()
    size_mb = args.rows * args.classes * 4 / 2**20
    print(f"table: {args.rows:,} x {args.classes:,} float32 = {size_mb:,.0f} MiB on disk; "
          f"lookups: {args.batches} random batches of 256 ids")
    with tempfile.TemporaryDirectory(dir=".") as folder:
        for how in ("write", "lookup", "mmap", "whole"):
            proc = subprocess.run([sys.executable, "-c", CHILD, how, folder, str(args.rows), str(args.classes),
                                   str(args.batches)], capture_output=True, text=True, check=True)
            grew = json.loads(proc.stdout.strip().splitlines()[-1])["grew_mb"]
            print(f"{how:>7}: peak RSS grew {grew:7.1f} MiB ({grew / size_mb:.1%} of the table)")


if __name__ == "__main__":
    main()
