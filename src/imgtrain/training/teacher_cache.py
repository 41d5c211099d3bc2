"""``--distill-mode cached``: the teacher's logits of every training image, computed once and
kept for every run that distils from that teacher on that data set.

The teacher runs over the training split as batch inference, exactly as ``predict`` runs a model
over a data set (``inputs.list_inputs`` / ``read_task``: the teacher's own evaluation transform):
on the Ray backend on a Ray Data actor pool (one GPU per actor where the cluster has GPUs), on
the local backend in this process. The table (row ids, sorted, and float32 logits [N, K]) is
stored as ``.teacher-logits/<data>-<teacher>.npz`` beside the data set, or under imgtrain's
cache (``$IMGTRAIN_CACHE/teacher-logits``) when the data set's folder is not writable or is in an
object store. ``<data>`` is the training split's fingerprint: a hash of its files' sha256 as the
manifest lists them (and ``verify_dataset`` checked before training); ``<teacher>`` the sha256
of the teacher's model file. Either changing names another file, so a stale table is never
read; one found is reused. It is written to a file of its own and renamed into place, so two
runs computing it at once each leave a complete table and readers never see half of one.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from imgtrain.config import TrainConfig
from imgtrain.errors import ImgtrainError

FOLDER = ".teacher-logits"
MAX_ACTORS = 4  # a CPU cluster's actor pool: the teacher's batches are large, a few actors keep it busy


def data_fingerprint(manifest: dict) -> str:
    """The training split's identity: its files and their sha256, hashed."""
    split = manifest["splits"]["train"]
    listed = [[f, manifest.get("sha256", {}).get(f, "")] for f in split["files"]]
    return hashlib.sha256(json.dumps(listed).encode()).hexdigest()


def path_for(cfg: TrainConfig, manifest: dict) -> Path:
    """Where the table of this data set and teacher lives: beside the data set where that folder
    is writable, else under imgtrain's cache."""
    from imgtrain.ops import remote

    name = f"{data_fingerprint(manifest)[:20]}-{cfg.teacher_sha256[:20]}.npz"
    data = Path(cfg.data)
    if not remote.is_remote(cfg.data) and os.access(data, os.W_OK):
        return data / FOLDER / name
    return remote.cache_root() / "teacher-logits" / name


def read(path: Path, manifest: dict) -> tuple[np.ndarray, np.ndarray] | None:
    """(ids, logits) of a table found whole and of this data set's shape; None otherwise."""
    try:
        with np.load(path, allow_pickle=False) as table:
            ids, logits = table["ids"], table["logits"]
    except (OSError, ValueError, KeyError):
        return None
    n, k = manifest["splits"]["train"]["num_samples"], manifest["num_classes"]
    if ids.shape != (n,) or logits.shape != (n, k) or ids.dtype != np.int64 or logits.dtype != np.float32:
        return None
    return ids, logits


def ensure(cfg: TrainConfig, manifest: dict, note, on_ray: bool) -> tuple[np.ndarray, np.ndarray]:
    """The table of ``cfg``'s teacher and data set: read where it is, else computed and stored."""
    from imgtrain.data.staging import local_data

    path = path_for(cfg, manifest)
    found = read(path, manifest)
    if found is not None:
        note(f"teacher logits: reusing {path}")
        return found
    started = time.perf_counter()
    ids, logits = (_on_ray if on_ray else _here)(cfg, local_data(cfg.data))
    order = np.argsort(ids, kind="stable")
    ids, logits = ids[order].astype(np.int64), logits[order].astype(np.float32)
    if len(ids) != manifest["splits"]["train"]["num_samples"]:
        raise ImgtrainError(f"--teacher {cfg.teacher}: {len(ids)} of the training split's "
                            f"{manifest['splits']['train']['num_samples']} images could be read for it")
    _write(path, ids, logits)
    note(f"teacher logits: {len(ids):,} training images in {time.perf_counter() - started:.1f} s, stored in {path}")
    return ids, logits


