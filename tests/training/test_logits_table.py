"""The cached teacher logits' table (training/logits_table.py): written in a batch's memory, looked up
by row id in a batch's memory, two writers at once both leaving it whole, the same rows at any world
size. Real files and processes; no Ray, no model."""

from __future__ import annotations

import json
import multiprocessing as mp
import subprocess
import sys

import numpy as np
import pytest

from imgtrain.training import logits_table  # only this: each spawned writer imports this module again

K = 10


def _ids(n: int) -> np.ndarray:
    """A training split's ids: sorted, with gaps (the other splits' rows)."""
    return np.arange(n, dtype=np.int64) * 3 + 7


def _logits_of(ids: np.ndarray, k: int = K) -> np.ndarray:
    return (ids[:, None] * 1000 + np.arange(k)).astype(np.float32)


def _batches(ids: np.ndarray, size: int, seed: int, k: int = K, barrier=None):
    """The teacher's pass as it arrives: shuffled batches of (ids, logits)."""
    order = np.random.default_rng(seed).permutation(len(ids))
    for i in range(0, len(ids), size):
        if i == size and barrier is not None:
            barrier.wait()  # both writers are half way through their own copies
        part = ids[order[i:i + size]]
        yield part, _logits_of(part, k)


def _ref(folder, n: int, k: int = K) -> logits_table.Ref:
    return logits_table.Ref(str(folder / "key.ids.npy"), str(folder / "key.logits.npy"), n, k)


def _write_meeting_the_other(ref_dict: dict, seed: int, barrier) -> None:
    ref = logits_table.Ref(**ref_dict)
    logits_table.write(ref, _ids(ref.rows), _batches(_ids(ref.rows), 50, seed, barrier=barrier))


