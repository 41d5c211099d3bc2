"""A prepared data set of any size, streamed: each rank's share of every global batch, decoded
and augmented by Ray tasks on CPUs (on any node), never the whole split in one process.

The order of an epoch is a pure function of (seed, epoch), whatever the world size:

* the split's row groups (up to 1,024 rows each, listed in the manifest) in a seeded order,
  cut into windows of up to WINDOW_BLOCKS row groups (fewer for large images: ``window_blocks``);
* the rows of each window in a seeded order. The epoch's sequence is the windows' rows one
  after the other; global step k trains on positions [k*B, (k+1)*B), cut between the ranks by
  ``per_worker_batch_sizes`` (``config.rank_share``) as the in-memory path cuts its permutation.

With ``--sampling balanced`` each window's positions read rows drawn with replacement from
that window, weighted against their class's frequency (``balanced_draw``): still a function of
(seed, epoch), so all of the above holds.

A rank decodes only its own rows, in tasks of at most TASK_ROWS rows of one row group (so the
CPUs share a window); ``in_sequence`` puts each window's decoded rows back in sequence order,
holding one window's share at a time.

A run resumed after step S starts at position S*B: it reads the one window that position falls
in (dropping the rows before it) and then the following windows, never the part of the epoch
already trained, and every rank finds its rows of every later global batch exactly where an
uninterrupted run (of any world size) had them. The random numbers of the augmentation are
drawn per global step for the whole global batch (``order.augment_draw``, ``images.photo_draw``), so a
sample gets the same crop at the same step whoever decodes it.

With ``--decode gpu`` the tasks send encoded photos' JPEG bytes and random numbers instead of
pixels, and the rank makes the pixels on its GPU (``data/device_photos.py``) from the same draws.

Validation and evaluation read the split's row groups in file order, rank r taking every
world-th row group: each row once, none dropped.
"""

from __future__ import annotations

import functools
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from imgtrain.config import rank_share
from imgtrain.data import format as fmt
from imgtrain.data import images
from imgtrain.data.photo_augment import PhotoAugment
from imgtrain.data.format import ROW_GROUP_ROWS
from imgtrain.errors import ImgtrainError

IN_MEMORY_MAX_BYTES = 256 << 20  # decoded images of the training split; above this, stream
WINDOW_BLOCKS = 16  # row groups whose rows are shuffled together (about 16k rows)...
WINDOW_BYTES = 256 << 20  # ...fewer for large images: at most this much decoded per window
# Rows one decoding task decodes: a window's decoding spreads over the CPUs. 1,024 measured
# 1.2x faster than 256 (fewer tasks to schedule; measured through Ray Data), bench/data_pipeline.py.
TASK_ROWS = 1024
# Decoded output a rank's pipeline may hold ahead of training (Ray's object store). 64 MB let
# only about two tasks' outputs (28 MB each at 96x96) wait and throttled the decoding:
# 0.91-1.04x torchvision's DataLoader, against 1.01-1.18x at 256 MB (bench/data_pipeline.py).
PREFETCH_BYTES = 256 << 20


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
    it travels to the decoding tasks)."""

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
    max_rotate_deg: float = 15.0  # the digits' affine (TrainConfig's defaults)
    max_shift: float = 0.1
    max_scale: float = 0.15
    crop_min_area: float = images.CROP_MIN_AREA  # the photos' random resized crop
    photo_augment: PhotoAugment = PhotoAugment()  # the photos' policy, jitter and erasing after it
    # --sampling balanced: each class's weight (1 / its training rows, 0 if it has none); empty: shuffle
    class_weights: tuple[float, ...] = ()
    # a multi-label data set's number of classes: labels are handed out uint8 multi-hot [k, K]; 0: single-label
    multi_label_classes: int = 0
    # "gpu": encoded photos reach the rank as JPEG bytes and random numbers, decoded on its device
    # (data/device_photos.py); "cpu": as pixels (--decode, resolved by the rank)
    decode: str = "cpu"

    @property
    def on_device(self) -> bool:
        """Whether the rank decodes this reader's rows itself (encoded photos, --decode gpu)."""
        return self.decode == "gpu" and self.preset == "photos" and self.storage == "encoded"

    @staticmethod
    def for_data(data_dir, manifest: dict, **fields) -> "Reader":
        h, w, c = manifest["image_shape"]
        fields.setdefault("multi_label_classes", manifest["num_classes"] if fmt.is_multi_label(manifest) else 0)
        return Reader(str(data_dir), manifest["storage"], fields.pop("preset", None) or manifest["preset"],
                      (h, w, c), **fields)


