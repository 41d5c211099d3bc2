"""Photos decoded and augmented on the training device (``--decode gpu``), and when ``auto``
chooses it.

With ``--decode gpu`` the decoding tasks send a rank its rows' JPEG bytes and each row's random
numbers instead of pixels (``stream.read_task``); the worker decodes a batch at once with
nvJPEG (``torchvision.io.decode_jpeg(list, device=...)``), crops, resizes and flips every image
with two batched matrix products per image size, and runs the photo policies with torchvision
v2 on the device tensors. What decides the pixels is the CPU path's:

* the crop region and flip: ``images.crop_box`` / ``images.flipped`` (evaluation:
  ``images.center_box``) of the same draws (``images.photo_draw``);
* the resize: Pillow's bilinear box resize, antialiased, its filter weights computed as Pillow
  computes them (``pil_bilinear_weights``, fixed-point rounding included) and applied as Pillow
  does (rows, rounded to 8 bits, then columns);
* the policies: ``photo_augment.apply_tensor`` with each image's seed (``image_seeds``).

Rows a plain JPEG decoder would not turn into Pillow's pixels (PNG, EXIF, CMYK, a colour JPEG
for a gray model; for evaluation, JPEGs Pillow decodes at reduced scale) are decoded and cropped
by the CPU path in the tasks, as today, and arrive as pixels. Runs on any torch device: the
tests run it with ``device="cpu"``.
"""

from __future__ import annotations

import math
import warnings

import numpy as np

from imgtrain.data import images, photo_augment

# Images/s one decoding CPU delivers per --augment-policy (96x96 JPEGs, crop + flip first), and
# the pace of one GPU the table was sized for: BENCHMARKS.md, "Decoding per CPU and augmentation
# policy" (bench/decode_policies.py, 2026-11-26) and "Photos on one GPU worker" (an H200 training
# ResNet-18 at about 12,000 images/s). Update both together when they are measured again.
DECODE_IMAGES_PER_CPU = {"none": 7806, "randaugment": 1513, "trivialaugment": 1944, "autoaugment": 1982}
GPU_IMAGES_PER_S = 12000
# Pixels of one image size resized at once: float32 copies of the batch stay under 256 MB.
CHUNK_VALUES = 64 << 20
# Decoded bytes held on the device at once: a batch of 256 twelve-megapixel photos is 9 GB decoded,
# so nvJPEG gets the batch in parts of at most this much.
DECODE_BYTES = 1 << 30
_PRECISION_BITS = 32 - 8 - 2  # Pillow's fixed-point filter weights (libImaging/Resample.c)


def cpus_needed(policy: str) -> int:
    """Decoding CPUs one GPU needs to be fed with ``policy`` (BENCHMARKS.md's table): 2 with the
    crop and flip alone, 8 with RandAugment, 7 with TrivialAugment or AutoAugment."""
    return math.ceil(GPU_IMAGES_PER_S / DECODE_IMAGES_PER_CPU[policy])


def choose(setting: str, gpus: int, cpus: float, policy: str, worker_cpus: float = 1.0) -> str:
    """Where a run decodes its photos: ``setting`` unless it is ``auto``; ``auto`` decodes on the
    GPU when each GPU has fewer decoding CPUs (the ``cpus`` left once each of the ``gpus``
    training workers holds ``worker_cpus``) than ``policy`` needs, on the CPUs otherwise, and
    always on CPU-only workers (``gpus`` 0). Colour jitter and erasing count as their policy's
    row (not measured alone)."""
    if setting != "auto":
        return setting
    if gpus <= 0:
        return "cpu"
    per_gpu = (cpus - gpus * worker_cpus) / gpus
    return "gpu" if per_gpu < cpus_needed(policy) else "cpu"


# ---------------------------------------------------------------- the resize, as Pillow does it


def pil_bilinear_weights(in_size: int, out_size: int, lo, hi) -> np.ndarray:
    """[..., out_size, in_size] weights of Pillow's bilinear resize of the span [lo, hi) of an
    axis of ``in_size`` pixels (``Image.resize(..., box=...)``), for each of the spans ``lo`` and
    ``hi`` hold (numbers or arrays of one shape): a triangle filter widened by the scale when
    shrinking (antialiasing), normalised per output pixel and rounded to Pillow's fixed point
    (libImaging/Resample.c, ``precompute_coeffs`` and ``normalize_coeffs_8bpc``)."""
    lo, hi = np.asarray(lo, np.float64)[..., None], np.asarray(hi, np.float64)[..., None]
    scale = (hi - lo) / out_size
    filter_scale = np.maximum(scale, 1.0)  # the bilinear filter's support (1) widened alike
    center = lo + (np.arange(out_size) + 0.5) * scale  # [..., out]
    first = np.maximum(np.trunc(center - filter_scale + 0.5), 0)[..., None]
    last = np.minimum(np.trunc(center + filter_scale + 0.5), in_size)[..., None]
    x = np.arange(in_size)
    weights = np.clip(1.0 - np.abs((x - center[..., None] + 0.5) / filter_scale[..., None]), 0.0, None)
    weights *= (x >= first) & (x < last)
    total = weights.sum(axis=-1, keepdims=True)
    weights = np.divide(weights, total, out=np.zeros_like(weights), where=total != 0)
    one = float(1 << _PRECISION_BITS)
    return np.trunc(weights * one + 0.5) / one  # the weights are never negative