def test_two_runs_writing_the_same_table_at_once_both_leave_it_whole(tmp_path):
    ref = _ref(tmp_path, 1000)
    context = mp.get_context("spawn")
    barrier = context.Barrier(2, timeout=60)
    writers = [context.Process(target=_write_meeting_the_other, args=(ref.to_dict(), seed, barrier)) for seed in (0, 1)]
    for w in writers:
        w.start()
    for w in writers:
        w.join(60)
    assert [w.exitcode for w in writers] == [0, 0]
    assert np.array_equal(np.load(ref.ids, allow_pickle=False), _ids(1000))
    assert np.array_equal(np.load(ref.logits, allow_pickle=False), _logits_of(_ids(1000)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["key.ids.npy", "key.logits.npy"]  # no temporary left


def test_rows_are_looked_up_by_id_in_any_order_and_a_missing_or_cut_table_is_not_read(tmp_path):
    ids = _ids(500)
    ref = _ref(tmp_path, 500)
    logits_table.write(ref, ids, _batches(ids, 64, seed=2))
    table = logits_table.read(ref)
    wanted = np.random.default_rng(3).choice(ids, 300)  # repeats, neighbours and gaps
    assert np.array_equal(table.rows_of(wanted), _logits_of(wanted))
    with pytest.raises(ValueError, match=r"no row for one of the ids \[7, 8\]"):
        table.rows_of(np.array([7, 8]))
    table.close()
    with open(ref.logits, "r+b") as f:
        f.truncate(len(f.read()) - 4)
    assert logits_table.read(ref) is None
    assert logits_table.read(_ref(tmp_path, 501)) is None  # another data set's shape


def test_a_pass_missing_a_row_or_returning_one_twice_or_a_foreign_one_publishes_nothing(tmp_path):
    from imgtrain.errors import ImgtrainError

    ids = _ids(100)
    ref = _ref(tmp_path, 100)
    with pytest.raises(ImgtrainError, match="99 of the training split's 100 images"):
        logits_table.write(ref, ids, [(ids[:99], _logits_of(ids[:99]))])
    with pytest.raises(ImgtrainError, match="a row the training split does not have"):
        logits_table.write(ref, ids, [(ids[:1] + 1, _logits_of(ids[:1]))])
    with pytest.raises(ImgtrainError, match="twice"):
        logits_table.write(ref, ids, [(ids, _logits_of(ids)), (ids[:1], _logits_of(ids[:1]))])
    assert not list(tmp_path.iterdir())


def test_every_world_size_reads_the_same_teacher_logits_for_a_steps_rows(tmp_path):
    """A step's rows cut among 1, 2 or 3 ranks (as a resume at another world size cuts them): each
    rank's Signal reads its own rows' logits, and together they are the whole step's."""
    import torch

    from imgtrain.config import TrainConfig
    from imgtrain.training import distill

    ids = _ids(300)
    ref = _ref(tmp_path, 300)
    logits_table.write(ref, ids, _batches(ids, 64, seed=4))
    cfg = TrainConfig(distill_mode="cached")
    manifest = {"normalize": {"mean": [0.5], "std": [0.5]}}
    step = torch.from_numpy(np.random.default_rng(5).permutation(ids)[:96])
    seen = []
    for world in (1, 2, 3):
        ranks = [distill.Signal(cfg, manifest, "cpu", ref.to_dict()) for _ in range(world)]
        parts = [ranks[r].logits({"id": step[r::world]}, None) for r in range(world)]
        whole = torch.empty(len(step), K)
        for r in range(world):
            whole[r::world] = parts[r]
        seen.append(whole)
    assert all(torch.equal(s, torch.from_numpy(_logits_of(step.numpy()))) for s in seen)


MEMORY_CHILD = r"""
import json, sys
import numpy as np
from imgtrain.training import logits_table

def peak():  # VmHWM, this program's own peak (ru_maxrss would start at its parent's)
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")) << 10

folder, n, k = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ref = logits_table.Ref(folder + "/t.ids.npy", folder + "/t.logits.npy", n, k)
ids = np.arange(n, dtype=np.int64)
def batches(rng=np.random.default_rng(0)):
    for first in rng.permutation(-(-n // 256)) * 256:
        part = ids[first:first + 256]
        yield part, np.broadcast_to(part[:, None].astype(np.float32), (len(part), k))
before = peak()
logits_table.write(ref, ids, batches())
written = peak()
table = logits_table.read(ref)
rng = np.random.default_rng(1)
for _ in range(200):
    wanted = rng.choice(ids, 256)
    assert (table.rows_of(wanted)[:, -1] == wanted).all()
print(json.dumps({"before": before, "written": written, "looked_up": peak()}))
"""


def test_the_table_is_written_and_read_in_a_batchs_memory_not_the_tables(tmp_path):
    """A 40,000 x 1,000 table (160 MB): the writer's and the reader's peak RSS grow by far less."""
    proc = subprocess.run([sys.executable, "-c", MEMORY_CHILD, str(tmp_path), "40000", "1000"], capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    peaks = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (tmp_path / "t.logits.npy").stat().st_size > 160_000_000
    assert peaks["written"] - peaks["before"] < 24 << 20, peaks
    assert peaks["looked_up"] - peaks["before"] < 24 << 20, peaks


def test_a_table_beside_a_data_set_in_an_object_store_is_fetched_once_by_each_node(s3_server, monkeypatch, tmp_path):
    """Uploaded beside the data set by the driver; a worker on another node (a cache of its own)
    fetches its copy once and reads the same rows; a table deleted from the bucket is said in one line."""
    import uuid

    from imgtrain.errors import ImgtrainError

    for name, value in s3_server.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("IMGTRAIN_CACHE", str(tmp_path / "driver"))
    ids = _ids(200)
    driver = _ref(tmp_path / "driver" / "teacher-logits", 200)
    logits_table.write(driver, ids, _batches(ids, 64, seed=6))
    beside = f"s3://imgtrain/{uuid.uuid4().hex[:8]}/data/.teacher-logits"
    published = logits_table.publish(driver, beside)
    assert published.uri == beside and logits_table.publish(driver, beside) == published  # once

    monkeypatch.setenv("IMGTRAIN_CACHE", str(tmp_path / "node2"))
    table = logits_table.fetch(logits_table.Ref(**published.to_dict()))
    copy = tmp_path / "node2" / "teacher-logits" / "key.logits.npy"
    assert table.ref.logits == str(copy) and np.array_equal(table.rows_of(ids[::7]), _logits_of(ids[::7]))
    stamp = copy.stat().st_mtime_ns
    logits_table.fetch(published).close()
    assert copy.stat().st_mtime_ns == stamp  # the node's copy, not fetched again

    from imgtrain.ops import remote

    fs, root = remote.split(beside)
    fs.delete_file(f"{root}/key.logits.npy")
    monkeypatch.setenv("IMGTRAIN_CACHE", str(tmp_path / "node3"))
    with pytest.raises(ImgtrainError, match=f"{beside}/key.logits.npy is missing"):
        logits_table.fetch(published)
