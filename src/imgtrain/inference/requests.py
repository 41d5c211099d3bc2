"""What one request to ``imgtrain serve`` may be, and how it is read: the body (with its size
limit and its deadline), the images in it (PNG/JPEG bytes or JSON pixels), and ``Limits``.

Image files of another size or colour mode are converted as ``imgtrain predict`` does
(``imgtrain.inference.inputs``); JSON pixels must already have the model's shape. Bad input gets a 4xx
with ``{"error": "..."}``, never a 500: bodies over ``--max-request-bytes`` (413), images over
``--max-image-pixels`` (413, checked from the header before decoding), more than
``--max-batch-images`` images in one request (413), JSON nested too deep (400), a body not received
whole within ``Limits.body_timeout_s`` (408, and the connection is closed). ``Limits`` is declared
with the other options of ``serve`` (``options.py``).
"""

import asyncio
import json

import numpy as np
from fastapi import Request


RETRY_AFTER_S = 1  # what a refused client is told to wait: a batch takes milliseconds, the queue drains in about a second
RETRY_AFTER = {"Retry-After": str(RETRY_AFTER_S)}


class RequestError(Exception):
    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.headers = status, headers


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The body, refused with 413 past ``limit`` bytes: Content-Length is checked first, and the
    stream is counted too, since a chunked upload has no Content-Length and a client may lie.
    Refused with 408 unless it arrives whole within ``timeout_s`` (``Limits.body_timeout_s``)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise RequestError(400, f"Content-Length {declared!r} is not a number")
        if int(declared) > limit:
            raise RequestError(413, f"request body of {int(declared)} bytes is over the limit of {limit} bytes")
    try:
        async with asyncio.timeout(timeout_s):
            body = await _read_stream(request, limit)
    except TimeoutError:
        # The rest of the body may still be on its way: close the connection (RFC 9110, 408).
        raise RequestError(408, f"the request body did not arrive whole within {timeout_s:g} s; "
                                "send it at once", {"Connection": "close"}) from None
    if not body:
        raise RequestError(400, "empty body: send a PNG/JPEG image or a JSON array of pixels")
    return body


async def _read_stream(request: Request, limit: int) -> bytes:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise RequestError(413, f"request body is over the limit of {limit} bytes")
    return bytes(body)


def image_from_bytes(body: bytes, shape, max_pixels: int, preset: str = "digits") -> np.ndarray:
    """PNG/JPEG bytes -> uint8 [1, H, W, C], converted like ``imgtrain predict`` converts files."""
    from imgtrain.data.images import (
        ImageRejected,
        ImageTooLarge,
        conform_image,
        damage,
        open_image,
    )

    try:
        with open_image(body, max_pixels) as im:
            return conform_image(im, shape, preset)[0][None]
    except ImageTooLarge as e:
        raise RequestError(413, f"the image is too large to decode: {e} (--max-image-pixels)") from None
    except ImageRejected as e:
        raise RequestError(400, f"the body is not a readable PNG/JPEG image ({e}); send image bytes, or "
                                "JSON pixels with Content-Type: application/json") from None
    except Exception as e:  # truncated or corrupt pixel data
        raise RequestError(400, f"the body is not a readable PNG/JPEG image ({damage(e, None)}); "
                                "send image bytes, or JSON pixels with Content-Type: application/json") from None


def pixels_from_json(body: bytes, shape) -> tuple[np.ndarray, bool]:
    """JSON pixels -> (uint8 [B, H, W, C], whether the request was a batch)."""
    h, w, c = shape
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(400, f"the body is not valid JSON: {e}") from None
    except RecursionError:  # e.g. 100,000 "[": Python's parser gives up
        raise RequestError(400, "the JSON body is nested too deeply") from None
    batch = isinstance(data, dict) and "images" in data
    if isinstance(data, dict):
        data = data.get("images", data.get("pixels"))
    try:
        arr = np.asarray(data)
    except (ValueError, RecursionError):  # ragged or absurdly deep nesting
        arr = None
    if arr is None or arr.dtype.kind not in "iuf":
        raise RequestError(400, 'expected pixels: a rectangular array of numbers, {"pixels": ...} or {"images": [...]}')
    singles = [(h, w, c), (h * w * c,)] + ([(h, w)] if c == 1 else [])
    if not batch and arr.shape in singles:
        arr = arr[None]
    elif arr.ndim >= 2 and arr.shape[1:] in singles and len(arr):
        batch = True
    else:
        forms = f"[{h}][{w}][{c}]" + (f", [{h}][{w}]" if c == 1 else "") + f" or a flat list of {h * w * c} values"
        raise RequestError(400, f"expected one image as {forms}, or a list of such images; got shape {list(arr.shape)}")
    if arr.min() < 0 or arr.max() > 255 or (arr != np.round(arr)).any():
        raise RequestError(400, "pixel values must be whole numbers from 0 to 255")
    return arr.astype(np.uint8).reshape(len(arr), h, w, c), batch


def decode_request(body: bytes, is_json: bool, shape, max_pixels: int, preset: str,
                   max_images: int) -> tuple[np.ndarray, bool]:
    """The request's images, uint8 [B, H, W, C], and whether it was a batch; refused with 413
    past ``max_images`` (``--max-batch-images``)."""
    if is_json:
        images, batch = pixels_from_json(body, shape)
    else:
        images, batch = image_from_bytes(body, shape, max_pixels, preset), False
    if len(images) > max_images:
        raise RequestError(413, f"{len(images)} images in one request, over the limit of "
                                f"{max_images} (--max-batch-images)")
    return images, batch


def decode_explain_request(body: bytes, is_json: bool, shape, max_pixels: int, preset: str,
                           max_images: int) -> tuple[np.ndarray, list[np.ndarray], bool]:
    """``decode_request``'s images, each with the image as it was sent, which its explanation is
    drawn over: an image file's own pixels (RGB, EXIF orientation applied), or the JSON pixels."""
    images, batch = decode_request(body, is_json, shape, max_pixels, preset, max_images)
    if is_json:
        return images, list(images), batch
    from imgtrain.data.images import open_image, to_mode

    with open_image(body, max_pixels) as im:  # decoded once already: it is a readable image
        return images, [np.asarray(to_mode(im, 3), dtype=np.uint8)], batch
