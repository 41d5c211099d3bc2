"""A prepared data set of any size, streamed: each rank's share of every global batch, decoded
and augmented by Ray Data tasks on CPUs (on any node), never the whole split in one process.

The order of an epoch is a pure function of (seed, epoch), whatever the world size:

* the split's row groups (up to 1,024 rows each, listed in the manifest) in a seeded order,
  cut into windows of WINDOW_BLOCKS row groups;
* the rows of each window in a seeded order. The epoch's sequence is the windows' rows one
  after the other; global step k trains on positions [k*B, (k+1)*B), cut between the ranks by
  ``per_worker_batch_sizes`` (``order.rank_share``) as the in-memory path cuts its permutation.

A run resumed after step S starts at position S*B: it reads the one window that position falls
in (dropping the rows before it) and then the following windows, never the part of the epoch
already trained, and every rank finds its rows of every later global batch exactly where an
uninterrupted run (of any world size) had them. The random numbers of the augmentation are
drawn per global step for the whole global batch (``order.augment_draw``, ``photo_draw``), so a
sample gets the same crop at the same step whoever decodes it.

Validation and evaluation read the split's row groups in file order, rank r taking every
world-th row group: each row once, none dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from imgtrain.data import format as fmt
from imgtrain.data import images

IN_MEMORY_MAX_BYTES = 256 << 20  # decoded images of the training split; above this, stream
WINDOW_BLOCKS = 16  # row groups whose rows are shuffled together (about 16k rows)
PREFETCH_BYTES = 64 << 20  # decoded output a rank's pipeline may hold ahead of training


def preset(cfg, manifest: dict) -> str:
    """The augmentation preset a run uses: its own setting, or the data set's."""
    return manifest["preset"] if cfg.preset == "auto" else cfg.preset


def in_memory(cfg, manifest: dict) -> bool:
    """Whether a run takes the in-memory path: tensor storage, small enough, and the digits'
    augmentation (which runs on whole batches in the training step)."""
    h, w, c = manifest["image_shape"]
    small = manifest["splits"]["train"]["num_samples"] * h * w * c <= IN_MEMORY_MAX_BYTES
    return manifest["storage"] == "tensor" and small and preset(cfg, manifest) == "digits"


@dataclass(frozen=True)
class Reader:
    """How one rank's tasks turn stored rows into model-sized uint8 images (plain fields:
    it travels to Ray Data's tasks)."""

    data_dir: str
    storage: str  # "tensor" or "encoded"
    preset: str  # "digits" or "photos"
    shape: tuple[int, int, int]  # the model's (H, W, C)
    seed: int = 0
    epoch: int = 0
    global_batch: int = 1
    positions_end: int = 0  # the epoch's last trained position + 1 (whole global batches)
    first_position: int = 0  # resumed inside the epoch: positions before this are skipped
    world: int = 1
    rank: int = 0
    train: bool = True  # training order and augmentation; False: every row, evaluation transform
    augment: bool = True
    max_rotate_deg: float = 10.0  # the digits' affine
    max_shift: float = 0.1
    max_scale: float = 0.1

    @staticmethod
    def for_data(data_dir, manifest: dict, **fields) -> "Reader":
        h, w, c = manifest["image_shape"]
        return Reader(str(data_dir), manifest["storage"], fields.pop("preset", None) or manifest["preset"],
                      (h, w, c), **fields)


# ---------------------------------------------------------------- the plan of an epoch


def blocks(data_dir, manifest: dict, split: str) -> list[tuple[str, int, int]]:
    """(file, row group, rows) of a split, in file order."""
    return [(str(f), g, rows) for f, g, rows in fmt.row_groups(Path(data_dir), manifest, split)]


def epoch_windows(split_blocks: list, seed: int, epoch: int) -> list[dict]:
    """The epoch's windows in order: {"window", "start" (position of its first row), "blocks"}."""
    order = np.random.default_rng([seed, epoch, 0x5EED]).permutation(len(split_blocks))
    windows, start = [], 0
    for w, first in enumerate(range(0, len(order), WINDOW_BLOCKS)):
        chosen = [split_blocks[i] for i in order[first:first + WINDOW_BLOCKS]]
        windows.append({"window": w, "start": start, "blocks": [[f, g] for f, g, _ in chosen]})
        start += sum(rows for _, _, rows in chosen)
    return windows


