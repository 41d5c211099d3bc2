"""lr-find's range test and --batch-size auto's fit on a worker of a joined cluster (``on_worker``):
a GPU run whose driver has no GPU probes on a worker's; anything else probes where it runs."""

from __future__ import annotations

import time

import pytest

from imgtrain.config import TrainConfig
from imgtrain.errors import ImgtrainError
from imgtrain.training import batch_fit, lr_find, on_worker
from tests.conftest import assert_one_line_error, cli_here

SMALL = "timm:test_resnet"


@pytest.mark.parametrize("settings, cuda_here, expected", [  # in a process that joined no cluster yet
    (dict(backend="ray", use_gpu=True, address="head:6379"), False, True),  # a CPU head node: on a worker
    (dict(backend="ray", use_gpu=True, address="head:6379"), True, False),  # this process has the GPU
    (dict(backend="ray", use_gpu=True, address=None), False, False),  # a private cluster is this machine
    (dict(backend="ray", use_gpu=True, address="local"), False, False),
    (dict(backend="ray", use_gpu=False, address="head:6379"), False, False),  # CPU runs probe here
    (dict(backend="local", use_gpu=True, address="head:6379"), False, False),
])
def test_only_a_gpu_run_joining_a_cluster_from_a_process_without_cuda_probes_on_a_worker(settings, cuda_here, expected):
    assert on_worker.wanted(TrainConfig(**settings), cuda_here=lambda: cuda_here, ray_joined=lambda: False) is expected


def test_a_gpu_run_in_a_process_already_in_a_cluster_probes_on_its_workers():
    cfg = TrainConfig(backend="ray", use_gpu=True, address=None)
    assert on_worker.wanted(cfg, cuda_here=lambda: False, ray_joined=lambda: True)


@pytest.mark.integration
def test_the_probes_on_a_worker_give_what_they_give_here(ray_cluster, tiny_data):
    from imgtrain.data.format import verify_dataset

    manifest = verify_dataset(tiny_data)
    cfg = TrainConfig(data=str(tiny_data), name="x", backend="ray", address=ray_cluster, workers=1, model=SMALL,
                      batch_size=8, threads_per_worker=1)
    there = on_worker.call(lr_find.range_test, cfg, manifest, 12)
    here = lr_find.range_test(cfg, manifest, steps=12)
    assert there.lrs == here.lrs and there.stopped == here.stopped
    assert there.losses == pytest.approx(here.losses, rel=1e-4)
    assert on_worker.call(batch_fit.fit, cfg, manifest).batch_size == batch_fit.fit(cfg, manifest).batch_size


@pytest.mark.integration
def test_a_gpu_range_test_on_a_cluster_without_gpus_is_refused_in_seconds(ray_cluster, tiny_data):
    from imgtrain.data.format import verify_dataset

    cfg = TrainConfig(data=str(tiny_data), name="x", backend="ray", address=ray_cluster, workers=1, model=SMALL,
                      batch_size=8, use_gpu=True)
    started = time.monotonic()
    with pytest.raises(ImgtrainError, match=r"the Ray cluster has 0 GPU\(s\); drop --gpu"):
        lr_find.range_test(cfg, verify_dataset(tiny_data), steps=12)
    assert time.monotonic() - started < 30  # refused, not waiting for a GPU that is not there


@pytest.mark.integration
def test_lr_find_joins_the_cluster_given_and_a_gpu_batch_fit_there_is_refused_in_one_line(
        capsys, ray_cluster, tiny_data, tmp_path):
    shown = cli_here(capsys, "lr-find", "--data", str(tiny_data), "--model", SMALL, "--backend", "ray",
                     "--address", ray_cluster, "--gpu", "--batch-size", "auto", "--out", str(tmp_path / "curve"))
    assert_one_line_error(shown, "the Ray cluster has 0 GPU(s)", "drop --gpu")
