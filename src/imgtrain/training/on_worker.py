"""lr-find's range test and ``--batch-size auto``'s fit, run on a worker's GPU of a joined cluster.

Both try the run's own training step on the device it will train on. A Ray cluster's driver
often runs on a head node without a GPU while the workers have one each; there the probe runs
as one Ray task asking for one training worker's resources (``--cpus-per-worker`` CPUs and a
GPU, as the run's ScalingConfig does), and only its small result (a Curve, a Fit) comes back.
A private cluster is this machine: its GPUs are this process's, so the probe stays here.
"""

from __future__ import annotations

import sys
from typing import Callable, TypeVar

from imgtrain.config import TrainConfig
from imgtrain.errors import ImgtrainError

Result = TypeVar("Result")


def wanted(cfg: TrainConfig, cuda_here: Callable[[], bool] | None = None,
           ray_joined: Callable[[], bool] | None = None) -> bool:
    """Whether ``cfg``'s probe must run on a worker: a Ray run on GPUs of a cluster it joins (its
    ``--address``, or the one this process is in already), from a process where PyTorch sees no
    CUDA device."""
    from imgtrain.cluster import starts_its_own

    if cfg.backend != "ray" or not cfg.use_gpu:
        return False
    if starts_its_own(cfg.address) and not (ray_joined or _ray_joined)():  # a private cluster is this machine
        return False
    return not (cuda_here or _cuda_here)()


def call(probe: Callable[..., Result], cfg: TrainConfig, *args) -> Result:
    """``probe(cfg, *args)`` in a Ray task with one training worker's resources, on the cluster
    ``cfg`` trains on (joined for the call; a cluster this process is in already is used as it is)."""
    import ray

    from imgtrain import cluster

    gpus = 1 if cfg.use_gpu else 0
    with cluster.ray_session(cfg.address, 0, cluster.user_log_dir(), "probe.log"):
        if gpus:  # Ray would wait forever for a GPU the cluster does not have
            cluster.require_gpus(1, "GPU to try the training step on", "drop --gpu, or join a cluster with GPUs")
        task = ray.remote(num_cpus=cfg.cpus_per_worker, num_gpus=gpus, max_retries=0)(probe)
        try:
            return ray.get(task.remote(cfg, *args))
        except ray.exceptions.RayTaskError as e:  # the probe's own one-line refusal, without Ray's traceback
            if isinstance(e.cause, ImgtrainError):
                raise e.cause from None
            raise


def _ray_joined() -> bool:
    ray = sys.modules.get("ray")  # a cluster this process is in already (library use); never imports Ray
    return ray is not None and ray.is_initialized()


def _cuda_here() -> bool:
    import torch

    return torch.cuda.is_available()
