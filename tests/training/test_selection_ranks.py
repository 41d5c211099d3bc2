"""Early stopping and --average-last with two ranks, DDP and FSDP, without Ray: two processes
joined by torch.distributed (gloo) run the loop as Ray Train's workers do (``ray_worker``'s
collectives, rank 0 writes, every rank's files copied into the one checkpoint). Every rank must
stop after the same epoch with no collective of its own (a rank that went on would wait for
the other forever: the test's timeout), and the average, made on rank 0 and broadcast, is the
mean of the epochs' weights whichever way the model is held."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from imgtrain.checkpoint_policy import POLICY
from imgtrain.storage import checkpoint as ckpt
from tests.conftest import tiny_config

pytestmark = pytest.mark.integration  # trains with two ranks, each a process

SETTINGS = dict(model="tinycnn_8", epochs=4, limit_train_batches=2, deterministic=True, select_metric="val_loss",
                early_stop=1, early_stop_min_delta=1000.0, average_last=2, num_to_keep=100, log_every_steps=1,
                threads_per_worker=1, bn_calibration=64)
STRATEGIES = ("ddp", "fsdp")
WORLD = 2


def _rank(rank: int, cfgs: list[dict], repo: str) -> None:
    """One rank: the loop with the collectives, batches and reports a Ray worker would have, for
    each run of ``cfgs`` in turn (one process for both: starting one costs seconds here)."""
    import contextlib

    import torch.distributed as dist

    sys.path.insert(0, repo)
    from imgtrain.config import TrainConfig
    from imgtrain.data.format import read_split, verify_dataset
    from imgtrain.data.order import ordered_batches, sort_by_id
    from imgtrain.models import registry
    from imgtrain.training import fsdp, ingest
    from imgtrain.training.backend import Backend
    from imgtrain.training.loop import run_loop
    from imgtrain.training.ray_worker import _collectives
    from tests.test_model_registry import TINY_CNNS

    torch.set_num_threads(1)
    registry.register(TINY_CNNS)
    for cfg_dict in cfgs:
        cfg, device = TrainConfig(**cfg_dict), torch.device("cpu")
        out = Path(cfg.storage) / cfg.name
        dist.init_process_group("gloo", init_method=f"file://{cfg.storage}/init", rank=rank, world_size=WORLD)
        manifest = verify_dataset(cfg.data)
        rows = sort_by_id(*map(torch.from_numpy, read_split(cfg.data, "train")))

        def report(metrics: dict, save_dir: str | None, name: str, out=out) -> None:
            if save_dir:  # as Ray Train does: every rank's files into the one checkpoint folder
                shutil.copytree(save_dir, out / name, dirs_exist_ok=True)
            dist.barrier()  # ray.train.report is one

        def send(record: dict, out=out) -> None:
            with open(out / f"records-{rank}.jsonl", "a") as f:
                f.write(json.dumps(record, default=str) + "\n")

        prepare = (lambda m, cfg=cfg: fsdp.shard(m, device, cfg.precision)) if cfg.strategy == "fsdp" else \
            (lambda m: torch.nn.parallel.DistributedDataParallel(m))
        backend = Backend(
            rank=rank, world_size=WORLD, device=device, prepare_model=prepare,
            train_batches=ordered_batches(rows, cfg.seed, cfg.batch_size, ingest.steps(cfg, manifest), WORLD, rank,
                                          device),
            val_batches=ingest.in_memory_val_batches(cfg, manifest, rank, WORLD, device),
            calibration_batches=ingest.in_memory_val_batches(cfg, manifest, rank, WORLD, device, "train",
                                                             cfg.bn_calibration),
            **_collectives(WORLD, device), restored_checkpoint=lambda: contextlib.nullcontext(None), report=report,
            send=send, run_dir=out,
        )
        try:
            run_loop(cfg, manifest, backend)
        finally:
            dist.destroy_process_group()


def records(run_dir: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / f"records-{rank}.jsonl").read_text().splitlines()]


def test_every_rank_stops_after_the_same_epoch_and_the_average_is_the_epochs_mean(tiny_data, tmp_path):
    cfgs = {}
    for strategy in STRATEGIES:
        (tmp_path / strategy / "run").mkdir(parents=True)
        cfgs[strategy] = tiny_config(tiny_data, tmp_path / strategy, "run", strategy=strategy, **SETTINGS)
    repo = str(Path(__file__).resolve().parents[2])
    # the children import imgtrain and the tests' model family
    os.environ["PYTHONPATH"] = os.pathsep.join([repo + "/src", repo, os.environ.get("PYTHONPATH", "")])
    context = mp.get_context("spawn")
    procs = [context.Process(target=_rank, args=(r, [c.to_dict() for c in cfgs.values()], repo))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert [p.exitcode for p in procs] == [0] * WORLD  # a rank that went on would have waited for the other forever

    for strategy, cfg in cfgs.items():
        run_dir = Path(cfg.storage) / cfg.name
        # both ranks trained epochs 0 and 1 only (the planted stop): each sends its own step timings
        for rank in range(WORLD):
            assert {r["epoch"] for r in records(run_dir, rank) if r.get("kind") == "rank"} == {0, 1}, strategy
        history = [r for r in records(run_dir, 0) if r.get("kind") == "epoch"]
        assert [r["epoch"] for r in history] == [0, 1] and all(r["val_samples"] == 100 for r in history)
        average = next(r for r in records(run_dir, 0) if r.get("kind") == "average")
        assert average["epochs"] == [0, 1] and average["val_samples"] == 100  # validated over both ranks' rows

        path = run_dir / POLICY.average_name(1)
        ckpt.verify(path)  # rank 0's record of every rank's files (FSDP's shards) holds
        averaged = torch.load(path / ckpt.MODEL_FILE, weights_only=True)
        epochs = [torch.load(run_dir / POLICY.epoch_name(e) / ckpt.MODEL_FILE, weights_only=True) for e in (0, 1)]
        for name, value in averaged.items():
            if value.is_floating_point() and "running_" not in name:  # BatchNorm statistics: recomputed
                mean = (epochs[0][name].double() + epochs[1][name].double()) / 2
                torch.testing.assert_close(value.double(), mean, rtol=1e-6, atol=1e-7, msg=f"{strategy} {name}")
