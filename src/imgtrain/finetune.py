"""Starting from weights a user has: ``--init-from FILE`` and ``--pretrained``.

A file's tensors are matched to the model by name. Same shape: loaded. The first convolution
with another channel count: adapted (3 -> 1 channel by summing the colour filters, so a gray
image gives what the RGB filters gave for that gray in colour; 1 -> 3 by spreading it); with
another kernel size (the small-image stem): left new. The classifier with another class count:
left new. Anything else that does not fit, a tensor missing or one too many, means the file is
for another architecture, and it is refused naming the tensors that show it.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from imgtrain.errors import ImgtrainError
from imgtrain.models.parts import first_conv, head_name
from imgtrain.models.registry import family_of

DOWNLOAD_TIMEOUT_S = 15  # an offline machine fails in seconds, not after TCP's minutes of retries


@dataclass
class Adapted:
    """What loading a file did to each of the model's tensors."""

    loaded: list[str] = field(default_factory=list)
    adapted: list[str] = field(default_factory=list)  # "conv1.weight (3 -> 1 channels, summed)"
    new: list[str] = field(default_factory=list)  # "fc.weight, fc.bias (1000 -> 10 classes)"

    def summary(self, source: str) -> str:
        parts = [f"{len(self.loaded)} tensors loaded"]
        parts += [f"adapted {a}" for a in self.adapted] + [f"new {n}" for n in self.new]
        return f"initial weights from {source}: " + "; ".join(parts)


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Tensors by name from a state-dict file (.pt/.pth with weights_only, .safetensors), an
    imgtrain checkpoint folder or run folder (its model.pt)."""
    from imgtrain.storage import checkpoint as ckpt

    p = Path(path).expanduser()
    if p.is_dir():  # a checkpoint (its checksums verified) or a run (its best checkpoint)
        from imgtrain.storage.runs import resolve_checkpoint

        p = resolve_checkpoint(str(p), "best", str(p.parent)) / ckpt.MODEL_FILE
    if not p.is_file():
        raise ImgtrainError(f"--init-from {path}: no such file (a .pt/.pth/.safetensors state dict, or an imgtrain "
                            "run or checkpoint folder)")
    try:
        if p.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(p))
        else:
            state = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file gets the same one-line answer
        raise ImgtrainError(f"--init-from {path}: not a state dict PyTorch can read safely "
                            f"({type(e).__name__}: {str(e).splitlines()[0][:160]})") from None
    for key in ("state_dict", "model", "model_state_dict"):  # Lightning / training-script checkpoints
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict) or not state or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ImgtrainError(f"--init-from {path}: holds no tensors by name (expected a model's state_dict)")
    for prefix in ("module.", "_orig_mod.", "model."):  # DDP, torch.compile, Lightning wrappers
        if all(k.startswith(prefix) for k in state):
            state = {k.removeprefix(prefix): v for k, v in state.items()}
    return state


def adapt(model: nn.Module, state: dict[str, torch.Tensor], source: str, model_name: str) -> tuple[dict, Adapted]:
    """The file's tensors fitted to ``model`` (a full state dict to load) and what was done."""
    target = model.state_dict()
    conv_key = first_conv(model)[0] + ".weight"
    head = head_name(model) + "."
    out, report, head_new = dict(target), Adapted(), []
    for key, want in target.items():
        got = state.get(key)
        if got is not None and got.shape == want.shape:
            out[key] = got.to(want.dtype)
            report.loaded.append(key)
        elif key.startswith(head):
            head_new.append(key)
        elif key == conv_key and got is not None and _channels_only(got, want):
            channels = want.shape[1]
            out[key] = got.sum(1, keepdim=True) if channels == 1 else got.repeat(1, channels, 1, 1) / channels
            report.adapted.append(f"{key} ({got.shape[1]} -> {want.shape[1]} channels"
                                  f"{', summed' if want.shape[1] == 1 else ', spread'})")
        elif key == conv_key:  # the small-image stem: another kernel size, learnt afresh
            report.new.append(f"{key} ({'not in the file' if got is None else 'another kernel size'})")
        elif key.endswith("num_batches_tracked"):
            report.new.append(key)
        else:
            what = "is missing from the file" if got is None else \
                f"is {list(got.shape)} in the file and {list(want.shape)} in the model"
            raise ImgtrainError(f"--init-from {source} does not fit {model_name}: {key!r} {what} "
                                "(a file for another architecture? pass --model with the one it was saved from)")
    if head_new:
        old = next((state[k].shape[0] for k in head_new if k.endswith("weight") and k in state), None)
        classes = f"{old} -> {target[head_new[0]].shape[0]} classes" if old else "not in the file"
        report.new.append(f"{', '.join(head_new)} ({classes})")
    unused = [k for k in state if k not in target]
    if unused:  # e.g. a ResNet-34 file into a ResNet-18: every ResNet-18 name is in it
        raise ImgtrainError(f"--init-from {source} does not fit {model_name}: the file has {len(unused)} tensors "
                            f"the model has not ({', '.join(unused[:3])}{', ...' if len(unused) > 3 else ''}); "
                            "a file for another architecture? pass --model with the one it was saved from")
    return out, report


def _channels_only(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.dim() == 4 and got.shape[0] == want.shape[0] and got.shape[2:] == want.shape[2:] \
        and {got.shape[1], want.shape[1]} <= {1, 3}


def initialise(model: nn.Module, source: str, model_name: str) -> Adapted:
    """Load ``source``'s weights into ``model`` (in place), fitted as ``adapt`` says."""
    state, report = adapt(model, read_state_dict(source), source, model_name)
    model.load_state_dict(state)
    return report


# ---------------------------------------------------------------- published weights


def published_weights_file(model_name: str, download: bool = True) -> Path:
    """The model's published (ImageNet) weights as a local state-dict file, downloaded once into
    torch's hub cache. Raises ImgtrainError in seconds where the machine is offline."""
    family = family_of(model_name)
    published = family.weights(family.own_name(model_name)) if family.weights else None
    if published is None:
        raise ImgtrainError(f"--pretrained: {family.source} publishes no weights for {model_name!r}")
    path = Path(torch.hub.get_dir()) / "checkpoints" / "imgtrain" / published.file
    if path.is_file() or not download:
        return path
    before = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)
    try:
        state = published.fetch()
    except Exception as e:  # noqa: BLE001 - URLError, timeouts, HF hub errors: all mean "could not get it"
        reason = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        raise ImgtrainError(f"--pretrained: could not download the weights of {model_name} from {published.source} ({reason}); "
                            "where this machine is offline, download the file elsewhere and pass --init-from FILE"
                            ) from None
    finally:
        socket.setdefaulttimeout(before)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part")
    torch.save(state, tmp)
    tmp.replace(path)
    return path


def initial_weights(cfg) -> str | None:
    """The file a new run starts from: --init-from, or the cached published weights."""
    if cfg.init_from:
        return cfg.init_from
    if cfg.pretrained:
        return str(published_weights_file(cfg.model))
    return None
