"""The server's request parsing on its own (no Ray): bodies, JSON pixels, limits."""

import asyncio
import json
import time

import numpy as np
import pytest
from starlette.requests import Request

from imgtrain.errors import ImgtrainError
from imgtrain.inference.options import Limits
from imgtrain.inference.requests import RequestError, pixels_from_json, read_body
from imgtrain.inference.serve import choose_ingress, direct_ingress_env

SHAPE = (4, 3, 1)


def request(body: bytes, headers: dict | None = None, chunk: int = 7) -> Request:
    """A real Starlette request whose body arrives in chunks, as from a socket."""
    pieces = [body[i:i + chunk] for i in range(0, len(body), chunk)] or [b""]
    messages = [{"type": "http.request", "body": p, "more_body": i < len(pieces) - 1} for i, p in enumerate(pieces)]

    async def receive():
        return messages.pop(0)

    raw = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    return Request({"type": "http", "method": "POST", "headers": raw}, receive)


def read(body: bytes, limit: int, headers: dict | None = None) -> bytes:
    return asyncio.run(read_body(request(body, headers), limit, timeout_s=10))


def trickled(byte_every_s: float) -> Request:
    """A request announcing 100 bytes whose body then comes one byte per ``byte_every_s``."""
    async def receive():
        await asyncio.sleep(byte_every_s)
        return {"type": "http.request", "body": b"x", "more_body": True}

    return Request({"type": "http", "method": "POST", "headers": [(b"content-length", b"100")]}, receive)


def test_read_body_counts_the_stream_as_well_as_content_length():
    assert read(b"x" * 50, limit=50) == b"x" * 50
    with pytest.raises(RequestError) as too_long:  # chunked, no Content-Length
        read(b"x" * 51, limit=50)
    assert too_long.value.status == 413
    with pytest.raises(RequestError) as lied:  # a client announcing less than it sends
        read(b"x" * 80, limit=50, headers={"content-length": "10"})
    assert lied.value.status == 413
    for headers, status in (({"content-length": "999"}, 413), ({"content-length": "ten"}, 400)):
        with pytest.raises(RequestError) as e:
            read(b"x", limit=50, headers=headers)
        assert e.value.status == status
    with pytest.raises(RequestError, match="empty body"):
        read(b"", limit=50)


def test_a_body_trickling_in_gets_408_at_the_deadline_for_the_whole_body():
    # A byte every 20 ms: a per-read timeout of 0.3 s would never fire; the whole-body deadline does.
    started = time.monotonic()
    with pytest.raises(RequestError) as slow:
        asyncio.run(read_body(trickled(0.02), limit=1000, timeout_s=0.3))
    assert 0.29 < time.monotonic() - started < 2  # the loop may wake a clock tick early
    assert slow.value.status == 408 and slow.value.headers == {"Connection": "close"}
    assert str(slow.value) == "the request body did not arrive whole within 0.3 s; send it at once"
    assert Limits().body_timeout_s == 5 and Limits(body_timeout_s=0).problems() == [
        "--body-timeout must be a positive number, got 0"]


def test_json_pixels_in_every_form_and_every_malformed_body_is_a_400():
    image = np.arange(12).reshape(4, 3)
    for body in (image.tolist(), image[..., None].tolist(), image.ravel().tolist(), {"pixels": image.tolist()}):
        pixels, batch = pixels_from_json(json.dumps(body).encode(), SHAPE)
        assert pixels.shape == (1, 4, 3, 1) and pixels.dtype == np.uint8 and not batch
        assert np.array_equal(pixels[0, ..., 0], image)
    pixels, batch = pixels_from_json(json.dumps({"images": [image.tolist()] * 2}).encode(), SHAPE)
    assert pixels.shape == (2, 4, 3, 1) and batch
    for body in (b"[" * 100_000, b"{nope", b"[[1, 2], [3]]", json.dumps([[300] * 3] * 4).encode(),
                 json.dumps([[0.5] * 3] * 4).encode(), json.dumps([["a"] * 3] * 4).encode(), b"[1, 2, 3]"):
        with pytest.raises(RequestError) as e:
            pixels_from_json(body, SHAPE)
        assert e.value.status == 400, body[:20]


def test_the_default_image_cap_follows_the_model_input_and_limits_are_checked():
    assert Limits().image_pixels((28, 28, 1)) == 1 << 20  # at least a megapixel
    assert Limits().image_pixels((224, 224, 3)) == 64 * 224 * 224
    assert Limits(max_image_pixels=500).image_pixels((28, 28, 1)) == 500
    problems = Limits(max_batch_images=0, request_timeout_s=float("nan"), max_batch_size=0).problems()
    assert problems == ["--max-batch-images must be a positive number, got 0",
                        "--request-timeout must be a positive number, got nan",
                        "--max-batch-size must be a positive number, got 0"]
    assert Limits(batch_wait_ms=0).problems() == []  # no waiting: batches of what is already queued
    assert Limits(batch_wait_ms=-1).problems() == ["--batch-wait-ms must be 0 or a positive number, got -1"]


def test_the_image_cap_never_exceeds_what_is_decoded_anywhere_else():
    from imgtrain.data.images import MAX_DECODE_PIXELS

    # 64 x a 8192x6103 input (the largest a data set may declare) would be 3.2 gigapixels
    assert Limits().image_pixels((8192, 6103, 3)) == MAX_DECODE_PIXELS
    assert Limits().image_pixels((1024, 1024, 3)) == MAX_DECODE_PIXELS  # 64 MP asked
    assert Limits(max_image_pixels=10**12).image_pixels((28, 28, 1)) == MAX_DECODE_PIXELS
    assert Limits().image_pixels((800, 800, 3)) == 64 * 800 * 800  # 41 MP: under the cap, as it was


def test_direct_ingress_where_it_works_and_a_clear_refusal_where_not():
    assert choose_ingress("auto", replicas=1, joins_cluster=False) == "direct"
    assert choose_ingress("auto", replicas=2, joins_cluster=False) == "proxy"
    assert choose_ingress("auto", replicas=1, joins_cluster=True) == "proxy"
    assert choose_ingress("proxy", replicas=1, joins_cluster=False) == "proxy"
    for replicas, joins in ((2, False), (1, True)):
        with pytest.raises(ImgtrainError, match="--ingress proxy"):
            choose_ingress("direct", replicas=replicas, joins_cluster=joins)
    with pytest.raises(ImgtrainError, match="auto, direct, proxy"):
        choose_ingress("haproxy", replicas=1, joins_cluster=False)
    # Serve's port range ends before its last value: exactly the one port asked for
    env = direct_ingress_env(8123)
    assert env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"] == "8123"
    assert env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"] == "8124"
