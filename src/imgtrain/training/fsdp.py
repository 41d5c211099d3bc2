"""Sharded data parallelism (``--strategy fsdp``): torch's FSDP2 (``fully_shard``) applied inside
each Ray Train worker, whose process group Ray Train has already set up.

Ray's ``prepare_model(parallel_strategy="fsdp")`` is FSDP1 and refuses to run without CUDA;
FSDP2 runs on CPUs (gloo) and GPUs (NCCL) alike. Each rank holds 1/world of every parameter,
gradient, optimizer state and moving-average tensor; a block's full parameters exist only
while it runs (all-gathered before its forward and backward, freed after).

A checkpoint holds what every other verb needs, the plain ``model.pt`` (the full state dict,
gathered), and what only a resume needs, sharded: ``sharded/`` is a ``torch.distributed.checkpoint``
directory of the training weights, optimizer state and moving average, which each rank writes
its part of (Ray Train merges the ranks' checkpoint directories into one). DCP reshards on load,
so a run resumes at any world size.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from imgtrain.ops.files import sha256_file


def shard(model: nn.Module, device: torch.device, precision: str) -> nn.Module:
    """Shard ``model`` over the default process group: every stage or block (``units``) is its
    own FSDP unit, then the root takes what is left (stem, classifier).

    bf16: blocks are all-gathered and run in bfloat16 with gradients reduced in float32
    (``MixedPrecisionPolicy``). BatchNorm layers stay float32, each its own unit: with bfloat16
    weights and its float32 running statistics ``batch_norm`` refuses to run ("expected scalar
    type BFloat16 but found Float", CPU, torch 2.14); bfloat16 inputs with float32 weights work.
    fp16: float32 weights, the forward pass under float16 autocast (loop.py), so the gradient
    scaler unscales float32 gradients.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # FSDP2 shards contiguous parameters only ("does not support non-contiguous parameters");
    # --channels-last still shapes the inputs and validation's plain model.
    model = model.to(device, memory_format=torch.contiguous_format)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy()
    if precision == "bf16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                fully_shard(module, mesh=mesh, mp_policy=MixedPrecisionPolicy())
    for unit in units(model):
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def return_freed_memory() -> None:
    """Make this process's large allocations (over 128 KiB) mmaps that go back to the OS when
    freed (glibc's ``M_MMAP_THRESHOLD``; nothing elsewhere). FSDP gathers and frees every block's
    weights and gradients at every step; glibc's default raises that threshold after the first
    frees and then keeps the freed buffers in its heap: ResNet-50 on 2 ranks grew to 1,012 MB in
    4 steps (662 MB after a ``malloc_trim``), against 621 MB with the fixed threshold (DDP: 981 MB;
    ``bench/fsdp_heap.py``)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD; a fixed value also stops its dynamic growth
    except (OSError, AttributeError):  # not glibc: its allocator decides
        pass


def units(model: nn.Module) -> list[nn.Module]:
    """The modules to shard before the root: the outermost modules with parameters that are
    elements of a Sequential or ModuleList of two or more. ResNet: each block of layer1-4;
    ConvNeXt, MobileNet, EfficientNet: each entry of ``features`` (stages or blocks); ViT: each
    encoder layer. Whatever is left (stem, classifier) belongs to the root."""
    chosen: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(module, (nn.Sequential, nn.ModuleList)) and len(module) > 1 and \
                    any(True for _ in child.parameters()):
                chosen.append(child)  # its own children are inside this unit
            else:
                visit(child)

    visit(model)
    return chosen


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def full_state(model: nn.Module) -> dict:
    """The unsharded state dict on every rank (a collective: all ranks call it), on the CPU:
    each rank validates with it, rank 0 saves it as model.pt."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().cpu() for k, v in state.items()}


def _sharded_state(model: nn.Module, optimizer, ema_module: nn.Module | None) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    weights, optim = get_state_dict(model, optimizer)
    state = {"model": weights, "optimizer": optim}
    if ema_module is not None:
        state["ema"] = get_model_state_dict(ema_module)
    return state


def save_sharded(directory: Path, model: nn.Module, optimizer, ema_module: nn.Module | None) -> dict[str, str]:
    """Every rank writes its shards into ``directory`` (rank 0 also DCP's ``.metadata``);
    returns {path relative to the checkpoint: sha256} of every rank's files, on every rank."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_sharded_state(model, optimizer, ema_module), checkpoint_id=str(directory))
    mine = {f"{directory.name}/{f.name}": sha256_file(f) for f in sorted(directory.iterdir()) if f.is_file()}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {name: digest for part in every for name, digest in part.items()}


def load_sharded(directory: Path, model: nn.Module, optimizer, ema_module: nn.Module | None) -> None:
    """Load the sharded state into this rank's shards, whatever the world size that saved it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    # get_state_dict gives the optimizer its state first (a step with LR 0 and zero gradients),
    # so the template has every tensor DCP fills in.
    state = _sharded_state(model, optimizer, ema_module)
    try:
        dcp.load(state, storage_reader=_safe_reader(directory), planner=_safe_planner())
    except dcp.CheckpointException as e:  # a BaseException: it would pass every `except Exception`
        causes = "; ".join(f"rank {rank}: {type(exc).__name__}: {exc}" for rank, (exc, _) in e.failures.items())
        raise RuntimeError(f"cannot read the sharded training state in {directory}: {causes}") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    if ema_module is not None:
        set_model_state_dict(ema_module, state["ema"])


# torch 2.14's DCP reads a checkpoint's ``.metadata`` with ``pickle.load`` and its non-tensor items
# (the optimizer's hyperparameters) with an unrestricted ``torch.load``: a crafted checkpoint
# would run code on resume. Both are read here the way ``weights_only=True`` reads model.pt.
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "TensorStorageMetadata", "ChunkStorageMetadata",
                                              "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
}


def read_metadata(stream):
    """DCP's metadata, unpickled with only the classes it is made of (plus torch's dtypes and Size)."""
    import pickle

    class MetadataUnpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            found = getattr(torch, name, None) if module == "torch" else None
            if name in _METADATA_CLASSES.get(module, ()) or isinstance(found, torch.dtype) or found is torch.Size:
                return super().find_class(module, name)
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")

    return MetadataUnpickler(stream).load()


def _safe_reader(directory: Path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as stream:
                metadata = read_metadata(stream)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(directory))


def _safe_planner():
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value) -> None:
            """DefaultLoadPlanner's, with weights_only=True (numbers, bools, tuples: param groups)."""
            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return SafePlanner()
