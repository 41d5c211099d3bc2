"""What a loaded model takes and where it came from: ``Preprocess`` (uint8 images -> the model's
input, exactly as in training) and ``LoadedCheckpoint``, read from a checkpoint's ``meta.json``
or an export's ``imgtrain.json`` (``preprocess_of``), whose untrusted fields are held to a
data set's own bounds before anything is sized by them. ``predictor.py`` loads checkpoints with
them, ``export_engine.py`` exports."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from imgtrain.data.format import PRESETS, default_preset, short_repr
from imgtrain.data.limits import MAX_IMAGE_PIXELS, MAX_IMAGE_SIDE
from imgtrain.errors import ImgtrainError
from imgtrain.inference.export_record import EXPORT_META
from imgtrain.storage import checkpoint as ckpt


@dataclass(frozen=True)
class Preprocess:
    """uint8 images [B, H, W, C] (or one [H, W, C]) -> the model's float input [B, C, H, W],
    exactly as in training."""

    image_shape: tuple[int, int, int]  # (H, W, C)
    mean: tuple[float, ...]
    std: tuple[float, ...]
    classes: tuple[str, ...]
    channels_last: bool = False
    preset: str = "digits"  # how images of another size are converted: its evaluation transform

    def __call__(self, images, device="cpu"):
        import torch

        from imgtrain.data.tensors import to_model_input

        if not isinstance(images, torch.Tensor):
            images = np.asarray(images)
            if not images.flags.writeable:  # Ray Data's zero-copy batches; torch wants to own them
                images = images.copy()
        x = self.checked(torch.as_tensor(images))
        x = to_model_input(x.to(device), list(self.mean), list(self.std))
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last else x

    def checked(self, images):
        """uint8 images [B, H, W, C] of the model's shape (a batch of one from [H, W, C]), numpy or torch."""
        x = images[None] if images.ndim == 3 else images
        if str(x.dtype).removeprefix("torch.") != "uint8" or tuple(x.shape[1:]) != self.image_shape:
            raise ImgtrainError(
                f"the model takes uint8 images of shape {list(self.image_shape)} (H, W, C), "
                f"got {str(x.dtype).removeprefix('torch.')} {list(x.shape[1:])}"
            )
        return x


@dataclass
class LoadedCheckpoint:
    model: object  # torch.nn.Module in eval mode
    preprocess: Preprocess
    path: Path
    meta: dict

    @property
    def recorded_val_accuracy(self) -> float | None:
        metrics = self.meta.get("metrics")  # untrusted: shown as a percentage, so a number or nothing
        value = metrics.get("val_accuracy") if isinstance(metrics, dict) else None
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    @property
    def recorded_split(self) -> str | None:
        """The split training validated this checkpoint on, as it recorded it (val or test); None
        when its record does not say (a checkpoint from before it did)."""
        metrics = self.meta.get("metrics")
        value = metrics.get("val_split") if isinstance(metrics, dict) else None
        return value if value in ("val", "test") else None


def preprocess_of(path: Path, meta: dict, export: bool = False) -> Preprocess:
    """How the model of ``meta`` (a checkpoint's meta.json, or with ``export`` an export's
    imgtrain.json) takes its images, its untrusted fields checked first: nothing is sized by
    them (one class name per output) before they are found within bounds."""
    from imgtrain.models.zoo import args_problems  # imports no torch

    what, record, remedy = (("export", EXPORT_META, "export the model again") if export else
                            ("checkpoint", ckpt.META_FILE, "use another checkpoint"))
    args, data, config = meta.get("model_args"), meta.get("data") or {}, meta.get("config") or {}
    problems = [f"model_args: {problem}" for problem in args_problems(args)]
    if not isinstance(data, dict):
        problems.append("data is not an object")
    if not isinstance(config, dict):
        problems.append("config is not an object")
    elif not isinstance(config.get("data") or "", str):  # evaluate's and export's data set without --data
        problems.append(f"config.data {short_repr(config['data'])} is not a path")
    if not problems:
        channels, k = args["in_channels"], args["num_classes"]
        classes = data.get("classes") or [str(i) for i in range(k)]
        norm = data.get("normalize") or {"mean": [0.5] * channels, "std": [0.5] * channels}
        image_shape = data.get("image_shape") or [28, 28, channels]
        problems = _data_problems(classes, norm, image_shape, channels, k)
        preset = None if problems else preset_of(meta)  # by the image shape where none is named
        if preset not in (None, *PRESETS):
            problems.append(f"preset {short_repr(preset)} is not one of {', '.join(PRESETS)}")
    if problems:
        raise ImgtrainError(f"{what} {path}: {record} {'; '.join(problems)}; {remedy}")
    return Preprocess(
        image_shape=tuple(image_shape),
        mean=tuple(norm["mean"]), std=tuple(norm["std"]), classes=tuple(str(c) for c in classes),
        channels_last=bool(config.get("channels_last", False)),
        preset=preset,
    )


def _data_problems(classes, norm, image_shape, channels: int, k: int) -> list[str]:
    """What meta.json says of the data (untrusted), held to a data set's own bounds
    (``format.manifest_problems``): the server sizes its pixel cap and every batch by the image shape."""
    issues = []
    if not isinstance(classes, list) or len(classes) != k:
        issues.append(f"data.classes names {len(classes) if isinstance(classes, list) else 'no'} classes "
                      f"but its model has {k} outputs")
    if not (isinstance(norm, dict) and all(isinstance(norm.get(key), list) and len(norm[key]) == channels
                                           and all(_unit_number(v) for v in norm[key]) for key in ("mean", "std"))
            and 0 not in norm["std"]):
        issues.append(f"data.normalize {short_repr(norm)} is not a mean in [0, 1] and a std in (0, 1] "
                      f"for each of its model's {channels} channel(s)")
    ints = isinstance(image_shape, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in image_shape)
    if (not ints or len(image_shape) != 3 or image_shape[2] != channels
            or not all(1 <= v <= MAX_IMAGE_SIDE for v in image_shape[:2])
            or image_shape[0] * image_shape[1] > MAX_IMAGE_PIXELS):
        issues.append(f"data.image_shape {short_repr(image_shape)} is not one its {channels}-channel model can "
                      f"take (1 to {MAX_IMAGE_SIDE} px a side, {MAX_IMAGE_PIXELS:,} pixels in all)")
    return issues


def _unit_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1


def preset_of(meta: dict) -> str:
    config, data = meta.get("config") or {}, meta.get("data") or {}
    preset = config.get("preset") if config.get("preset") not in (None, "auto") else data.get("preset")
    return preset or default_preset(data.get("image_shape"))
