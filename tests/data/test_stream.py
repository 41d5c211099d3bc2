"""The streamed sequence, without Ray: small row groups, windows and tasks, so that an epoch
spans several windows and a window several tasks, as a large data set does."""

from __future__ import annotations

import numpy as np
import pytest

from imgtrain.data import format as fmt
from imgtrain.data import stream, writer
from imgtrain.data.order import rank_share
from imgtrain.data.raw import RawDataset, Split
from imgtrain.training.ingest import _loader

ROWS, BATCH = 203, 12  # 16 whole global batches (192 positions), 11 rows left out each epoch


@pytest.fixture
def data(tmp_path, monkeypatch):
    monkeypatch.setattr(writer, "ROW_GROUP_ROWS", 16)  # 13 row groups
    monkeypatch.setattr(stream, "TASK_ROWS", 5)  # several tasks per row group
    rng = np.random.default_rng(0)

    def split(n, first):
        return Split(rng.integers(0, 256, (n, 4, 4, 1), dtype=np.uint8), np.arange(n) % 3, np.arange(first, first + n))

    writer.write_dataset(RawDataset(["a", "b", "c"], split(ROWS, 0), split(40, ROWS)), tmp_path / "d", "d", "test")
    return tmp_path / "d"


def rows(data, world, rank, epoch=0, first_step=0, parts=stream.local_parts, per_window=4) -> list[int]:
    """The ids rank ``rank`` of ``world`` trains on in ``epoch`` from ``first_step``, in order."""
    manifest = fmt.load_manifest(data)
    reader = stream.Reader.for_data(data, manifest, seed=7, epoch=epoch, global_batch=BATCH, world=world, rank=rank,
                                    positions_end=(ROWS // BATCH) * BATCH, first_position=first_step * BATCH,
                                    augment=False)
    windows = stream.epoch_windows(stream.blocks(data, manifest, "train"), 7, epoch, per_window)
    assert len(windows) == 4  # 13 row groups, 4 per window
    windows = stream.windows_from(windows, reader.first_position)
    tasks = stream.train_tasks(windows, reader)
    ordered = stream.in_sequence(parts(tasks, reader, 2), windows, reader)
    assert len(tasks) > 2 * len(windows)
    return [int(i) for part in ordered for i in part["id"]]


def test_every_world_size_trains_every_row_once_in_the_same_global_batches(data):
    one = rows(data, 1, 0)
    assert len(one) == len(set(one)) == 16 * BATCH and set(one) <= set(range(ROWS))
    steps = [one[k * BATCH:(k + 1) * BATCH] for k in range(16)]
    for world in (2, 3, 5):
        mine = [rows(data, world, r) for r in range(world)]
        for k, batch in enumerate(steps):
            shares = [rank_share(BATCH, world, r) for r in range(world)]
            sizes = [s.stop - s.start for s in shares]
            got = [i for r in range(world) for i in mine[r][k * sizes[r]:(k + 1) * sizes[r]]]
            assert got == batch, (world, k)
    assert rows(data, 1, 0, epoch=1) != one  # another order each epoch


def test_a_resumed_epoch_starts_at_its_step_and_reads_no_earlier_window(data):
    whole = rows(data, 2, 1)
    share = rank_share(BATCH, 2, 1)
    assert rows(data, 2, 1, first_step=9) == whole[9 * (share.stop - share.start):]


def test_the_torch_dataloader_and_the_local_reader_agree(data):
    assert rows(data, 2, 0, epoch=1, parts=_loader) == rows(data, 2, 0, epoch=1)


def test_window_size_follows_the_decoded_image_size():
    assert stream.window_blocks({"image_shape": [28, 28, 1]}) == stream.WINDOW_BLOCKS
    assert stream.window_blocks({"image_shape": [224, 224, 3]}) == 1  # 150 KB decoded each: 1,024 per window
    assert 1 < stream.window_blocks({"image_shape": [96, 96, 3]}) < stream.WINDOW_BLOCKS


def test_parts_split_or_merged_in_transit_still_come_out_in_order(data):
    def regrouped(tasks, reader, cpus):  # as Ray Data might: blocks cut in two, neighbours joined
        pieces = []
        for part in stream.local_parts(tasks, reader):
            half = len(part["id"]) // 2
            pieces += [{k: v[:half] for k, v in part.items()}, {k: v[half:] for k, v in part.items()}]
        for i in range(0, len(pieces), 3):
            group = pieces[i:i + 3]
            yield {k: np.concatenate([p[k] for p in group]) for k in group[0]}

    assert rows(data, 2, 1, parts=regrouped) == rows(data, 2, 1)


def test_calibration_rows_are_the_splits_first_rows_each_once_shared_by_every_rank():
    blocks = [("a.parquet", 0, 300), ("a.parquet", 1, 300), ("b.parquet", 0, 1000)]

    def rows(tasks):
        return {(t["file"], t["group"], t["first"] + k) for t in tasks for k in range(t["count"])}

    shares = [stream.eval_tasks(blocks, 2, rank, limit=1024) for rank in (0, 1)]
    first = rows(stream.eval_tasks(blocks, 1, 0, limit=100_000))
    assert len(first) == 1600  # a limit past the split: all of it
    ordered = sorted(first, key=lambda r: ([b[:2] for b in blocks].index(r[:2]), r[2]))
    assert rows(shares[0]) | rows(shares[1]) == set(ordered[:1024])  # the first 1,024 rows in file order
    assert not rows(shares[0]) & rows(shares[1]) and all(shares)  # each once, every rank some


def test_a_sample_of_a_split_written_class_by_class_holds_every_class(tmp_path, monkeypatch):
    # A folder source writes its classes one after the other: the first 30 rows would all be "a".
    monkeypatch.setattr(writer, "ROW_GROUP_ROWS", 16)
    n = 3 * 48
    images = np.zeros((n, 4, 4, 1), np.uint8)
    train = Split(images, np.repeat(np.arange(3), 48), np.arange(n))
    writer.write_dataset(RawDataset(["a", "b", "c"], train, Split(images[:3], np.arange(3), np.arange(n, n + 3))),
                         tmp_path / "d", "d", "test")
    manifest = fmt.load_manifest(tmp_path / "d")
    sample = list(stream.split_sample(tmp_path / "d", manifest, "train", "digits", 7, 30))
    ids = np.concatenate([b["id"] for b in sample])
    labels = np.concatenate([b["label"] for b in sample])
    assert len(ids) == len(set(ids.tolist())) == 27  # 9 row groups, 3 rows of each: about the 30 asked for
    assert np.bincount(labels).tolist() == [9, 9, 9]
    assert sum(len(b["id"]) for b in stream.split_sample(tmp_path / "d", manifest, "train", "digits", 7, 10**6)) == n
