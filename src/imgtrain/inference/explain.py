"""Where the model looked: a Grad-CAM map of the predicted class for each image (captum's
``LayerGradCam``), and how it is shown (a heat colour map blended over the image).

The map is Grad-CAM's (Selvaraju et al., 2017) on the model's last feature map of at least 4x4
positions: for the CNNs (imgtrain's ResNet-18, torchvision's and timm's) the last stage's output
(7x7 at 224 px); where the images are so small that the last stage is 2x2 or less, which would
only name a quadrant, an earlier one (28x28 digits through ResNet-18's standard stem: layer2's
4x4). A channels-last map (a Swin's, timm's or torchvision's) is read as [N, C, h, w].
A vision transformer (torchvision's and timm's ViT) has no map: its patch tokens going into the
last block are laid out on the patch grid and read as one (Grad-CAM on the last block, the class
and register tokens left out); after the last block only the class token reaches the head, so
the tokens there carry no gradient. The map is the ReLU of Grad-CAM, upsampled bilinearly to the
model's input and divided by its maximum: values in [0, 1], 1 where the class's evidence is
strongest (all 0 when there is none). With ``--tta flip`` it is the mean of the image's map and
its mirror image's, mirrored back, as the probabilities are.

The images go through the served model's own preprocessing (``Preprocess``) at the model's input
size; ``source_map`` puts the map back on the image as it was given (the photos preset's centre
crop: 0 outside the part the model saw). Only a PyTorch model has gradients: an export (ONNX...)
cannot be explained (``NEEDS_CHECKPOINT``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from imgtrain.errors import ImgtrainError
from imgtrain.inference.preprocess import LoadedCheckpoint

# Pixels per Grad-CAM pass: the backward keeps every activation of the chunk (a ResNet-50 at
# 224x224: about 100 MB an image), so predict's --batch-size of 500 is explained in chunks: 16 images
# of 224x224, 196 of 64x64 (small chunks of small images cost more per image: 16 at a time took
# 7 times a forward pass on 64x64 digits).
EXPLAIN_PIXELS = 16 * 224 * 224
# A map of fewer positions a side only tells the quadrant: on small images (the last stage of a ResNet
# on 64x64 inputs is 2x2) Grad-CAM reads the last one of at least this many, a stage earlier.
MIN_MAP_SIDE = 4
BLEND = 0.5  # the overlay: half the image, half the colour map (pytorch-grad-cam's default too)
COLOUR_MAP = "jet"  # red: the most, blue: none; Grad-CAM's usual look
NEEDS_CHECKPOINT = ("explanations need the PyTorch checkpoint (Grad-CAM takes the model's gradients); an export "
                    "served with another --engine has none: serve or predict the run itself for maps")


@dataclass
class Target:
    """Where Grad-CAM reads: ``layer``; ``layout`` says how its tensor becomes [N, C, h, w]:
    ``nchw`` as it is, ``nhwc`` permuted, ``tokens`` (the input of a transformer's last block,
    ``prefix`` class/register tokens first) laid out on the ``grid`` of patches."""

    layer: object  # torch.nn.Module
    layout: str
    prefix: int = 0
    grid: tuple[int, int] = (0, 0)


def find_target(model, image_shape) -> Target:
    """The layer Grad-CAM reads for ``model`` (eval mode) on images of ``image_shape`` (H, W, C)."""
    import torch
    import torch.nn as nn

    h, w, c = image_shape
    blocks = _transformer_blocks(model)
    if blocks is not None:  # torchvision's ViT: 1 class token; timm's: class and register tokens
        prefix = int(getattr(model, "num_prefix_tokens", 1))
        return Target(blocks[-1], "tokens", prefix, _patch_grid(model, blocks[-1], (h, w, c), prefix))
    # Swin's maps are channels-last: timm's says so; torchvision's until its last step, a Permute to NCHW,
    # which is passed over with them (on small images its earlier maps are read, all channels-last)
    nhwc = getattr(model, "output_fmt", "NCHW") == "NHWC" or type(model).__name__ == "SwinTransformer"
    fired: list[tuple[nn.Module, tuple]] = []
    calls: dict[nn.Module, int] = {}

    def record(module, _inputs, output):
        calls[module] = calls.get(module, 0) + 1
        if isinstance(output, torch.Tensor) and output.ndim == 4:
            fired.append((module, tuple(output.shape)))

    hooks = [m.register_forward_hook(record) for m in model.modules() if m is not model]
    try:
        with torch.no_grad():
            model(torch.zeros(1, c, h, w, device=_device(model)))
    finally:
        for hook in hooks:
            hook.remove()
    pools = (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)
    # From a module run once (a shared ReLU is run by every block: captum reads a layer's one
    # output); containers fire after their children, so a stage is found before its last layer.
    maps = [(module, min(shape[1:3] if nhwc else shape[2:])) for module, shape in fired
            if calls[module] == 1 and not isinstance(module, pools)
            and not (nhwc and type(module).__name__ == "Permute")]
    for smallest in (MIN_MAP_SIDE, 2):  # the last map of at least 4x4 positions, else of 2x2
        for module, side in reversed(maps):
            if side >= smallest:
                return Target(module, "nhwc" if nhwc else "nchw")
    raise ImgtrainError(f"{type(model).__name__} has no feature map of more than one position on {h}x{w} images: "
                        "nothing to place an explanation on")


def _transformer_blocks(model):
    """A vision transformer's blocks (torchvision's encoder.layers, timm's blocks), else None."""
    encoder = getattr(model, "encoder", None)
    if hasattr(model, "class_token") and encoder is not None and hasattr(encoder, "layers"):
        return encoder.layers
    if hasattr(model, "num_prefix_tokens") and hasattr(model, "patch_embed") and hasattr(model, "blocks"):
        return model.blocks
    return None