def windows_from(windows: list[dict], position: int) -> list[dict]:
    """The windows holding ``position`` and those after it (a resumed epoch reads no others)."""
    starts = [w["start"] for w in windows]
    first = max(0, int(np.searchsorted(starts, position, side="right")) - 1)
    return windows[first:]


def eval_tasks(split_blocks: list, world: int, rank: int) -> list[dict]:
    """Rank ``rank``'s row groups for validation: every world-th one, in file order."""
    return [{"window": i, "start": 0, "blocks": [[f, g]]} for i, (f, g, _) in enumerate(split_blocks)
            if i % world == rank]


# ---------------------------------------------------------------- one task: a window's rows


def read_window(batch: dict, reader: Reader) -> dict:
    """Ray Data ``map_batches`` function (batch_size=1): the rows of one window this rank
    trains on (or evaluates), in sequence order, as {id int64 [k], image uint8 [k, H, W, C],
    label int64 [k]}."""
    import pyarrow as pa

    task = json.loads(batch["task"][0]) if isinstance(batch["task"][0], str) else batch["task"][0]
    table = pa.concat_tables(fmt.read_row_group(Path(f), g, reader.storage) for f, g in task["blocks"])
    n = table.num_rows
    if reader.train:
        order = np.random.default_rng([reader.seed, reader.epoch, task["window"], 0xB10C]).permutation(n)
        positions = task["start"] + np.arange(n)
        keep = _mine(positions, reader)
        rows, positions = order[keep], positions[keep]
    else:
        rows, positions = np.arange(n), None
    ids = table.column("id").to_numpy()[rows]
    labels = table.column("label").to_numpy()[rows]
    return {"id": ids, "image": _pixels(table, rows, positions, reader), "label": labels}


def _mine(positions: np.ndarray, reader: Reader) -> np.ndarray:
    """Which positions this rank trains on: inside the epoch's whole global batches, not before
    a resume point, and in this rank's share of their global batch."""
    from imgtrain.data.order import rank_share

    share = rank_share(reader.global_batch, reader.world, reader.rank)
    offset = positions % reader.global_batch
    return ((positions >= reader.first_position) & (positions < reader.positions_end)
            & (offset >= share.start) & (offset < share.stop))


def _pixels(table, rows: np.ndarray, positions: np.ndarray | None, reader: Reader) -> np.ndarray:
    """uint8 [k, H, W, C] at the model's size, augmented when training."""
    h, w, c = reader.shape
    draws = _draws(positions, reader) if positions is not None and reader.augment else None
    if reader.storage == "tensor":
        from imgtrain.data.tables import tensor_column_to_numpy

        pixels = tensor_column_to_numpy(table.column("image"), table.schema.field("image"))[rows]
        if reader.preset == "photos":  # photos kept as tensors: the same crops as encoded ones
            pixels = np.stack([images.transform_array(p, reader.shape, None if draws is None else draws[k])
                               for k, p in enumerate(pixels)]) if len(pixels) else pixels.reshape(0, h, w, c)
    else:
        import pyarrow as pa

        encoded = table.column("image").take(pa.array(rows, pa.int64())).to_pylist()
        pixels = np.empty((len(rows), h, w, c), np.uint8)
        photo_draws = draws if reader.preset == "photos" else None
        for k, data in enumerate(encoded):
            draw = photo_draws[k] if photo_draws is not None else None
            pixels[k] = images.decode_for_training(data, reader.shape, reader.preset, draw)
    if draws is not None and reader.preset == "digits":
        pixels = _affine(pixels, draws, reader)
    return pixels


