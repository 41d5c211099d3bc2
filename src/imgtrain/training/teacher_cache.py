"""``--distill-mode cached``: the teacher's logits of every training image, computed once and
kept for every run that distils from that teacher on that data set.

The teacher runs over the training split as batch inference, exactly as ``predict`` runs a model
over a data set (``inputs.list_inputs`` / ``read_task``: the teacher's own evaluation transform):
on the Ray backend on a Ray Data actor pool (one GPU per actor where the cluster has GPUs), on
the local backend in this process.

The table is two plain ``.npy`` files (``logits_table.py``: ids sorted, logits [N, K], about 5 GB
for ImageNet-1k), written batch by batch as the teacher's pass returns them and read by each
worker a step's rows at a time; the train loop's config carries its ``Ref`` (paths and shape),
never the numbers. The files live in
``.teacher-logits/`` beside the data set (on a cluster, where every node reads the data set), or
under imgtrain's cache (``$IMGTRAIN_CACHE/teacher-logits``) when the data set's folder is not
writable or is in an object store. ``<key>`` is ``<data>-<teacher>``: the training split's
fingerprint (a hash of its files' sha256 as the manifest lists them, which ``verify_dataset``
checked before training) and the sha256 of the teacher's model file. Either changing names other
files, so a stale table is never read; one found whole is reused. Each file is written under a
name of its own and renamed into place, the ids last (a table is there once its ids are): two
runs computing it at once each leave a complete table (the ids are the same in both, the logits
either's), and readers never see half of one. Tables of the ``.npz`` format imgtrain wrote before
are not read (their key names other files: the table is computed again); ``imgtrain clean data``
deletes both.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from imgtrain.config import TrainConfig
from imgtrain.errors import ImgtrainError
from imgtrain.ops import remote
from imgtrain.training.logits_table import Ref, fetch, publish, read, write

FOLDER = ".teacher-logits"
SUFFIXES = (".npy", ".npz", ".tmp")  # its tables, older versions' tables, a writer's temporaries: imgtrain's
MAX_ACTORS = 4  # a CPU cluster's actor pool: the teacher's batches are large, a few actors keep it busy


def data_fingerprint(manifest: dict) -> str:
    """The training split's identity: its files and their sha256, hashed."""
    split = manifest["splits"]["train"]
    listed = [[f, manifest.get("sha256", {}).get(f, "")] for f in split["files"]]
    return hashlib.sha256(json.dumps(listed).encode()).hexdigest()


def ref_for(cfg: TrainConfig, manifest: dict) -> Ref:
    """Where the table of this data set and teacher lives: beside the data set where that folder
    is writable, else under imgtrain's cache."""
    key = f"{data_fingerprint(manifest)[:20]}-{cfg.teacher_sha256[:20]}"
    data = Path(cfg.data)
    if not remote.is_remote(cfg.data) and os.access(data, os.W_OK):
        folder = data.absolute() / FOLDER
    else:
        folder = remote.cache_root() / "teacher-logits"
    return Ref(str(folder / f"{key}.ids.npy"), str(folder / f"{key}.logits.npy"),
               manifest["splits"]["train"]["num_samples"], manifest["num_classes"])


def ensure(cfg: TrainConfig, manifest: dict, note, on_ray: bool) -> Ref:
    """The table of ``cfg``'s teacher and data set: found where it is, else computed and stored."""
    from imgtrain.data.staging import local_data

    ref = ref_for(cfg, manifest)
    beside = f"{cfg.data.rstrip('/')}/{FOLDER}" if remote.is_remote(cfg.data) else None
    found = read(ref) or (_uploaded(ref, beside) if beside else None)
    if found is not None:
        found.close()
        note(f"teacher logits: reusing {ref.logits}")
    else:
        started = time.perf_counter()
        data = local_data(cfg.data)
        write(ref, training_ids(data, manifest), (_on_ray if on_ray else _here)(cfg, data))
        note(f"teacher logits: {ref.rows:,} training images in {time.perf_counter() - started:.1f} s, "
             f"stored in {ref.logits}")
    if beside:  # every node fetches it from beside the data set, as it fetches the data set's files
        try:
            return publish(ref, beside)
        except ImgtrainError as e:
            note(f"note: the teacher's logits could not be uploaded beside the data set ({e}): only this node's "
                 "workers can read them")
    return ref


def _uploaded(ref: Ref, beside: str):
    """The table an earlier run uploaded beside the data set, fetched into this node's cache."""
    try:
        return fetch(dataclasses.replace(ref, uri=beside))
    except ImgtrainError:
        return None


def require_on_every_node(ref: Ref, run_dir: Path) -> None:
    """On a cluster of several nodes, refuse in one line a table some node cannot read: one under
    this machine's cache, the data set's folder not being writable (a table uploaded beside a data
    set in an object store is fetched by each node instead)."""
    import ray

    from imgtrain import cluster

    if ref.uri or len([n for n in ray.nodes() if n.get("Alive")]) < 2:
        return
    problems = cluster.check_shared_paths(run_dir, [ref.ids, ref.logits])
    if problems:
        raise ImgtrainError(f"the teacher's logits {ref.logits} are not on every node of the cluster: "
                            f"{'; '.join(problems)}; make the data set's folder writable (they are kept beside it, "
                            "where every node reads it) or use --distill-mode online")


def training_ids(data: str, manifest: dict) -> np.ndarray:
    """The training split's row ids, sorted: int64 [N], 8 bytes a row (10 MB for ImageNet-1k, as an
    epoch's order holds), read from the id column alone."""
    import pyarrow.parquet as pq

    from imgtrain.data.format import split_files

    ids = np.sort(np.concatenate([pq.read_table(f, columns=["id"]).column("id").to_numpy()
                                  for f in split_files(Path(data), manifest, "train")] or [np.zeros(0, np.int64)]))
    if len(ids) != manifest["splits"]["train"]["num_samples"] or (np.diff(ids) <= 0).any():
        raise ImgtrainError(f"{data}: the training split's files hold {len(ids)} rows and the manifest lists "
                            f"{manifest['splits']['train']['num_samples']}, or their ids repeat; prepare the data set again")
    return ids.astype(np.int64)


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


def _here(cfg: TrainConfig, data: str) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    from imgtrain.inference.inputs import list_inputs, read_task

    teacher = TeacherLogits(cfg.to_dict())
    shape, preset = teacher.teacher.loaded.preprocess.image_shape, teacher.teacher.loaded.preprocess.preset
    for task in list_inputs(data, "train").tasks:
        rows = read_task({"task": [json.dumps(task)]}, shape, preset)
        for i in range(0, len(rows["id"]), cfg.eval_batch_size):
            yield _rows(teacher({k: v[i:i + cfg.eval_batch_size] for k, v in rows.items()}))


def _on_ray(cfg: TrainConfig, data: str) -> Iterator[tuple[np.ndarray, np.ndarray]]:
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
    for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):  # a block at a time, written as it comes
        yield _rows(batch)
