"""``--batch-size auto``: the largest batch whose training step fits the memory it trains in.

Per worker (per ``--accumulate`` piece), the largest power of two up to ``CAP`` and to the
training split's own limit (an epoch of at least ``AUTO_MIN_STEPS`` steps, as ``--batch-size 0``
keeps), whose step (the run's own ``loop.train_step``: forward, backward, optimizer step, at the
run's precision) fits:

* on CUDA, found by trying: the step at 1, 2, 4, ... on the device until it runs out of memory
  (caught, freed) or its peak passes ``1 - CUDA_MARGIN`` of the device's memory; the last that
  passed both.
* on a CPU, estimated: the model's fixed bytes (weights, gradients, optimizer state, moving
  average) plus the activation bytes per image that one measured step at batch 2 saves for the
  backward pass (``saved_tensors_hooks``), times ``ACTIVATION_FACTOR`` for the backward's own
  buffers, within ``CPU_SHARE`` of the memory free to this process (``free_bytes``: MemAvailable,
  a cgroup's limit, the address-space limit), shared by the run's workers on this machine; then
  the step tried once at that size, and halved while it runs out of memory (an address-space or
  allocator limit fails the step; beyond those the margin is what keeps the size safe).

The global batch is that times the workers times ``--accumulate``; the run records it (config.json,
the start line), and a resumed run keeps it.
"""

from __future__ import annotations

import dataclasses
import gc
import resource
from pathlib import Path

from imgtrain.config import AUTO_LR, AUTO_MIN_STEPS, TrainConfig
from imgtrain.errors import ImgtrainError

CAP = 1024  # the largest global batch auto picks: beyond it the default recipe's LR rules are untested
CUDA_MARGIN = 0.10  # a step may use at most 90% of the device's memory
CPU_SHARE = 0.7  # of the free memory: the rest for the data pipeline, the allocator's slack, everything else
# the backward's buffers beside the saved activations. A fresh process's ResNet-18 step peaked 459 MiB at 256
# digits and 455 at 128 photos, estimated 418 and 333: the rest is torch's first use in a process (about 200 MiB,
# whatever the batch), left to CPU_SHARE's margin (bench/lr_find.py)
ACTIVATION_FACTOR = 2.0
MiB = 1 << 20


@dataclasses.dataclass
class Fit:
    """The batch chosen and why: ``per_piece`` images through the model at once per worker."""

    batch_size: int  # the global batch
    per_piece: int
    limit: str  # what stopped it: "memory", "cap", "data"
    detail: str  # one line: the figures it was decided from

    def note(self) -> str:
        return f"--batch-size auto: {self.batch_size} ({self.detail})"


def power_below(n: int) -> int:
    """The largest power of two at most ``n`` (0 for n < 1)."""
    return 1 << (n.bit_length() - 1) if n >= 1 else 0