def _patch_grid(model, block, image_shape, prefix: int) -> tuple[int, int]:
    """(rows, columns) of patch tokens going into ``block``, found by running the model once."""
    import torch

    h, w, c = image_shape
    seen = {}

    def count(_module, args):  # returns None: the block's input is left as it is
        seen["tokens"] = args[0].shape[1]

    hook = block.register_forward_pre_hook(count)
    try:
        with torch.no_grad():
            model(torch.zeros(1, c, h, w, device=_device(model)))
    finally:
        hook.remove()
    patches = seen["tokens"] - prefix
    rows = max(1, round((patches * h / w) ** 0.5))
    if rows * (patches // rows) != patches:
        raise ImgtrainError(f"{type(model).__name__}: {patches} patch tokens do not lay out on a grid of "
                            f"{h}x{w} images: nothing to place an explanation on")
    return rows, patches // rows


def _device(model):
    return next(model.parameters()).device


class Explainer:
    """Grad-CAM maps of a loaded checkpoint's model, for the classes asked (the predicted ones)."""

    def __init__(self, loaded: LoadedCheckpoint, tta: str = "none", device: str = "cpu"):
        if hasattr(loaded.model, "probabilities"):  # an export's engine (onnx_engine.OnnxModel): no gradients
            raise ImgtrainError(NEEDS_CHECKPOINT)
        import torch.nn as nn
        from captum.attr import LayerGradCam

        self.loaded, self.tta, self.device = loaded, tta, device
        self.target = find_target(loaded.model, loaded.preprocess.image_shape)
        self.grid = nn.Identity()  # what Grad-CAM reads where the layer's own output is not [N, C, h, w]
        read = self.target.layer if self.target.layout == "nchw" else self.grid
        self.cam = LayerGradCam(loaded.model, read)

    def maps(self, images: np.ndarray, classes) -> np.ndarray:
        """uint8 images [B, H, W, C] and a class index for each -> float32 maps [B, H, W] in [0, 1]."""
        import torch

        preprocess = self.loaded.preprocess
        h, w, _ = preprocess.image_shape
        classes = torch.as_tensor(np.array(classes, dtype=np.int64), device=self.device)  # a copy: writable
        out = np.zeros((len(images), h, w), np.float32)
        chunk = max(1, EXPLAIN_PIXELS // (h * w))
        with self._grid_hook(), torch.enable_grad():
            for start in range(0, len(images), chunk):
                x = preprocess(images[start:start + chunk], self.device)
                target = classes[start:start + chunk]
                cam = self._cam(x, target)
                if self.tta == "flip":  # as the probabilities: the mean over the image and its mirror image
                    mirrored = x.flip(-1)
                    if preprocess.channels_last:
                        mirrored = mirrored.contiguous(memory_format=torch.channels_last)
                    cam = (cam + self._cam(mirrored, target).flip(-1)) / 2
                out[start:start + len(x)] = _unit(cam).cpu().numpy()
        return out

    def _cam(self, x, target):
        """[b, 1, H, W]: Grad-CAM's ReLU, upsampled bilinearly to the model's input."""
        from captum.attr import LayerAttribution

        cam = self.cam.attribute(x, target=target, relu_attributions=True)
        return LayerAttribution.interpolate(cam.detach().float(), tuple(x.shape[-2:]), interpolate_mode="bilinear")

    def _grid_hook(self):
        """For the duration of ``maps``, the target's tensor passed through ``self.grid`` as
        [N, C, h, w] (and back), so that Grad-CAM reads it; nothing for an [N, C, h, w] layer. Only
        while explaining: the same model predicts without it."""
        import contextlib

        import torch

        target, grid = self.target, self.grid
        if target.layout == "nhwc":
            hook = target.layer.register_forward_hook(
                lambda _m, _i, out: grid(out.permute(0, 3, 1, 2)).permute(0, 2, 3, 1))
        elif target.layout == "tokens":
            rows, columns = target.grid

            def tokens_through_grid(_module, args):
                x = args[0]
                n, _, d = x.shape
                patches = grid(x[:, target.prefix:].transpose(1, 2).reshape(n, d, rows, columns))
                patches = patches.reshape(n, d, rows * columns).transpose(1, 2)
                return (torch.cat([x[:, :target.prefix], patches], dim=1), *args[1:])

            hook = target.layer.register_forward_pre_hook(tokens_through_grid)
        else:
            return contextlib.nullcontext()
        return hook  # torch's RemovableHandle: removed when the ``with`` ends


def _unit(cam):
    """[b, 1, H, W] -> [b, H, W], each divided by its maximum (0 stays 0)."""
    import torch

    cam = cam[:, 0].clamp_min(0)
    peak = cam.flatten(1).amax(1)[:, None, None]  # gradients of an untrained model can be 1e-14: still a peak
    return torch.where(peak > 0, cam / peak.clamp_min(torch.finfo(cam.dtype).tiny), 0.0)


# ---------------------------------------------------------------- the map on the image as given


def crop_box(source_hw, image_shape, preset: str) -> tuple[float, float, float, float]:
    """(x0, y0, width, height) of the part of an image of ``source_hw`` (H, W) that the model's
    input shows: all of it for the digits preset's resize; the photos preset's centre crop
    (``images.center_box``) otherwise."""
    from imgtrain.data.images import center_box

    sh, sw = source_hw
    if preset != "photos":
        return 0.0, 0.0, float(sw), float(sh)
    x0, y0, x1, y1 = center_box((sw, sh), image_shape[:2])
    return x0, y0, x1 - x0, y1 - y0


def source_map(cam: np.ndarray, source_hw, image_shape, preset: str) -> np.ndarray:
    """A map at the model's input size [H, W] -> float32 [H', W'] on the image as given (its size
    ``source_hw``): resized bilinearly onto the part the model saw, 0 elsewhere, and divided by its
    maximum again."""
    from PIL import Image

    sh, sw = source_hw
    x0, y0, cw, ch = crop_box(source_hw, image_shape, preset)
    width, height = max(1, round(cw)), max(1, round(ch))
    placed = np.asarray(Image.fromarray(cam.astype(np.float32), mode="F").resize((width, height),
                                                                                Image.Resampling.BILINEAR))
    out = np.zeros((sh, sw), np.float32)
    left, top = round(x0), round(y0)
    out[top:top + height, left:left + width] = placed[:sh - top, :sw - left]
    peak = out.max()  # resizing can fall between the map's samples: 1 stays where the evidence is strongest
    return np.clip(out / peak, 0.0, 1.0) if peak > 0 else out


def overlay(image: np.ndarray, cam: np.ndarray) -> np.ndarray:
    """uint8 [H, W, 3] (or [H, W, 1] gray): ``cam`` [H, W] in the heat colour map blended over ``image``."""
    from matplotlib import colormaps

    rgb = np.repeat(image, 3, axis=2) if image.shape[-1] == 1 else image
    heat = colormaps[COLOUR_MAP](cam, bytes=True)[..., :3]
    return ((1 - BLEND) * rgb + BLEND * heat).round().astype(np.uint8)


def png(pixels: np.ndarray) -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels[..., 0] if pixels.ndim == 3 and pixels.shape[-1] == 1 else pixels).save(buffer, "PNG")
    return buffer.getvalue()


def source_image(item) -> np.ndarray:
    """An image file or PNG/JPEG bytes as the user gave it: uint8 [H, W, 3], EXIF orientation applied."""
    from imgtrain.data.images import open_image, read_image_file, to_mode

    data = item if isinstance(item, (bytes, bytearray)) else read_image_file(item)
    with open_image(data) as im:
        return np.asarray(to_mode(im, 3), dtype=np.uint8)


# ---------------------------------------------------------------- predict --explain DIR


def check_explain_dir(folder, overwrite: bool) -> Path:
    """``--explain DIR``: a new or empty folder (or ``--overwrite``), checked before any work."""
    folder = Path(folder).expanduser()
    if folder.exists() and not folder.is_dir():
        raise ImgtrainError(f"--explain {folder} is a file; name a folder for the maps")
    if folder.is_dir() and any(folder.iterdir()) and not overwrite:
        raise ImgtrainError(f"--explain {folder} already holds files; pass --overwrite or another folder")
    return folder


def file_stem(row: int, path: str | None, image_id) -> str:
    """``000042-cat``: the input's row (unique, in input order) and its file's name or its id."""
    name = Path(path).stem if path else f"id{image_id}"
    return f"{row:06d}-{name}"


def write_explanations(frame, folder: Path, image_shape, preset: str) -> list[str]:
    """Write each row's overlay ``STEM.png`` and map ``STEM.npy`` into ``folder``; return the PNGs'
    names. ``frame``: a predictions batch with ``explain_map`` (the map at the model's size) and
    ``image`` (the image as the model saw it). An image file gets both at its own size, over the
    file as it is; a row of a data set or Parquet table at the model's size, over the image the
    model saw (as does a file that can no longer be read: it changed since it was predicted)."""
    from imgtrain.data.images import ImageRejected
    from imgtrain.inference.inputs import ROW_KEY

    paths = frame["path"] if "path" in frame else [None] * len(frame)
    ids = frame["id"] if "id" in frame else [None] * len(frame)
    names = []
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for row, path, image_id, cam, seen in zip(frame[ROW_KEY], paths, ids, frame["explain_map"], frame["image"]):
            image = seen
            if path:
                try:
                    image = source_image(path)
                    cam = source_map(cam, image.shape[:2], image_shape, preset)
                except (ImageRejected, OSError, ValueError):
                    image = seen
            stem = file_stem(int(row), path, image_id)
            np.save(folder / f"{stem}.npy", np.asarray(cam, np.float32))
            (folder / f"{stem}.png").write_bytes(png(overlay(image, cam)))
            names.append(f"{stem}.png")
    except OSError as e:
        raise ImgtrainError(f"cannot write the explanations into {folder}: {e.strerror or e}") from None
    return names


# ---------------------------------------------------------------- serve's POST /explain


def explanation_view(cam: np.ndarray, image: np.ndarray, converted: bool, image_shape, preset: str) -> dict:
    """What ``/explain`` answers for one image: the map at the size of ``image`` (the image as sent;
    ``converted``: it was an image file the server converted, so the map is put back on it) as an
    overlay PNG and as a grayscale PNG (255: the map's 1), both base64."""
    import base64

    if converted:
        cam = source_map(cam, image.shape[:2], image_shape, preset)
    encode = lambda pixels: base64.b64encode(png(pixels)).decode("ascii")  # noqa: E731
    return {"size": list(cam.shape), "overlay_png": encode(overlay(image, cam)),
            "map_png": encode((cam * 255).round().astype(np.uint8))}
