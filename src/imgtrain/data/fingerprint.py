"""What ``data inspect`` and ``data prepare --dedupe`` keep of each image: its size, colour mode
and EXIF orientation, a hash of its bytes, and its perceptual hashes, as compact numpy arrays.

* The content hash is the first 8 bytes of BLAKE2b over the stored image bytes (encoded
  storage) or the pixel tensor (tensor storage): equal hashes are exact duplicates (two different
  images share one with odds of about n^2 / 2^65: 3e-8 for a million images).
* The perceptual hash is pHash from the ``imagehash`` library (64 bits: the signs of the 8 x 8
  lowest frequencies of the DCT of a 32 x 32 grayscale copy, against their median), taken of the
  image as the model sees it (EXIF orientation applied) and of its 7 other rotations and mirror
  images (``TRANSFORMS``): a copy turned by 90 degrees, 180, 270 or mirrored matches one of them.
  The 32 x 32 copy is made once and then turned, which is the same image (up to rounding) as the
  turned image made small.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from imgtrain.data import images

HASH_SIDE = 32  # pHash's working size: hash_size 8 x highfreq_factor 4, imagehash's defaults
# The 8 ways to turn or mirror an image (the dihedral group), by their PIL names; index 0 is the image as is.
TRANSFORMS = ("NONE", "ROTATE_90", "ROTATE_180", "ROTATE_270", "FLIP_LEFT_RIGHT", "FLIP_TOP_BOTTOM",
              "TRANSPOSE", "TRANSVERSE")
TRANSFORM_WORDS = ("as is", "rotated 90°", "rotated 180°", "rotated 270°", "mirrored", "mirrored upside down",
                   "mirrored and rotated 90°", "mirrored and rotated 270°")
INVERSE = (0, 3, 2, 1, 4, 5, 6, 7)  # the transform that undoes each: 90 <-> 270, the mirrors undo themselves
# Colour modes by code (uint8); anything else counts as "other".
MODES = ("1", "L", "LA", "P", "PA", "RGB", "RGBA", "CMYK", "YCbCr", "I;16", "I", "F", "other", "unreadable")
UNREADABLE = MODES.index("unreadable")


@dataclass
class Prints:
    """Fingerprints of n images, by position: 82 bytes an image."""

    width: np.ndarray  # uint32 [n], after EXIF orientation
    height: np.ndarray  # uint32 [n]
    mode: np.ndarray  # uint8 [n], an index into MODES
    exif_turned: np.ndarray  # bool [n]: EXIF says the stored pixels are turned or mirrored
    content: np.ndarray  # uint64 [n]: hash of the stored bytes (0: unreadable)
    phash: np.ndarray  # uint64 [n, 8]: pHash of each of TRANSFORMS of the image

    @staticmethod
    def empty(n: int) -> "Prints":
        return Prints(np.zeros(n, np.uint32), np.zeros(n, np.uint32), np.full(n, UNREADABLE, np.uint8),
                      np.zeros(n, bool), np.zeros(n, np.uint64), np.zeros((n, len(TRANSFORMS)), np.uint64))

    @staticmethod
    def join(parts: list["Prints"]) -> "Prints":
        if not parts:
            return Prints.empty(0)
        return Prints(*(np.concatenate([getattr(p, f) for p in parts]) for f in
                        ("width", "height", "mode", "exif_turned", "content", "phash")))

    def put(self, k: int, width: int, height: int, mode: str, exif_turned: bool, content: int, phash) -> None:
        self.width[k], self.height[k], self.exif_turned[k] = width, height, exif_turned
        self.mode[k] = MODES.index(mode) if mode in MODES else MODES.index("other")
        self.content[k], self.phash[k] = content, phash


def content_hash(data) -> int:
    """The first 8 bytes of BLAKE2b of ``data`` (bytes, or a numpy array's bytes) as an integer."""
    raw = data.tobytes() if isinstance(data, np.ndarray) else bytes(data)
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "big")


def perceptual_hashes(im) -> np.ndarray:
    """uint64 [8]: imagehash's pHash of a PIL image under each of TRANSFORMS."""
    import imagehash
    from PIL import Image

    small = im.convert("L").resize((HASH_SIDE, HASH_SIDE), Image.Resampling.LANCZOS)
    out = np.empty(len(TRANSFORMS), np.uint64)
    for k, name in enumerate(TRANSFORMS):
        turned = small if name == "NONE" else small.transpose(getattr(Image.Transpose, name))
        bits = imagehash.phash(turned).hash.ravel()  # bool [64]
        out[k] = np.frombuffer(np.packbits(bits).tobytes(), ">u8")[0]
    return out


def fingerprint_encoded(data: bytes, prints: Prints, k: int) -> None:
    """Fill row ``k`` of ``prints`` from PNG/JPEG bytes (left unreadable when they do not decode)."""
    from PIL import ImageOps

    try:
        with images.open_image(data) as im:
            mode, (h, w) = im.mode, images.oriented_size(im)
            turned = _orientation(im) not in (None, 1)
            if im.format == "JPEG":  # the decoder's own downscaling: pHash needs 32 x 32 pixels
                im.draft("L", (4 * HASH_SIDE, 4 * HASH_SIDE))
            im = ImageOps.exif_transpose(im)
            hashes = perceptual_hashes(im)
    except Exception:  # prepare checked every stored image; a file damaged since is counted, not fatal
        return
    prints.put(k, w, h, mode, turned, content_hash(data), hashes)


def fingerprint_pixels(pixels: np.ndarray, prints: Prints, k: int) -> None:
    """Fill row ``k`` of ``prints`` from a uint8 [H, W, C] tensor (tensor storage)."""
    from PIL import Image

    h, w, c = pixels.shape
    im = Image.fromarray(pixels[..., 0] if c == 1 else pixels, "L" if c == 1 else "RGB")
    prints.put(k, w, h, im.mode, False, content_hash(np.ascontiguousarray(pixels)), perceptual_hashes(im))


def _orientation(im) -> int | None:
    try:
        return im.getexif().get(0x0112)
    except Exception:  # a broken EXIF block: the stored orientation
        return None