def _write(path: Path, ids: np.ndarray, logits: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, ids=ids, logits=logits)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # complete or absent: a run at the same time renames its own copy
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _rows(out: dict) -> tuple[np.ndarray, np.ndarray]:
    from imgtrain.inference.inputs import ERROR_KEY

    bad = np.asarray(out[ERROR_KEY]) != ""
    if bad.any():
        raise ImgtrainError(f"--teacher: training row {int(np.asarray(out['id'])[bad][0])} "
                            f"{np.asarray(out[ERROR_KEY])[bad][0]}")
    return np.asarray(out["id"]), np.asarray(out["logits"])


class TeacherLogits:
    """Ray Data ``map_batches`` callable (one teacher per actor), or called here: rows with an
    ``image`` column -> their ``id``, ``logits`` and read errors."""

    def __init__(self, cfg: dict, device: str = "cpu", threads: int = 0):
        from imgtrain.ops import process
        from imgtrain.training import distill

        self.threads, self.device = threads, device
        with process.torch_threads(threads):
            self.teacher = distill.load(TrainConfig(**cfg), device)

    def __call__(self, batch: dict) -> dict:
        from imgtrain.inference.inputs import ERROR_KEY
        from imgtrain.ops import process

        with process.torch_threads(self.threads):
            logits = self.teacher.logits_of_images(batch["image"], self.device)
        return {"id": batch["id"], "logits": logits, ERROR_KEY: batch[ERROR_KEY]}


def _here(cfg: TrainConfig, data: str) -> tuple[np.ndarray, np.ndarray]:
    from imgtrain.inference.inputs import list_inputs, read_task

    teacher = TeacherLogits(cfg.to_dict())
    shape, preset = teacher.teacher.loaded.preprocess.image_shape, teacher.teacher.loaded.preprocess.preset
    ids, logits = [], []
    for task in list_inputs(data, "train").tasks:
        rows = read_task({"task": [json.dumps(task)]}, shape, preset)
        for i in range(0, len(rows["id"]), cfg.eval_batch_size):
            part = {k: v[i:i + cfg.eval_batch_size] for k, v in rows.items()}
            found = _rows(teacher(part))
            ids.append(found[0])
            logits.append(found[1])
    return np.concatenate(ids), np.concatenate(logits)


def _on_ray(cfg: TrainConfig, data: str) -> tuple[np.ndarray, np.ndarray]:
    """The predict pipeline's shape: reading tasks on CPUs feeding an actor pool of teachers."""
    import ray
    import ray.data

    from imgtrain.inference.inputs import list_inputs, read_task
    from imgtrain.training import distill, tracking

    preprocess = distill.load(cfg).loaded.preprocess  # refused here, in one line, before any actor starts
    resources = ray.cluster_resources()
    gpus = int(resources.get("GPU", 0))
    actors = gpus or max(1, min(MAX_ACTORS, int(resources.get("CPU", 1)) // 2))
    tasks = list_inputs(data, "train").tasks
    ds = ray.data.from_items([{"task": json.dumps(t)} for t in tasks], override_num_blocks=len(tasks))
    ds = ds.map_batches(read_task, fn_kwargs={"shape": preprocess.image_shape, "preset": preprocess.preset},
                        batch_size=1, num_cpus=1)
    ds = ds.map_batches(TeacherLogits, fn_constructor_kwargs={"cfg": tracking.public_config(cfg), "device": "cuda" if gpus else "cpu",
                                                              "threads": 0 if gpus else 1},
                        batch_size=cfg.eval_batch_size, batch_format="numpy", num_cpus=1, num_gpus=1 if gpus else 0,
                        compute=ray.data.ActorPoolStrategy(size=actors))
    ids, logits = [], []
    for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
        found = _rows(batch)
        ids.append(found[0])
        logits.append(found[1])
    return np.concatenate(ids), np.concatenate(logits)
