"""Decoding one image file safely, the same way everywhere (prepare, predict, serve).

Image files are untrusted input. Pillow would open any format it has a plugin for (a GIF
named .png, EPS through Ghostscript where that is installed) and decode images of any size
(a 64 KiB PNG can hold 16.7 megapixels, ~80 MiB decoded). Here only PNG and JPEG are opened,
the pixel count is checked from the header before any pixel is decoded, and 16-bit
grayscale PNGs are scaled to 8 bits (``convert("L")`` would saturate them: a full ramp
became 99.5 % white).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
FORMATS = ("PNG", "JPEG")
# Above this a file is refused rather than decoded (prepare, predict): 50 MP is a large
# camera photo, ~150 MiB as RGB. The server uses a much smaller cap (serve.py).
MAX_DECODE_PIXELS = 50_000_000
# PIL modes with a single colour channel ('LA' = gray + alpha).
GRAY_MODES = frozenset({"1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "I;16N", "F"})
_SIXTEEN_BIT_MODES = frozenset({"I;16", "I;16B", "I;16L", "I;16N"})


class ImageRejected(ValueError):
    """The bytes are not a PNG/JPEG image imgtrain will decode (the message says why)."""


class ImageTooLarge(ImageRejected):
    """A PNG/JPEG image with more pixels than the caller allows."""


def open_image(src: bytes | bytearray | str | Path, max_pixels: int = MAX_DECODE_PIXELS):
    """A PIL image opened lazily from a path or bytes: PNG or JPEG only, at most
    ``max_pixels`` pixels (checked from the header, before decoding). Raises ImageRejected."""
    from PIL import Image, UnidentifiedImageError

    stream = io.BytesIO(src) if isinstance(src, (bytes, bytearray)) else src
    try:
        im = Image.open(stream, formats=list(FORMATS))
    except UnidentifiedImageError:
        raise ImageRejected("not a PNG or JPEG image") from None
    except Image.DecompressionBombError as e:  # Pillow's own, far larger, limit
        raise ImageRejected(str(e)) from None
    w, h = im.size
    if w * h > max_pixels:
        im.close()
        raise ImageTooLarge(f"{w}x{h} pixels is over the limit of {max_pixels:,} pixels")
    return im


def oriented_size(im) -> tuple[int, int]:
    """(H, W) after applying the EXIF orientation (phone photos are often stored rotated)."""
    w, h = im.size
    try:
        rotated = im.getexif().get(0x0112) in (5, 6, 7, 8)
    except Exception:  # a broken EXIF block: the stored orientation
        rotated = False
    return (w, h) if rotated else (h, w)


def to_mode(im, channels: int):
    """Oriented and converted to 8-bit ``L`` (1 channel) or ``RGB`` (3 channels)."""
    from PIL import Image, ImageOps

    im = ImageOps.exif_transpose(im)
    if im.mode in _SIXTEEN_BIT_MODES:  # 0..65535 -> 0..255, not clipped at 255
        pixels = np.asarray(im, dtype=np.uint32)
        im = Image.fromarray(((pixels * 255 + 32767) // 65535).astype(np.uint8), mode="L")
    return im.convert("L" if channels == 1 else "RGB")


def conform_image(im, image_shape) -> tuple[np.ndarray, bool]:
    """A PIL image -> uint8 [H, W, C] in the model's shape (bilinear resize, L/RGB); True when
    it had to be converted. JPEGs far larger than the target are decoded at 1/2 to 1/8 scale."""
    from PIL import Image

    h, w, c = image_shape
    mode = "L" if c == 1 else "RGB"
    changed = im.mode != mode or im.size != (w, h)
    if im.format == "JPEG" and changed:
        im.draft(mode, (w, h))  # the decoder's own downscaling: less memory and time
    im = to_mode(im, c)
    if im.size != (w, h):
        im = im.resize((w, h), Image.Resampling.BILINEAR)
    return np.asarray(im, dtype=np.uint8).reshape(h, w, c), changed