def _draws(positions: np.ndarray, reader: Reader) -> np.ndarray:
    """The augmentation's random numbers of each position: row (position % B) of its global
    step's draw, the same whoever reads it."""
    from imgtrain.data.order import augment_draw, photo_draw

    steps, within = positions // reader.global_batch, positions % reader.global_batch
    out = None
    for step in np.unique(steps):
        if reader.preset == "photos":
            draw = photo_draw(reader.seed, int(step), reader.global_batch)
        else:
            draw = augment_draw(reader.seed, int(step), reader.global_batch, 1, 0).numpy()
        if out is None:
            out = np.empty((len(positions), draw.shape[1]), draw.dtype)
        mask = steps == step
        out[mask] = draw[within[mask]]
    return out if out is not None else np.empty((0, 5))


def _affine(pixels: np.ndarray, draws: np.ndarray, reader: Reader) -> np.ndarray:
    """The digits' random affine (``model.random_affine``), on uint8 images."""
    import torch

    from imgtrain.model import random_affine

    x = torch.from_numpy(pixels).permute(0, 3, 1, 2).float().div_(127.5).sub_(1)  # [-1, 1], background -1
    x = random_affine(x, torch.from_numpy(draws), reader.max_rotate_deg, reader.max_shift, reader.max_scale)
    out = x.add_(1).mul_(127.5).round_().clamp_(0, 255).to(torch.uint8)
    return out.permute(0, 2, 3, 1).contiguous().numpy()


# ---------------------------------------------------------------- running the tasks


def ray_batches(tasks: list[dict], reader: Reader, batch_size: int, cpus: int, device, dtypes) -> Iterator[dict]:
    """The tasks' rows through Ray Data (``cpus`` tasks at a time, order kept, a bounded amount
    decoded ahead), as torch batches of ``batch_size`` rows on ``device``."""
    import ray.data
    from ray.data import ExecutionResources, TaskPoolStrategy

    if not tasks:
        return
    ds = ray.data.from_items([{"task": json.dumps(t)} for t in tasks], override_num_blocks=len(tasks))
    ds = ds.map_batches(read_window, fn_kwargs={"reader": reader}, batch_size=1, num_cpus=1,
                        compute=TaskPoolStrategy(size=max(1, cpus)))
    options = ds.context.execution_options  # this dataset's own context
    options.preserve_order = True  # the sequence is the order: never the order tasks finish in
    options.resource_limits = ExecutionResources(object_store_memory=PREFETCH_BYTES)
    ds.context.enable_progress_bars = False
    yield from ds.iter_torch_batches(batch_size=batch_size, dtypes=dtypes, device=device, prefetch_batches=2,
                                     drop_last=False)


def local_batches(tasks: list[dict], reader: Reader, batch_size: int) -> Iterator[dict]:
    """The same rows without Ray (``--backend local``, evaluate/predict locally): numpy batches."""
    pending: list[dict] = []
    held = 0
    for task in tasks:
        part = read_window({"task": [task]}, reader)
        if len(part["id"]):
            pending.append(part)
            held += len(part["id"])
        while held >= batch_size:
            batch, pending, held = _cut(pending, batch_size)
            yield batch
    if held:
        yield _cut(pending, held)[0]


def _cut(parts: list[dict], n: int) -> tuple[dict, list[dict], int]:
    joined = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    head = {k: v[:n] for k, v in joined.items()}
    rest = {k: v[n:] for k, v in joined.items()}
    left = len(rest["id"])
    return head, ([rest] if left else []), left


def fetch_images(data_dir, split: str, ids: set, preset: str | None = None) -> dict:
    """{id: uint8 [H, W, C]} of a few rows of a split, as evaluation sees them: the id column
    of each row group is read first, and only the row groups holding a wanted id are decoded."""
    manifest = fmt.load_manifest(data_dir)
    reader = Reader.for_data(data_dir, manifest, preset=preset, train=False, augment=False)
    found = {}
    for f, g, _ in blocks(data_dir, manifest, split):
        if len(found) == len(ids):
            break
        import pyarrow.parquet as pq

        present = set(pq.ParquetFile(f).read_row_group(g, columns=["id"]).column("id").to_pylist()) & ids
        if present:
            rows = read_window({"task": [json.dumps({"window": 0, "start": 0, "blocks": [[f, g]]})]}, reader)
            found.update({int(i): img for i, img in zip(rows["id"], rows["image"]) if int(i) in present})
    return found