def piece_cap(cfg: TrainConfig, n_train: int) -> tuple[int, str]:
    """The largest piece the cap and the data allow, and which of them set it."""
    share = cfg.effective_workers() * cfg.accumulate
    by_cap = power_below(CAP // share)
    by_data = power_below(n_train // AUTO_MIN_STEPS // share)
    return (by_data, "data") if by_data < by_cap else (by_cap, "cap")


def fit(cfg: TrainConfig, manifest: dict) -> Fit:
    """The batch of ``--batch-size auto`` for the run ``cfg`` on ``manifest``'s data set (tried on a
    worker's GPU where this process has none: ``on_worker``)."""
    from imgtrain.training import on_worker

    if on_worker.wanted(cfg):
        return on_worker.call(fit, cfg, manifest)
    n_train = manifest["splits"]["train"]["num_samples"]
    cap, limit = piece_cap(cfg, n_train)
    if cap < 1:
        raise ImgtrainError(f"--batch-size auto: the {n_train} training samples are too few for {AUTO_MIN_STEPS} steps "
                            f"of one image per worker and --accumulate piece; set --batch-size")
    import torch

    from imgtrain.training.local_backend import process_settings_restored

    with process_settings_restored(), torch.random.fork_rng(devices=[]):
        if cfg.use_gpu:
            piece, detail, memory_bound = _try_on_cuda(cfg, manifest, cap)
        else:
            piece, detail, memory_bound = _estimate_on_cpu(cfg, manifest, cap)
    share = cfg.effective_workers() * cfg.accumulate
    return Fit(piece * share, piece, "memory" if memory_bound else limit, detail)


# ---------------------------------------------------------------- one step, as the run takes it


def _step_run(cfg: TrainConfig, manifest: dict, device, piece: int):
    """The run's model, optimizer and step for one worker's piece of ``piece`` images."""
    import contextlib

    from imgtrain.training import loop
    from imgtrain.training.backend import Backend, single_process_collectives

    # --lr auto is found after the batch: the step's memory does not depend on the LR, the optimizer needs a number
    lr = TrainConfig.lr if cfg.lr == AUTO_LR else cfg.lr
    probe = dataclasses.replace(cfg, batch_size=piece, accumulate=1, backend="local", workers=1, min_workers=0,
                                compile=False, init_from=None, pretrained=False, ledger=False, lr=lr)
    backend = Backend(rank=0, world_size=1, device=device, prepare_model=lambda m: m.to(device),
                      train_batches=lambda e, s: iter(()), val_batches=lambda: iter(()),
                      **single_process_collectives(), restored_checkpoint=contextlib.nullcontext,
                      report=lambda *a: None, send=lambda r: None)
    run, _ = loop.setup(probe, manifest, backend)
    run.model.train()
    return run


def _batch(manifest: dict, piece: int, device) -> dict:
    """A batch of ``piece`` images of the data set's shape (memory depends on the shape alone)."""
    import torch

    h, w, c = manifest["image_shape"]
    k = manifest["num_classes"]
    from imgtrain.data.format import is_multi_label

    label = torch.zeros(piece, k, dtype=torch.uint8) if is_multi_label(manifest) \
        else torch.arange(piece, dtype=torch.int64) % k
    return {"id": torch.arange(piece), "image": torch.zeros(piece, h, w, c, dtype=torch.uint8, device=device),
            "label": label.to(device)}


def _one_step(cfg: TrainConfig, manifest: dict, device, piece: int) -> None:
    from imgtrain.training import loop

    run = _step_run(cfg, manifest, device, piece)
    loop.train_step(run, _batch(manifest, piece, device))


# ---------------------------------------------------------------- CUDA: tried on the device


def _try_on_cuda(cfg: TrainConfig, manifest: dict, cap: int) -> tuple[int, str, bool]:
    import torch

    if not torch.cuda.is_available():
        raise ImgtrainError("--batch-size auto with --gpu tries batches on the GPU of this machine, and PyTorch sees "
                            "none here: run it where the GPU is, join a cluster with GPUs (--address: it is tried on a worker's), "
                            "or set --batch-size")
    device = torch.device("cuda")
    total = torch.cuda.get_device_properties(device).total_memory
    good, piece, peak_good, stopped = 0, 1, 0, False
    while piece <= cap:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        try:
            _one_step(cfg, manifest, device, piece)
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device)
        except torch.cuda.OutOfMemoryError:
            peak = None
        gc.collect()
        torch.cuda.empty_cache()
        if peak is None or peak > (1 - CUDA_MARGIN) * total:
            stopped = True
            break
        good, peak_good = piece, peak
        piece *= 2
    if good == 0:
        raise ImgtrainError(f"--batch-size auto: a step of one image does not fit {torch.cuda.get_device_name(device)}'s "
                            f"{total / MiB:,.0f} MiB with a {CUDA_MARGIN:.0%} margin: use --grad-checkpointing, "
                            "--precision bf16, or a smaller model")
    return good, (f"{good} per piece: its step peaked at {peak_good / MiB:,.0f} MiB of "
                  f"{torch.cuda.get_device_name(device)}'s {total / MiB:,.0f} MiB"), stopped


# ---------------------------------------------------------------- CPU: estimated from one step


def free_bytes() -> tuple[int, str]:
    """The memory this process may still take, and what says so: the least of the host's
    MemAvailable, its cgroup's limit less its use (cgroup v2), and its address-space limit less
    its address space (``ulimit -v``)."""
    limits = [(_meminfo("MemAvailable"), "MemAvailable")]
    cgroup = Path("/sys/fs/cgroup")
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            limits.append((int(limit) - int((cgroup / "memory.current").read_text()), "the cgroup's memory.max"))
    except (OSError, ValueError):
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        limits.append((soft - _status_bytes("VmSize"), "the address-space limit (ulimit -v)"))
    return min(limits)


def _meminfo(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _estimate_on_cpu(cfg: TrainConfig, manifest: dict, cap: int) -> tuple[int, str, bool]:
    free, source = free_bytes()
    workers = cfg.effective_workers()  # a local cluster's: all on this machine
    advice = "free memory, use fewer --workers, a smaller model or --grad-checkpointing"
    try:
        fixed, per_image = _measured_step(cfg, manifest)
    except (MemoryError, RuntimeError) as e:  # the measuring step itself did not fit
        if not _out_of_memory(e):
            raise
        raise ImgtrainError(f"--batch-size auto: a training step of 2 images does not fit the {max(free, 0) / MiB:,.0f} "
                            f"MiB free here ({source}): {advice}") from None
    budget = CPU_SHARE * free / workers
    piece = power_below(int((budget - fixed) // (per_image * ACTIVATION_FACTOR))) if budget > fixed else 0
    figures = (f"model, gradients and optimizer state {fixed / MiB:,.0f} MiB + {per_image * ACTIVATION_FACTOR / MiB:,.1f} "
               f"MiB an image, within {CPU_SHARE:.0%} of {free / MiB:,.0f} MiB free ({source})"
               + (f" shared by {workers} workers" if workers > 1 else ""))
    estimated = min(piece, cap)
    while estimated >= 1:  # the estimate tried once, as the run will take it: halved while it does not fit
        try:
            _one_step(cfg, manifest, _cpu(), estimated)
            break
        except (MemoryError, RuntimeError) as e:
            if not _out_of_memory(e):
                raise
            estimated //= 2
            gc.collect()
    if estimated < 1:
        raise ImgtrainError(f"--batch-size auto: even a batch of 1 does not fit: {figures}; {advice}")
    return estimated, f"{estimated} per piece: {figures}", estimated < cap


def _cpu():
    import torch

    return torch.device("cpu")


def _out_of_memory(e: BaseException) -> bool:
    """Whether a CPU step failed for want of memory (torch's allocator, oneDNN's primitives)."""
    text = str(e).lower()
    return isinstance(e, MemoryError) or any(w in text for w in ("alloc", "could not create a primitive",
                                                                 "out of memory"))


def _measured_step(cfg: TrainConfig, manifest: dict) -> tuple[int, int]:
    """(the fixed bytes of one worker's model: weights, gradients, optimizer state, moving
    average; the activation bytes per image its step saves for the backward pass), from one
    step at batch 2 on the CPU."""
    import torch

    from imgtrain.training import loop

    run = _step_run(cfg, manifest, torch.device("cpu"), 2)
    params = {p.untyped_storage().data_ptr() for p in run.model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and t.device.type == "cpu":
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loop.train_step(run, _batch(manifest, 2, torch.device("cpu")))
    weights = sum(p.numel() * p.element_size() for p in run.model.parameters())
    state = sum(t.numel() * t.element_size() for s in run.optimizer.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))
    average = weights if run.ema is not None else 0
    return 2 * weights + state + average, max(1, sum(saved.values()) // 2)