def resize_boxes(batch, boxes: np.ndarray, flips: np.ndarray, shape: tuple[int, int]):
    """uint8 [n, C, h, w] (one image size) -> uint8 [n, C, H, W]: each image's box (x0, y0, x1,
    y1; ``boxes`` [n, 4]) resized to ``shape`` as Pillow's bilinear resize does (rows first,
    rounded to 8 bits, then columns), mirrored where ``flips`` says (its columns' weights in
    reverse). Two batched matrix products."""
    import torch

    n, _, h, w = batch.shape
    boxes, flips = np.asarray(boxes, np.float64).reshape(n, 4), np.asarray(flips, bool).reshape(n)
    rows = pil_bilinear_weights(h, shape[0], boxes[:, 1], boxes[:, 3])  # [n, H, h]
    cols = pil_bilinear_weights(w, shape[1], boxes[:, 0], boxes[:, 2])  # [n, W, w]
    cols[flips] = cols[flips, ::-1]
    rows = torch.from_numpy(rows.astype(np.float32)).to(batch.device)
    cols = torch.from_numpy(cols.astype(np.float32)).to(batch.device)
    wide = torch.matmul(batch.float(), cols.transpose(1, 2).unsqueeze(1))  # [n, C, h, W]
    wide = wide.add_(0.5).floor_().clamp_(0, 255)
    out = torch.matmul(rows.unsqueeze(1), wide)  # [n, C, H, W]
    return out.add_(0.5).floor_().clamp_(0, 255).to(torch.uint8)


# ---------------------------------------------------------------- a batch, on the device


def batch_images(batch: dict, reader, device):
    """uint8 [B, H, W, C] on ``device`` from a batch of ``source`` (JPEG bytes, or uint8 [H, W, C]
    pixels the tasks decoded), ``draw`` (training's random numbers; absent: evaluation's
    centre crop) and ``seed`` (each image's policy seed; absent: no policy)."""
    import torch

    h, w, c = reader.shape
    sources, draws = batch["source"], batch.get("draw")
    out = torch.empty((len(sources), c, h, w), dtype=torch.uint8, device=device)
    jpegs = [i for i, s in enumerate(sources) if isinstance(s, bytes)]
    for i, source in enumerate(sources):
        if not isinstance(source, bytes):  # the CPU path's pixels
            out[i] = torch.from_numpy(np.array(source)).permute(2, 0, 1).to(device)  # a copy: may be read-only
    for part in _parts(jpegs, sources, c):
        _decode_into(out, part, sources, draws, reader, device)
    if "seed" in batch:
        for i, seed in enumerate(batch["seed"]):
            out[i] = photo_augment.apply_tensor(reader.photo_augment, out[i], int(seed))
    return out.permute(0, 2, 3, 1).contiguous()


def _parts(rows: list[int], sources, channels: int) -> list[list[int]]:
    """``rows`` in parts of at most DECODE_BYTES decoded (sizes from the JPEG headers)."""
    import simplejpeg

    parts, held = [], DECODE_BYTES
    for i in rows:
        height, width, _, _ = simplejpeg.decode_jpeg_header(sources[i])
        size = height * width * channels
        if held + size > DECODE_BYTES:
            parts.append([])
            held = 0
        parts[-1].append(i)
        held += size
    return parts


def _decode_into(out, rows: list[int], sources, draws, reader, device) -> None:
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    h, w, c = reader.shape
    mode = ImageReadMode.RGB if c == 3 else ImageReadMode.GRAY
    with warnings.catch_warnings():  # torchvision 0.29 marks its decoders deprecated for TorchCodec, not a dependency
        warnings.simplefilter("ignore", DeprecationWarning)
        decoded = decode_jpeg([torch.frombuffer(bytearray(sources[i]), dtype=torch.uint8) for i in rows],
                              mode=mode, device=device)
    by_size: dict[tuple, list[int]] = {}
    for k, image in enumerate(decoded):
        by_size.setdefault(tuple(image.shape[-2:]), []).append(k)
    for (ih, iw), members in by_size.items():
        step = max(1, CHUNK_VALUES // (c * ih * max(iw, w)))
        for start in range(0, len(members), step):
            chunk = members[start:start + step]
            boxes = np.array([images.center_box((iw, ih), (h, w)) if draws is None
                              else images.crop_box((iw, ih), draws[rows[k]], reader.crop_min_area) for k in chunk])
            flips = [draws is not None and images.flipped(draws[rows[k]]) for k in chunk]
            resized = resize_boxes(torch.stack([decoded[k] for k in chunk]), boxes, flips, (h, w))
            out[[rows[k] for k in chunk]] = resized