# ---------------------------------------------------------------- the plan of an epoch


def blocks(data_dir, manifest: dict, split: str) -> list[tuple[str, int, int]]:
    """(file, row group, rows) of a split, in file order."""
    return [(str(f), g, rows) for f, g, rows in fmt.row_groups(Path(data_dir), manifest, split)]


def window_blocks(manifest: dict) -> int:
    """Row groups per window: WINDOW_BLOCKS, fewer for large images (a rank holds its share of a
    decoded window while putting it in order). A property of the data set, not of the run."""
    h, w, c = manifest["image_shape"]
    return int(np.clip(WINDOW_BYTES // (ROW_GROUP_ROWS * h * w * c), 1, WINDOW_BLOCKS))


def epoch_windows(split_blocks: list, seed: int, epoch: int, per_window: int) -> list[dict]:
    """The epoch's windows in order: {"window", "start" (position of its first row), "blocks"}."""
    order = np.random.default_rng([seed, epoch, 0x5EED]).permutation(len(split_blocks))
    windows, start = [], 0
    for w, first in enumerate(range(0, len(order), per_window)):
        chosen = [list(split_blocks[i]) for i in order[first:first + per_window]]
        windows.append({"window": w, "start": start, "blocks": chosen})
        start += sum(rows for _, _, rows in chosen)
    return windows


def windows_from(windows: list[dict], position: int) -> list[dict]:
    """The windows holding ``position`` and those after it (a resumed epoch reads no others)."""
    starts = [w["start"] for w in windows]
    first = max(0, int(np.searchsorted(starts, position, side="right")) - 1)
    return windows[first:]


def _window_positions(window: dict, reader: Reader) -> tuple[np.ndarray, np.ndarray]:
    """(position of each row of the window, in block order; which of them this rank trains on).
    The window's rows in a seeded order are its stretch of the epoch's sequence."""
    n = sum(rows for _, _, rows in window["blocks"])
    order = np.random.default_rng([reader.seed, reader.epoch, window["window"], 0xB10C]).permutation(n)
    position = np.empty(n, np.int64)
    position[order] = window["start"] + np.arange(n)
    return position, _mine(position, reader)


def train_tasks(windows: list[dict], reader: Reader) -> list[dict]:
    """The decoding tasks of this rank's rows, window by window: at most TASK_ROWS rows of one
    row group each, so that the CPUs share a window's decoding. A task names its window, block
    and which of this rank's rows there it decodes, and finds those rows itself (a task's
    description stays small at any scale)."""
    if reader.class_weights:
        if reader.multi_label_classes:  # a row has several classes: no one weight to draw it by
            raise ImgtrainError("balanced sampling has no meaning for a multi-label data set (an image has "
                                    "several classes); train with --sampling shuffle")
        return [task for window in windows for task in _balanced_tasks(window, reader)]
    tasks = []
    for window in windows:
        _, mine = _window_positions(window, reader)
        offset = 0
        for b, (_, _, rows) in enumerate(window["blocks"]):
            count = int(mine[offset:offset + rows].sum())
            tasks += [{**window, "block": b, "first": a, "count": min(TASK_ROWS, count - a)}
                      for a in range(0, count, TASK_ROWS)]
            offset += rows
    return tasks


def balanced_draw(window: dict, labels: np.ndarray, reader: Reader) -> np.ndarray:
    """--sampling balanced: the row (of the window, in block order) each of its positions
    reads, in position order. As many draws as the window has rows, with replacement, a row of
    class c weighing 1 / (training rows of c): the in-memory rule, applied window by window
    (prepared files are in a seeded random order, so a window holds every class in its share
    and an epoch comes out balanced). A function of (seed, epoch, window) and the labels."""
    weights = np.asarray(reader.class_weights, np.float64)[labels]
    rng = np.random.default_rng([reader.seed, reader.epoch, window["window"], 0xBA1A])
    return rng.choice(len(labels), size=len(labels), p=weights / weights.sum())


def _balanced_tasks(window: dict, reader: Reader) -> list[dict]:
    """A balanced window's tasks: they name their rows (repeated when drawn twice) and positions
    outright, at most TASK_ROWS of one row group, since finding them needs the window's labels,
    which the rank reads (one column) and the tasks need not read again."""
    sizes = [rows for _, _, rows in window["blocks"]]
    labels = np.concatenate([fmt.read_labels(Path(f), g) for f, g, _ in window["blocks"]])
    drawn = balanced_draw(window, labels, reader)
    position = window["start"] + np.arange(len(drawn))
    mine = _mine(position, reader)
    drawn, position = drawn[mine], position[mine]
    starts = np.cumsum([0] + sizes)
    block = np.searchsorted(starts, drawn, side="right") - 1
    tasks = []
    for b, (f, g, _) in enumerate(window["blocks"]):
        rows, at = drawn[block == b] - starts[b], position[block == b]
        tasks += [{"file": f, "group": g, "rows": rows[a:a + TASK_ROWS].tolist(),
                   "positions": at[a:a + TASK_ROWS].tolist()} for a in range(0, len(rows), TASK_ROWS)]
    return tasks


def eval_tasks(split_blocks: list, world: int, rank: int, limit: int = 0) -> list[dict]:
    """Rank ``rank``'s rows for validation: every world-th row group, in file order, in parts.
    ``limit``: only the split's first ``limit`` rows, every world-th part of them."""
    if not limit:
        return [{"file": f, "group": g, "first": a, "count": min(TASK_ROWS, rows - a)}
                for i, (f, g, rows) in enumerate(split_blocks) if i % world == rank for a in range(0, rows, TASK_ROWS)]
    size = min(TASK_ROWS, -(-limit // world))  # parts small enough that every rank gets some
    parts = []
    for f, g, rows in split_blocks:
        for a in range(0, rows, size):
            if limit <= 0:
                return parts[rank::world]
            parts.append({"file": f, "group": g, "first": a, "count": min(size, rows - a, limit)})
            limit -= parts[-1]["count"]
    return parts[rank::world]


# ---------------------------------------------------------------- one task: some rows of a row group


def read_task(task: dict, reader: Reader) -> dict:
    """The rows of one task as {id int64 [k], image uint8 [k, H, W, C], label int64 [k] (multi-label:
    uint8 multi-hot [k, num_classes])} and, for training, "position" int64 [k] (where each row
    goes in the sequence)."""
    if "window" in task:
        position, mine = _window_positions(task, reader)
        offset = sum(rows for _, _, rows in task["blocks"][:task["block"]])
        f, g, size = task["blocks"][task["block"]]
        local = np.flatnonzero(mine[offset:offset + size])[task["first"]:task["first"] + task["count"]]
        positions = position[offset + local]
    else:
        f, g = task["file"], task["group"]
        positions = np.asarray(task["positions"], np.int64) if "positions" in task else None  # balanced training
        local = np.asarray(task["rows"], np.int64) if "rows" in task else np.arange(task["first"], task["first"] + task["count"])
    k = reader.multi_label_classes
    table = fmt.read_row_group(Path(f), g, reader.storage, multi_label=bool(k))
    labels = fmt.multi_hot(table.column("labels"), k) if k else table.column("label").to_numpy()
    out = {"id": table.column("id").to_numpy()[local], "label": labels[local]}
    if reader.on_device:
        out.update(_sources(table, local, positions, reader))
    else:
        out["image"] = _pixels(table, local, positions, reader)
    if positions is not None:
        out["position"] = positions
    return out


def _mine(positions: np.ndarray, reader: Reader) -> np.ndarray:
    """Which positions this rank trains on: inside the epoch's whole global batches, not before
    a resume point, and in this rank's share of their global batch."""
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
            pixels = np.stack([images.transform_array(p, reader.shape, None if draws is None else draws[k],
                                                         reader.crop_min_area)
                               for k, p in enumerate(pixels)]) if len(pixels) else pixels.reshape(0, h, w, c)
    else:
        import pyarrow as pa

        encoded = table.column("image").take(pa.array(rows, pa.int64())).to_pylist()
        pixels = np.empty((len(rows), h, w, c), np.uint8)
        photo_draws = draws if reader.preset == "photos" else None
        for k, data in enumerate(encoded):
            draw = photo_draws[k] if photo_draws is not None else None
            pixels[k] = images.decode_for_training(data, reader.shape, reader.preset, draw, reader.crop_min_area)
    if draws is not None and reader.preset == "digits":
        pixels = _affine(pixels, draws, reader)
    if draws is not None and reader.preset == "photos" and reader.photo_augment.active:
        from imgtrain.data import photo_augment

        for k, seed in enumerate(_per_position(positions, reader, photo_augment.image_seeds)):
            pixels[k] = photo_augment.apply(reader.photo_augment, pixels[k], seed)
    return pixels


def _sources(table, rows: np.ndarray, positions: np.ndarray | None, reader: Reader) -> dict:
    """--decode gpu: what the rank's device needs to make the rows' pixels (``device_photos``):
    "source", each row's JPEG bytes, or uint8 [H, W, C] pixels made here by the CPU path for a
    row a plain JPEG decoder would not decode as Pillow does (PNG, EXIF, CMYK; for evaluation,
    a JPEG Pillow decodes at reduced scale); "draw", each row's crop and flip numbers
    (training); "seed", each row's policy seed (with a policy on). Object arrays travel
    through ``in_sequence`` and ``cut`` like the others."""
    import pyarrow as pa

    h, w, c = reader.shape
    draws = _draws(positions, reader) if positions is not None and reader.augment else None
    encoded = table.column("image").take(pa.array(rows, pa.int64())).to_pylist()
    sources = np.empty(len(rows), object)
    for k, data in enumerate(encoded):
        draw = None if draws is None else draws[k]
        size = images.plain_jpeg_size(data, c)
        if size is not None and (draw is not None or not images.eval_draft_shrinks(size, (h, w))):
            sources[k] = data
        else:
            sources[k] = images.decode_for_training(data, reader.shape, reader.preset, draw, reader.crop_min_area)
    out = {"source": sources}
    if draws is not None:
        out["draw"] = draws
        if reader.photo_augment.active:
            from imgtrain.data import photo_augment

            out["seed"] = _per_position(positions, reader, photo_augment.image_seeds)
    return out


def _per_position(positions: np.ndarray, reader: Reader, draw_step) -> np.ndarray:
    """``draw_step(seed, step, global batch)``'s row of each position's global step."""
    steps, within = positions // reader.global_batch, positions % reader.global_batch
    out = np.empty(len(positions), np.int64)
    for step in np.unique(steps):
        mask = steps == step
        out[mask] = draw_step(reader.seed, int(step), reader.global_batch)[within[mask]]
    return out


def _draws(positions: np.ndarray, reader: Reader) -> np.ndarray:
    """The augmentation's random numbers of each position: row (position % B) of its global
    step's draw, the same whoever reads it."""
    steps, within = positions // reader.global_batch, positions % reader.global_batch
    out = None
    for step in np.unique(steps):
        if reader.preset == "photos":
            draw = images.photo_draw(reader.seed, int(step), reader.global_batch)
        else:
            # torch, imported here only: the digits' affine needs it anyway
            from imgtrain.data.order import augment_draw

            draw = augment_draw(reader.seed, int(step), reader.global_batch, 1, 0).numpy()
        if out is None:
            out = np.empty((len(positions), draw.shape[1]), draw.dtype)
        mask = steps == step
        out[mask] = draw[within[mask]]
    return out if out is not None else np.empty((0, 5))


def _affine(pixels: np.ndarray, draws: np.ndarray, reader: Reader) -> np.ndarray:
    """The digits' random affine (``tensors.random_affine``), on uint8 images."""
    import torch

    from imgtrain.data.tensors import random_affine

    x = torch.from_numpy(pixels).permute(0, 3, 1, 2).float().div_(127.5).sub_(1)  # [-1, 1], background -1
    x = random_affine(x, torch.from_numpy(draws), reader.max_rotate_deg, reader.max_shift, reader.max_scale)
    out = x.add_(1).mul_(127.5).round_().clamp_(0, 255).to(torch.uint8)
    return out.permute(0, 2, 3, 1).contiguous().numpy()


# ---------------------------------------------------------------- running the tasks


def ray_parts(tasks: list[dict], reader: Reader, cpus: int) -> Iterator[dict]:
    """The tasks' outputs in task order, decoded by Ray tasks on any node's CPUs: at most
    ``cpus`` decoding at once, and what is decoded ahead of the consumer held to PREFETCH_BYTES
    in Ray's object store (outputs cross it without a copy to numpy).

    Ray tasks, not a Ray Data ``map_batches``: Ray Data 2.60's streaming executor ran these
    tasks one at a time whatever the pool's size (their spans never overlapped, with 2 CPUs
    here and with 15 on a GPU machine), half the rate of the same tasks two at a time
    (docs/NOTES.md, "Streamed decoding runs as Ray tasks")."""
    import ray

    if not tasks:
        return
    decode = _remote_read_task()
    reader_ref = ray.put(reader)  # once, not with every task
    h, w, c = reader.shape
    ahead = max(cpus, PREFETCH_BYTES // max(1, TASK_ROWS * h * w * c))  # outputs decoded or decoding
    pending: deque = deque()
    try:
        for task in tasks:
            pending.append(decode.remote(task, reader_ref))
            while len(pending) >= ahead or (len(pending) >= cpus and _decoding(pending) >= cpus):
                yield ray.get(pending.popleft())
        while pending:
            yield ray.get(pending.popleft())
    finally:  # the consumer stopped early (an error, a stop): no decoding left running for nothing
        for ref in pending:
            ray.cancel(ref)


@functools.cache
def _remote_read_task():
    """``read_task`` as a Ray remote function, made once: each new one is exported to the cluster again."""
    import ray

    return ray.remote(num_cpus=1)(read_task)


def _decoding(pending: deque) -> int:
    """How many of ``pending`` are still running (or waiting for a CPU)."""
    import ray

    done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0, fetch_local=False)
    return len(pending) - len(done)


def warm_decoders(count: int) -> None:
    """Start ``count`` Ray worker processes with the decoding modules imported, and do not wait:
    Ray keeps them and gives them the first epoch's tasks, which would otherwise wait for
    fresh processes and their imports (seconds, while the model is built anyway)."""
    import ray

    task = ray.remote(num_cpus=1)(_import_decoding)
    for _ in range(count):
        task.remote()


def _import_decoding() -> None:
    import PIL.Image  # noqa: F401
    import pyarrow.parquet  # noqa: F401


def local_parts(tasks: list[dict], reader: Reader, cpus: int = 1) -> Iterator[dict]:
    """The same outputs without Ray (``--backend local``, evaluate/predict locally)."""
    for task in tasks:
        yield read_task(task, reader)


def in_sequence(parts: Iterable[dict], windows: list[dict], reader: Reader) -> Iterator[dict]:
    """Training parts (in task order) put back in sequence order: each window's rows of this
    rank once all its parts are in, placed by position (one window's share held at a time).
    A part may hold rows of two windows (should a pipeline merge parts): they are split."""
    def wanted_rows():
        for window in windows:
            position, mine = _window_positions(window, reader)
            if mine.any():
                yield window["start"] + len(position), np.sort(position[mine])

    expected = wanted_rows()
    end, wanted = next(expected, (0, None))
    held, filled = None, 0
    for part in parts:
        while part is not None and len(part["id"]):
            inside = part["position"] < end
            if inside.all():  # the usual case: no copy
                here, part = part, None
            else:
                here, part = ({k: v[inside] for k, v in part.items()}, {k: v[~inside] for k, v in part.items()})
            at = np.searchsorted(wanted, here["position"])
            if held is None:  # every column but the position: pixels, or what --decode gpu sends instead
                held = {k: np.empty((len(wanted), *v.shape[1:]), v.dtype) for k, v in here.items() if k != "position"}
            for key, value in held.items():
                value[at] = here[key]
            filled += len(at)
            if filled == len(wanted):
                yield held
                held, filled = None, 0
                end, wanted = next(expected, (0, None))


def cut(parts: Iterable[dict], size: int) -> Iterator[dict]:
    """Parts of any length as batches of ``size`` rows (the last one shorter)."""
    pending, held = [], 0
    for part in parts:
        if not len(part["id"]):
            continue
        pending.append(part)
        held += len(part["id"])
        while held >= size:
            batch, pending, held = _cut(pending, size)
            yield batch
    if held:
        yield _cut(pending, held)[0]


def _cut(parts: list[dict], n: int) -> tuple[dict, list[dict], int]:
    joined = {k: np.concatenate([p[k] for p in parts]) if len(parts) > 1 else parts[0][k] for k in parts[0]}
    head = {k: v[:n] for k, v in joined.items()}
    rest = {k: v[n:] for k, v in joined.items()}
    left = len(rest["id"])
    return head, ([rest] if left else []), left


def split_batches(data_dir, manifest: dict, split: str, preset: str, size: int, limit: int = 0) -> Iterator[dict]:
    """A split's rows in file order (its first ``limit`` rows with a limit), as evaluation sees
    them, decoded in this process: batches {id, image uint8 [k, H, W, C], label} of ``size``."""
    reader = Reader.for_data(data_dir, manifest, preset=preset, train=False, augment=False)
    return cut(local_parts(eval_tasks(blocks(data_dir, manifest, split), 1, 0, limit), reader), size)


def spread_tasks(split_blocks: list, limit: int) -> list[dict]:
    """About ``limit`` rows spread over the whole split: the first rows of every row group, each
    group's share in proportion to its rows. A split is written in source order (a folder's
    classes one after the other): its first rows may all be of one class."""
    total = sum(rows for _, _, rows in split_blocks)
    share = min(1.0, limit / total) if total else 0.0
    return [{"file": f, "group": g, "first": 0, "count": take} for f, g, rows in split_blocks
            if (take := min(rows, max(1, round(rows * share))))]


def split_sample(data_dir, manifest: dict, split: str, preset: str, size: int, limit: int) -> Iterator[dict]:
    """``split_batches`` of about ``limit`` rows spread over the split (``spread_tasks``)."""
    reader = Reader.for_data(data_dir, manifest, preset=preset, train=False, augment=False)
    return cut(local_parts(spread_tasks(blocks(data_dir, manifest, split), limit), reader), size)


def fetch_images(data_dir, split: str, ids: set, preset: str | None = None) -> dict:
    """{id: uint8 [H, W, C]} of a few rows of a split, as evaluation sees them: the id column
    of each row group is read first, and only the wanted rows are decoded."""
    manifest = fmt.load_manifest(data_dir)
    reader = Reader.for_data(data_dir, manifest, preset=preset, train=False, augment=False)
    found = {}
    for f, g, _ in blocks(data_dir, manifest, split):
        if len(found) == len(ids):
            break
        import pyarrow.parquet as pq

        column = pq.ParquetFile(f).read_row_group(g, columns=["id"]).column("id").to_numpy()
        wanted = np.flatnonzero(np.isin(column, list(ids)))
        if len(wanted):
            rows = read_task({"file": f, "group": g, "rows": wanted.tolist()}, reader)
            found.update({int(i): img for i, img in zip(rows["id"], rows["image"])})
    return found
