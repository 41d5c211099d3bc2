"""What a training step asks of the host: on a GPU every tensor made from Python numbers is a
blocking host-to-device copy and every read back of a device value waits for the GPU, so a
steady-state step must do neither (issue 19). On the CPU the calls are counted with a torch
function mode; on CUDA the synchronisations themselves, with torch's sync debug mode."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.overrides import TorchFunctionMode

from imgtrain.config import TrainConfig
from imgtrain.data.format import load_manifest, read_split
from imgtrain.data.order import ordered_batches, sort_by_id
from imgtrain.training import loop
from imgtrain.training.backend import Backend, single_process_collectives

FROM_PYTHON = {"tensor", "as_tensor", "scalar_tensor", "from_numpy"}  # a copy from the host on a GPU
READ_BACK = {"item", "__float__", "__int__", "__bool__", "tolist", "numpy", "cpu"}  # waits for a GPU


class CallLog(TorchFunctionMode):
    def __init__(self, host_scalars: set[int]):
        super().__init__()
        self.names, self.reads, self.host_scalars = [], [], host_scalars

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        if self.names[-1] in READ_BACK and args and id(args[0]) not in self.host_scalars:
            self.reads.append(self.names[-1])
        return func(*args, **(kwargs or {}))


def training_run(data, device: torch.device, **settings):
    cfg = TrainConfig(name="steps", data=str(data), batch_size=32, **settings)
    manifest = load_manifest(data)
    rows = sort_by_id(*map(torch.from_numpy, read_split(data, "train")))
    backend = Backend(
        rank=0, world_size=1, device=device, prepare_model=lambda m: m.to(device),
        train_batches=ordered_batches(rows, cfg.seed, cfg.batch_size, 8, 1, 0, device, on_device=True),
        val_batches=lambda: iter(()), restored_checkpoint=_nothing_to_restore, report=lambda *a: None,
        send=lambda record: None, **single_process_collectives(),
    )
    run, _ = loop.setup(cfg, manifest, backend)
    return run, iter(backend.train_batches(0, 0)), loop.epoch_affines(run, 0)


class _nothing_to_restore:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("ema_decay", [0.98, 0.0])
def test_a_steady_state_step_makes_no_tensor_from_python_and_reads_nothing_back(tiny_data, ema_decay):
    run, batches, affines = training_run(tiny_data, torch.device("cpu"), ema_decay=ema_decay)
    for i in range(2):  # the first steps create the optimizer's state
        loop.train_step(run, next(batches), affines[i])
    # AdamW's step counters are CPU tensors by design (not capturable): reading them never syncs
    counters = {id(state["step"]) for state in run.optimizer.state.values()}
    with CallLog(counters) as log:
        for i in range(2, 5):
            loop.train_step(run, next(batches), affines[i])
    assert "convolution" in log.names or "conv2d" in log.names  # the log saw the step
    made = [n for n in log.names if n in FROM_PYTHON]
    assert not made, f"tensors made from Python data in a step: {made}"
    assert not log.reads, f"values read back in a step: {log.reads}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="counts CUDA synchronisations: needs a GPU "
                    "(run on a GPU machine: pytest tests/training/test_step_syncs.py)")
def test_a_steady_state_cuda_step_never_synchronises(tiny_data):
    run, batches, affines = training_run(tiny_data, torch.device("cuda"), data_on_device=True)
    for i in range(2):
        loop.train_step(run, next(batches), affines[i])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(2, 5):
                loop.train_step(run, next(batches), affines[i])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message).lower()]
    assert not syncs, syncs
