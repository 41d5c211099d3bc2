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
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from imgtrain.errors import one_line

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
FORMATS = ("PNG", "JPEG")
# Above this a file is refused rather than decoded (prepare, predict): 50 MP is a large
# camera photo, ~150 MiB as RGB. The server uses a much smaller cap (serve.py).
MAX_DECODE_PIXELS = 50_000_000
# Above this an image file is refused from its size, before it is read (prepare, predict): 8 bytes
# a pixel at the pixel cap is a 16-bit RGBA PNG stored uncompressed, the largest an image the cap
# lets through can be, plus 16 MiB of metadata. A larger file only pads (a 6 GiB sparse .png,
# read whole, ended prepare in a MemoryError).
MAX_FILE_BYTES = MAX_DECODE_PIXELS * 8 + (16 << 20)
# PIL modes with a single colour channel ('LA' = gray + alpha).
GRAY_MODES = frozenset({"1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "I;16N", "F"})
_SIXTEEN_BIT_MODES = frozenset({"I;16", "I;16B", "I;16L", "I;16N"})


class ImageRejected(ValueError):
    """The bytes are not a PNG/JPEG image imgtrain will decode (the message says why)."""


class ImageTooLarge(ImageRejected):
    """A PNG/JPEG image with more pixels than the caller allows."""


class ImageDamaged(ImageRejected):
    """A PNG/JPEG whose pixel data does not decode: truncated, or corrupt."""


def damage(error: Exception, fmt: str | None) -> ImageDamaged:
    """What a decoder's failure says about the file, in words: Pillow raises a bare OSError for
    a truncated file ("image file is truncated"), and its type alone told the user nothing."""
    text = one_line(error, 160)
    kind = fmt or "image"
    if "truncated" in text.lower():
        return ImageDamaged(f"truncated {kind}: {text}")
    return ImageDamaged(f"damaged {kind}: {text or type(error).__name__}")


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


def read_image_file(path) -> bytes:
    """The bytes of an image file a user named. Raises ImageRejected for a path that is not a
    regular file (a FIFO blocks its reader, a device never ends: neither is opened), for a file
    over MAX_FILE_BYTES (refused from its size, never read whole) and for a read error."""
    try:
        _check_regular(os.stat(path))  # follows links, as open does: a linked image is read
        # O_NONBLOCK and fstat: a FIFO put in its place since the stat cannot block the open
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
            _check_regular(os.fstat(f.fileno()))
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise ImageRejected(f"cannot be read ({e.strerror or type(e).__name__})") from None
    if len(data) > MAX_FILE_BYTES:  # it grew since the stat
        raise ImageRejected(f"larger than the limit of {MAX_FILE_BYTES:,} bytes for an image file")
    return data


_NOT_REGULAR = {stat.S_IFDIR: "a folder", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket",
                stat.S_IFCHR: "a device", stat.S_IFBLK: "a device"}


def _check_regular(info: os.stat_result) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise ImageRejected(f"not a regular file ({_NOT_REGULAR.get(stat.S_IFMT(info.st_mode), 'special')})")
    if info.st_size > MAX_FILE_BYTES:
        raise ImageRejected(f"{info.st_size:,} bytes is over the limit of {MAX_FILE_BYTES:,} bytes for an image file")


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

    fmt = im.format
    try:
        im = ImageOps.exif_transpose(im)
        if im.mode in _SIXTEEN_BIT_MODES:  # 0..65535 -> 0..255, not clipped at 255
            pixels = np.asarray(im, dtype=np.uint32)
            im = Image.fromarray(((pixels * 255 + 32767) // 65535).astype(np.uint8), mode="L")
        return im.convert("L" if channels == 1 else "RGB")  # decodes every pixel
    except (OSError, SyntaxError, ValueError, EOFError) as e:  # what Pillow's decoders raise for bad data
        raise damage(e, fmt) from None


def conform_image(im, image_shape, preset: str = "digits") -> tuple[np.ndarray, bool]:
    """A PIL image -> uint8 [H, W, C] in the model's shape with its evaluation transform (digits:
    a bilinear resize; photos: resize and centre crop), L/RGB; True when it had to be converted.
    JPEGs far larger than the target are decoded at 1/2 to 1/8 scale."""
    h, w, c = image_shape
    mode = "L" if c == 1 else "RGB"
    changed = im.mode != mode or im.size != (w, h) or preset == "photos"  # photos: always the centre crop
    if im.format == "JPEG" and changed:
        side = eval_draft_side((h, w)) if preset == "photos" else max(h, w)
        im.draft(mode, (side, side))  # the decoder's own downscaling: less memory and time
    im = to_mode(im, c)
    if preset == "photos":
        im = center_crop(im, (h, w))  # as validation in training saw them
    elif im.size != (w, h):
        im = im.resize((w, h), _bilinear())
    return np.asarray(im, dtype=np.uint8).reshape(h, w, c), changed


def eval_draft_side(shape: tuple[int, int]) -> int:
    """The side a photo's JPEG is decoded down towards for evaluation (``Image.draft``): Pillow
    decodes at 1/2, 1/4 or 1/8 scale while both sides stay at least this long."""
    return int(max(shape) / EVAL_CROP) + 1


def eval_draft_shrinks(size_hw: tuple[int, int], shape: tuple[int, int]) -> bool:
    """Whether evaluation's ``draft`` decodes a JPEG of ``size_hw`` (H, W) at a reduced scale
    (Pillow's rule: the smaller of the two side ratios is at least 2)."""
    side = eval_draft_side(shape)
    return min(size_hw[0] // side, size_hw[1] // side) >= 2


# ---------------------------------------------------------------- checking images at prepare time


@dataclass
class Checked:
    """One image as ``data prepare`` found it: the bytes to store (None: unreadable, ``reason``
    says why), its size after EXIF orientation, whether it is grayscale, and pixel statistics
    (rows: mean and mean of squares, columns: R, G, B, L; values in [0, 1])."""

    data: bytes | None
    reason: str = ""
    height: int = 0
    width: int = 0
    gray: bool = True
    stats: np.ndarray | None = None
    upscaled: float = 1.0  # how much --size enlarged it (the larger of the two sides' factors); 1: not at all


def check_chunk(chunk, size: tuple[int, int] | None) -> list[Checked]:
    """Check every image of a ``listing.Chunk`` (runs in the preparation pool)."""
    return [check_image(data, size) for data in chunk.read()]


def read_image_files(paths: list[str]):
    """The bytes of each image file, or the reason there are none (a ``Chunk.read`` of files)."""
    for path in paths:
        if Path(path).suffix.lower() not in IMAGE_SUFFIXES:
            yield ImageRejected("not a .png/.jpg/.jpeg file")
            continue
        try:
            yield read_image_file(path)
        except ImageRejected as e:
            yield e


def check_image(data, size: tuple[int, int] | None) -> Checked:
    """Open (PNG/JPEG only, pixel cap), decode fully once (a truncated file shows only then),
    measure, and re-encode at ``size`` (H, W) when asked."""
    if isinstance(data, ImageRejected):
        return Checked(None, str(data))
    try:
        with open_image(data) as im:
            fmt, (h, w) = im.format, oriented_size(im)
            gray = im.mode in GRAY_MODES
            im = to_mode(im, 1 if gray else 3)  # decodes every pixel
            stats = _statistics(im)
            if size is not None:
                upscaled = max(1.0, size[0] / h, size[1] / w)
                return Checked(_encode(im.resize((size[1], size[0]), _bilinear()), fmt), "", size[0], size[1], gray,
                               stats, upscaled)
            return Checked(bytes(data), "", h, w, gray, stats)
    except ImageRejected as e:
        return Checked(None, str(e))
    except Exception as e:  # corrupt pixel data a decoder reports its own way
        return Checked(None, str(damage(e, None)))


def _statistics(im) -> np.ndarray:
    """[[mean R, G, B, L], [mean of squares]] of about 4,096 evenly spread pixels (a thumbnail
    would smooth the image and understate its spread)."""
    rgb = np.asarray(im.convert("RGB")).reshape(-1, 3)
    lum = np.asarray(im.convert("L")).reshape(-1, 1)
    stride = max(1, len(rgb) // 4096)
    x = np.concatenate([rgb[::stride], lum[::stride]], axis=1).astype(np.float64) / 255.0
    return np.stack([x.mean(0), (x ** 2).mean(0)])


def _encode(im, fmt: str) -> bytes:
    """PNG stays PNG (lossless); anything else becomes a JPEG of quality 95."""
    out = io.BytesIO()
    im.save(out, format="PNG") if fmt == "PNG" else im.save(out, format="JPEG", quality=95)
    return out.getvalue()


def _bilinear():
    from PIL import Image

    return Image.Resampling.BILINEAR


# ---------------------------------------------------------------- the photo recipe's transforms

CROP_MIN_AREA = 0.6  # the smallest share of the image a random crop keeps (--crop-min-area); the largest is 1
CROP_RATIO = (3 / 4, 4 / 3)  # its aspect ratio
EVAL_CROP = 0.875  # evaluation: resize so the centre crop keeps 87.5 % of the shorter side (224 of 256)
PHOTO_PARAMS = 5  # random numbers per image: crop area, ratio, x, y, flip


def photo_draw(seed: int, global_step: int, global_batch: int) -> np.ndarray:
    """Uniform [0, 1) numbers [global batch, PHOTO_PARAMS] for the crops and flips of a global
    step, the whole global batch at once like ``order.augment_draw``. numpy, not torch: the
    decoding tasks then never import torch (seconds and hundreds of MB in each task process)."""
    return np.random.default_rng([seed, global_step, 0xC209]).random((global_batch, PHOTO_PARAMS))


def crop_box(size: tuple[int, int], draw: np.ndarray, min_area: float = CROP_MIN_AREA) -> tuple[float, ...]:
    """The random resized crop's region (x0, y0, x1, y1) of an image of ``size`` (W, H), from
    ``draw``'s first four numbers (area between ``min_area`` and 1, log-ratio, x, y). One
    attempt, clamped to the image (torchvision retries ten times, which is not reproducible
    from a fixed number of draws). The CPU and device paths both crop this region
    (``data/device_photos.py``), so a sample gets the same crop whichever decodes it."""
    w, h = size
    area = w * h * (min_area + draw[0] * (1.0 - min_area))
    lo, hi = np.log(CROP_RATIO[0]), np.log(CROP_RATIO[1])
    ratio = np.exp(lo + draw[1] * (hi - lo))
    cw = min(w, max(1.0, np.sqrt(area * ratio)))
    ch = min(h, max(1.0, np.sqrt(area / ratio)))
    x0, y0 = draw[2] * (w - cw), draw[3] * (h - ch)
    return (float(x0), float(y0), float(x0 + cw), float(y0 + ch))


def flipped(draw: np.ndarray) -> bool:
    """Whether the crop is mirrored left to right (draw[4] < 0.5)."""
    return bool(draw[4] < 0.5)


def center_box(size: tuple[int, int], shape: tuple[int, int]) -> tuple[float, ...]:
    """Evaluation's region (x0, y0, x1, y1) of an image of ``size`` (W, H): the centre region that
    covers EVAL_CROP of it once resized to ``shape`` (H, W)."""
    w, h = size
    th, tw = shape
    scale = max(th / (h * EVAL_CROP), tw / (w * EVAL_CROP))
    cw, ch = tw / scale, th / scale  # the region that becomes the output
    x0, y0 = (w - cw) / 2, (h - ch) / 2
    return (x0, y0, x0 + cw, y0 + ch)


def random_resized_crop(im, draw: np.ndarray, shape: tuple[int, int], min_area: float = CROP_MIN_AREA):
    """Crop a random region (``crop_box``: ``draw`` holds five uniform numbers in [0, 1): area,
    log-ratio, x, y, flip) and resize it to ``shape`` (H, W), flipped horizontally when
    draw[4] < 0.5."""
    from PIL import Image

    out = im.resize((shape[1], shape[0]), Image.Resampling.BILINEAR, box=crop_box(im.size, draw, min_area))
    return out.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flipped(draw) else out


def center_crop(im, shape: tuple[int, int]):
    """Evaluation: resize so that ``shape`` covers EVAL_CROP of the image, then the centre crop."""
    from PIL import Image

    return im.resize((shape[1], shape[0]), Image.Resampling.BILINEAR, box=center_box(im.size, shape))


def transform_array(pixels: np.ndarray, shape, draw: np.ndarray | None, min_area: float = CROP_MIN_AREA) -> np.ndarray:
    """The photo recipe on an image already decoded: uint8 [H', W', C] -> [H, W, C]."""
    from PIL import Image

    h, w, c = shape
    im = Image.fromarray(pixels[..., 0] if pixels.shape[-1] == 1 else pixels)
    im = random_resized_crop(im, draw, (h, w), min_area) if draw is not None else center_crop(im, (h, w))
    return np.asarray(im, dtype=np.uint8).reshape(h, w, c)


def decode_for_training(data: bytes, shape, preset: str, draw: np.ndarray | None,
                        min_area: float = CROP_MIN_AREA) -> np.ndarray:
    """Stored PNG/JPEG bytes -> uint8 [H, W, C] for the model: the photo recipe's random resized
    crop and flip when ``draw`` is given (training), its centre crop otherwise; digits are
    resized to the model's size (their affine augmentation works on whole batches)."""
    h, w, c = shape
    if draw is not None and preset == "photos":
        pixels = _decode_plain_jpeg(data, c)
        if pixels is not None:
            from PIL import Image

            im = Image.fromarray(pixels[..., 0] if c == 1 else pixels)
            return np.asarray(random_resized_crop(im, draw, (h, w), min_area), dtype=np.uint8).reshape(h, w, c)
    with open_image(data) as im:
        if draw is None:  # evaluation: the same transform as predict and serve
            return conform_image(im, shape, preset)[0]
        im = to_mode(im, c)
        if preset == "photos":
            im = random_resized_crop(im, draw, (h, w), min_area)
        elif im.size != (w, h):
            im = im.resize((w, h), _bilinear())
        return np.asarray(im, dtype=np.uint8).reshape(h, w, c)


_EXIF = b"Exif\x00\x00"


def _decode_plain_jpeg(data: bytes, channels: int) -> np.ndarray | None:
    """A JPEG without EXIF data, in YCbCr (or gray for a gray model), decoded by libjpeg-turbo
    straight into uint8 [H, W, C] (simplejpeg); None for anything else, which Pillow decodes.
    Why: Pillow parses JPEG headers in Python; on 96x96 photos this path decoded 1.5x as many
    images per second, with the same pixels (the same libjpeg-turbo settings)."""
    import simplejpeg

    if plain_jpeg_size(data, channels) is None:
        return None
    return simplejpeg.decode_jpeg(data, colorspace="RGB" if channels == 3 else "GRAY")


def plain_jpeg_size(data: bytes, channels: int) -> tuple[int, int] | None:
    """(H, W) of a JPEG a plain libjpeg decoder turns into the model's pixels exactly as Pillow
    would (simplejpeg here, nvJPEG on the device): no EXIF (it may hold an orientation, which
    Pillow applies), YCbCr or gray for a colour model, gray for a gray model (a colour JPEG for
    a gray model takes Pillow's RGB -> L weights, as everywhere else). None for anything else.
    The header gives the pixel count before any decoding: over the cap is refused."""
    import simplejpeg

    if data[:2] != b"\xff\xd8" or _EXIF in data[:65536]:
        return None
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None  # Pillow decodes it or says what is wrong
    if height * width > MAX_DECODE_PIXELS:
        raise ImageTooLarge(f"{width}x{height} pixels is over the limit of {MAX_DECODE_PIXELS:,} pixels")
    plain = colorspace in ("YCbCr", "Gray") if channels == 3 else colorspace == "Gray"
    return (height, width) if plain else None
