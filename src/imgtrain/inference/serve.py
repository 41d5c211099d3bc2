"""``imgtrain serve``: a checkpoint's model behind HTTP, with Ray Serve.

    POST /predict   body: PNG/JPEG bytes (any Content-Type but JSON), or JSON pixels 0..255:
                    one image as [H][W], [H][W][C] or a flat list of H*W*C values, ``{"pixels": ...}``,
                    or a list of images / ``{"images": [...]}`` for a batch
                    -> {"label", "index", "confidence", "probabilities": {class: prob}} (a list for a batch)
    GET  /healthz   -> {"status": "ok", "checkpoint" (its name), "classes", "image_shape",
                        "forward_passes", "images_predicted" (this replica's, since it started)}
    GET  /openapi.json  only with ``--openapi`` (no /docs or /redoc: they load outside scripts)

Image files of another size or colour mode are converted as ``imgtrain predict`` does
(``imgtrain.inference.inputs``); JSON pixels must already have the model's shape. Bad input gets a 4xx
with ``{"error": "..."}``, never a 500: bodies over ``--max-request-bytes`` (413), images over
``--max-image-pixels`` (413, checked from the header before decoding), more than
``--max-batch-images`` images in one request (413), JSON nested too deep (400), a body not received
whole within ``Limits.body_timeout_s`` (408, and the connection is closed). There is no
authentication or TLS: bind to 127.0.0.1 (the default), or put a reverse proxy that provides
them in front.

Under load (BENCHMARKS.md, issue 23): concurrent single-image requests are decoded in a thread
pool and run through the model together (``imgtrain.inference.batcher``): while one forward pass
runs, the requests arriving meanwhile gather into the next, up to ``--max-batch-size`` images
(``--batch-wait-ms`` adds a wait for a batch to fill; 0 measured best). One forward pass at a
time per replica, with the replica's share of the cores as torch threads. Past
``--max-queued-requests`` waiting requests per replica, new ones get 503 at once with
``Retry-After`` (from the replica, or as plain text from Ray's proxy when a flood outruns it); a
request not answered within ``--request-timeout`` seconds gets 504 with ``Retry-After`` (408
from Ray's proxy if it never reached a replica). A request counts as waiting only once its body
is in: clients trickling their bodies cannot take the places of the requests behind them (issue
33). With one replica on a cluster it starts, the replica answers HTTP itself (``--ingress
direct``, Serve's direct ingress): Serve's proxy and router cost about 6 ms of CPU per request
here, most of what a batched request costs.

The driver finds and verifies the checkpoint, refuses a busy port before starting Ray, waits
for the app with a deadline, then blocks until SIGINT or SIGTERM and shuts Serve and Ray down.
"""

# No ``from __future__ import annotations``: @serve.ingress pickles the routes with only the
# globals they use, so FastAPI could not resolve a string annotation ``"Request"`` (it would
# take ``request`` for a query parameter and answer 422).
import asyncio
import contextlib
import dataclasses
import json
import math
import signal
import socket
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from imgtrain import cluster as cluster_mod
from imgtrain import runs
from imgtrain.data.images import MAX_DECODE_PIXELS
from imgtrain.errors import ImgtrainError, one_line
from imgtrain.inference.batcher import Batcher
from imgtrain.inference.predictor import Predictor
from imgtrain.inference.try_page import CONTENT_SECURITY_POLICY, PAGE
from imgtrain.ops.files import link_dir

APP_NAME = "imgtrain"
REPLICA_CPUS = 0.5  # logical: a replica mostly waits for requests; torch threads are set below
STARTUP_TIMEOUT_S = 180.0  # Ray + Serve + model load: ~45 s on 2 busy cores; past this, stuck
RETRY_AFTER_S = 1  # what a refused client is told to wait: a batch takes milliseconds, the queue drains in about a second
RETRY_AFTER = {"Retry-After": str(RETRY_AFTER_S)}
PROXY_GRACE_S = 5.0  # Ray's proxy gives up this long after the replica's own timeout: a backstop only
INGRESS = ("auto", "direct", "proxy")


def direct_ingress_env(port: int) -> dict[str, str]:
    """Ray Serve's direct ingress (a feature flag in Ray 2.60): the replica's own HTTP server
    listens on ``port``, with no proxy actor in between. Serve's proxy and router cost about 6 ms of
    CPU per request on 2 cores (a model-free app: 250 req/s through them, 1,370 direct; BENCHMARKS.md),
    the ceiling that held the batched server at 3.7-3.9x one client's rate. The flags are read when
    Ray's processes import Serve, so they go into a private cluster's environment; the port range
    is this one port (the range's end is exclusive), and no draining period is kept for a load
    balancer that is not there."""
    return {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0"}


def choose_ingress(ingress: str, replicas: int, joins_cluster: bool) -> str:
    """``direct`` where it works (one replica on a cluster this command starts), else ``proxy``."""
    if ingress not in INGRESS:
        raise ImgtrainError(f"--ingress must be one of {', '.join(INGRESS)}, got {ingress!r}")
    if ingress == "direct" and (replicas != 1 or joins_cluster):
        why = ("--replicas is more than 1 (each replica would need a port of its own)" if replicas != 1 else
               "it joins a running cluster, whose processes were started without Serve's direct-ingress flag")
        raise ImgtrainError(f"--ingress direct needs one replica on a Ray cluster imgtrain starts, but {why}; "
                            "use --ingress proxy")
    if ingress == "auto":
        return "proxy" if replicas != 1 or joins_cluster else "direct"
    return ingress


@dataclass(frozen=True)
class Limits:
    """What one request may cost the server."""

    max_request_bytes: int = 1 << 20
    """Larger bodies get 413."""
    max_image_pixels: int = 0
    """Larger images (width x height, from the header) get 413 before decoding; 0 = 64 times the
    model's input, at least 1 megapixel (a 64 KiB PNG can hold 16.7 MP, ~80 MiB decoded). Never
    more than images.MAX_DECODE_PIXELS, whatever is asked (``image_pixels``)."""
    max_batch_images: int = 64
    """Images per request (JSON batches)."""
    request_timeout_s: float = 30.0
    """A request not answered by then gets 504 (408 from Ray's proxy) instead of waiting on."""
    body_timeout_s: float = 5.0
    """A request body not received whole by then gets 408. One deadline for the whole body, not one
    per read: a client sending a byte every few seconds would renew a per-read timeout forever, and
    hold its connection and memory. 1 MiB (--max-request-bytes) in 5 s is 200 KiB/s."""
    max_queued_requests: int = 100
    """Requests waiting per replica, besides the batch being computed, before new ones get 503."""
    max_batch_size: int = 32
    """Most images in one forward pass, gathered from concurrent requests."""
    batch_wait_ms: float = 0.0
    """Extra wait for a batch to fill; 0: each forward pass takes what arrived during the last one."""

    def problems(self) -> list[str]:
        may_be_zero = ("max_image_pixels", "batch_wait_ms")
        return [f"--{name.replace('_', '-').removesuffix('-s')} must be "
                f"{'0 or ' if name in may_be_zero else ''}a positive number, got {value}"
                for name, value in dataclasses.asdict(self).items()
                if not (0 < value < math.inf or name in may_be_zero and value == 0)]

    def image_pixels(self, shape) -> int:
        # Capped: 64 times a large model's input is up to 3.2 gigapixels (10 GB decoded as RGB), and
        # nothing larger than MAX_DECODE_PIXELS is decoded anywhere else.
        asked = self.max_image_pixels or max(64 * shape[0] * shape[1], 1 << 20)
        return min(asked, MAX_DECODE_PIXELS)


# No interactive docs: /docs and /redoc load scripts from a CDN; /openapi.json is a route of
# ModelServer, off unless --openapi.
http_app = FastAPI(title="imgtrain", docs_url=None, redoc_url=None, openapi_url=None)


class RequestError(Exception):
    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.headers = status, headers


@http_app.exception_handler(RequestError)
async def _request_error(request: Request, e: RequestError):
    return JSONResponse({"error": str(e)}, status_code=e.status, headers=e.headers)


@http_app.exception_handler(StarletteHTTPException)  # 404 / 405 in the same {"error"} shape
async def _http_error(request: Request, e: StarletteHTTPException):
    return JSONResponse({"error": str(e.detail)}, status_code=e.status_code, headers=e.headers)


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
        raise RequestError(400, f"the body is not a readable PNG/JPEG image ({type(e).__name__}); "
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


def _bind_as_serves_proxy_does() -> None:
    """Ray 2.60 binds a direct-ingress replica's socket without SO_REUSEADDR (replica.py passes
    ``enable_so_reuseport=False``), unlike its proxy: the connections the server closed stay in
    TIME_WAIT for a minute after it stops, and keep the next ``imgtrain serve`` from the port until
    then. Bind it as the proxy does (its default, SERVE_SOCKET_REUSE_PORT_ENABLED): ``check_port_free``
    still refuses a port another server listens on, before Ray starts."""
    from ray.serve._private import replica

    start = replica.start_asgi_http_server
    if getattr(start, "binds_reusable", False):
        return

    async def start_reusable(*args, **kwargs):
        return await start(*args, **{**kwargs, "enable_so_reuseport": True})

    start_reusable.binds_reusable = True
    replica.start_asgi_http_server = start_reusable


# Below the helpers on purpose: @serve.ingress pickles the FastAPI app while this module is still
# being imported, so every name the routes use must already exist at this point.
@serve.deployment(ray_actor_options={"num_cpus": REPLICA_CPUS})
@serve.ingress(http_app)
class ModelServer:
    """One replica: the checkpoint's model in eval mode on the CPU, fed batches gathered from
    concurrent requests."""

    def __init__(self, checkpoint_dir: str, limits: Limits, threads: int, openapi: bool = False):
        _bind_as_serves_proxy_does()  # before Serve starts this replica's HTTP server (direct ingress)
        self.predictor = Predictor(checkpoint_dir, threads=threads)  # verifies the sha256s again
        self.shape = self.predictor.loaded.preprocess.image_shape  # (H, W, C)
        self.classes = list(self.predictor.loaded.preprocess.classes)
        # A name, not the server's file system layout: /healthz answers anyone who can connect.
        self.checkpoint = f"{Path(checkpoint_dir).parent.name}/{Path(checkpoint_dir).name}"
        self.limits, self.max_pixels, self.openapi = limits, limits.image_pixels(self.shape), openapi
        # Decoding and the forward pass are CPU work: off the event loop, so /healthz still answers.
        # One model thread: one forward pass at a time, each with all of the replica's torch threads
        # (concurrent passes would split the same cores and each take longer).
        self.decoders = ThreadPoolExecutor(max(2, threads), thread_name_prefix="decode")
        self.model_thread = ThreadPoolExecutor(1, thread_name_prefix="model")
        self.batcher = Batcher(self._run_model, limits.max_batch_size, limits.batch_wait_ms / 1000)
        self.predictor.predict_proba(np.zeros((1, *self.shape), np.uint8))  # warm up before "ready"
        self.forward_passes = self.images_predicted = 0  # their ratio: how well requests are batched
        self.queued = 0  # /predict requests here with their body in: being decoded, batched or answered

    @http_app.get("/")
    def page(self):
        """A page to try the model in a browser (draw a digit or drop an image)."""
        return HTMLResponse(PAGE, headers={"Content-Security-Policy": CONTENT_SECURITY_POLICY,
                                           "X-Content-Type-Options": "nosniff"})

    @http_app.get("/healthz")
    def healthz(self):
        return {"status": "ok", "checkpoint": self.checkpoint, "classes": self.classes,
                "image_shape": list(self.shape), "forward_passes": self.forward_passes,
                "images_predicted": self.images_predicted}

    @http_app.get("/openapi.json")
    def openapi_schema(self):
        if not self.openapi:
            raise StarletteHTTPException(404, "Not Found")
        from fastapi.openapi.utils import get_openapi

        return get_openapi(title="imgtrain", version="1", routes=http_app.routes)

    @http_app.post("/predict")
    async def predict(self, request: Request):
        self._refuse_if_full()  # at once, before reading a body that could not be queued
        # Queued only once its body is in: 140 clients trickling theirs held every place
        # and the requests behind them got 503. read_body's deadline bounds how long a body may
        # take; Serve's max_ongoing_requests (_deploy) bounds how many are read at once.
        body = await read_body(request, self.limits.max_request_bytes, self.limits.body_timeout_s)
        self._refuse_if_full()
        self.queued += 1
        try:
            is_json = request.headers.get("content-type", "").split(";")[0].strip().endswith("json")
            timeout = self.limits.request_timeout_s
            try:
                return await asyncio.wait_for(self._answer(body, is_json), timeout)
            except asyncio.TimeoutError:
                raise RequestError(504, f"no answer within {timeout:g} s (--request-timeout): the server is "
                                        "overloaded; retry later", RETRY_AFTER) from None
        finally:
            self.queued -= 1

    def _refuse_if_full(self) -> None:
        if self.queued >= self.limits.max_queued_requests + self.limits.max_batch_size:
            raise RequestError(503, f"the server is busy: {self.queued} requests are waiting "
                                    "(--max-queued-requests); retry later", RETRY_AFTER)

    async def _answer(self, body: bytes, is_json: bool):
        loop = asyncio.get_running_loop()
        images, batch = await loop.run_in_executor(self.decoders, self._decode, body, is_json)
        if batch:  # a request's own batch runs as it is, between the gathered ones
            probs = await self._run_model(images)
        else:
            probs = (await self.batcher(images[0]))[None]
        answers = [
            {"label": self.classes[int(p.argmax())], "index": int(p.argmax()), "confidence": float(p.max()),
             "probabilities": {c: float(v) for c, v in zip(self.classes, p)}}
            for p in probs
        ]
        return answers if batch else answers[0]

    async def _run_model(self, images: np.ndarray) -> np.ndarray:
        return await asyncio.get_running_loop().run_in_executor(self.model_thread, self._predict_proba, images)

    def _predict_proba(self, images: np.ndarray) -> np.ndarray:
        """In the model thread only."""
        self.forward_passes, self.images_predicted = self.forward_passes + 1, self.images_predicted + len(images)
        return self.predictor.predict_proba(images)

    def _decode(self, body: bytes, is_json: bool) -> tuple[np.ndarray, bool]:
        if is_json:
            images, batch = pixels_from_json(body, self.shape)
        else:
            preset = self.predictor.loaded.preprocess.preset
            images, batch = image_from_bytes(body, self.shape, self.max_pixels, preset), False
        if len(images) > self.limits.max_batch_images:
            raise RequestError(413, f"{len(images)} images in one request, over the limit of "
                                    f"{self.limits.max_batch_images} (--max-batch-images)")
        return images, batch


# ---------------------------------------------------------------- the driver


def run_server(run, checkpoint: str = "best", storage: str = "./runs", host: str = "127.0.0.1",
               port: int = 8000, limits: Limits = Limits(), replicas: int = 1,
               address: str | None = None, openapi: bool = False, ingress: str = "auto", announce=print) -> None:
    """Serve the checkpoint until SIGINT or SIGTERM; returns after a clean shutdown."""
    import ray

    ingress = choose_ingress(ingress, replicas, joins_cluster=address is not None or ray.is_initialized())
    path, logs = _check_request(run, checkpoint, storage, host, port, limits, replicas)
    private_env = direct_ingress_env(port) if ingress == "direct" else None
    stop = _StopSignals()
    terminal = sys.stdout  # ray_session swaps sys.stdout for a log file; announce needs the real one
    with stop.listening():  # from before Ray starts: a signal during startup shuts down too
        try:
            with cluster_mod.ray_session(address, replicas * REPLICA_CPUS, logs, "serve.log",
                                          private_env=private_env) as cluster:
                stop.listen()  # ray.init replaced our SIGTERM handler with its sys.exit(15)
                if stop.is_set():  # Ctrl-C while Ray started
                    return
                link_dir(logs / "ray-serve", cluster.session_logs)
                try:
                    # Serve starts its proxy with direct ingress too: it gets a port of its own.
                    proxy_port = free_port(host) if ingress == "direct" else port
                    _deploy(path, host, proxy_port, limits, replicas, openapi)
                    if _wait_ready(host, port, stop, logs):
                        with contextlib.redirect_stdout(terminal):
                            via = "the replica answers directly" if ingress == "direct" else \
                                "through Ray Serve's proxy"
                            announce(f"serving {path} at {_url(host, port, connect=False)} (POST /predict, "
                                     f"GET /healthz; {via}); Ctrl-C stops")
                            terminal.flush()  # seen at once through a pipe or a log file too
                        while not stop.wait(1.0):  # a timed wait: signal handlers run promptly
                            pass
                finally:
                    _stop_serve(joined=address is not None)
        except SystemExit as e:  # ray.init's own SIGTERM handler: a stop during startup
            if e.code != signal.SIGTERM:
                raise


def _check_request(run, checkpoint, storage, host, port, limits, replicas) -> tuple[Path, Path]:
    """(the verified checkpoint, where logs go), after every check that can fail before Ray starts."""
    problems = limits.problems()
    if not 0 < port < 65536:
        problems.append(f"--port must be 1..65535, got {port}")
    if replicas < 1:
        problems.append(f"--replicas must be at least 1, got {replicas}")
    if problems:
        raise ImgtrainError("; ".join(problems))
    # Verified here: a damaged checkpoint fails in one line, not in a replica's log.
    path = runs.resolve_checkpoint(run, checkpoint, storage)
    check_port_free(host, port)
    in_run = (path.parent / runs.CONFIG_FILE).is_file()  # a checkpoint inside a run directory
    logs = path.parent / runs.LOGS_DIR if in_run else cluster_mod.user_log_dir()
    logs.mkdir(parents=True, exist_ok=True)
    return path, logs


def _deploy(path: Path, host: str, port: int, limits: Limits, replicas: int, openapi: bool) -> None:
    from ray.serve.config import BackpressureConfig

    serve.start(http_options={"host": host, "port": port,
                              "request_timeout_s": limits.request_timeout_s + PROXY_GRACE_S})
    _check_http_config(host, port)
    # The replica refuses requests past its own queue (ModelServer.predict), so Ray's router must let
    # them reach it: a replica at Serve's max_ongoing_requests makes the router retry with backoffs of
    # up to 0.5 s, which at 256 clients left the replica idle and the answers 15 s late (BENCHMARKS.md).
    # Serve's own queue in the proxy (503 with the same Retry-After) is a backstop for floods past that.
    # max_ongoing_requests also caps the bodies being read at once, which the replica does not count.
    per_replica = limits.max_queued_requests + limits.max_batch_size
    app = ModelServer.options(
        num_replicas=replicas,
        max_ongoing_requests=2 * per_replica,
        max_queued_requests=per_replica * replicas,
        backpressure_config=BackpressureConfig(status_code=503, retry_after_s=RETRY_AFTER_S),
    ).bind(str(path), limits, cluster_mod.threads_for(replicas), openapi)
    serve.run_many([serve.RunTarget(app, name=APP_NAME)], wait_for_applications_running=False)


class _StopSignals(threading.Event):
    """Set by SIGINT or SIGTERM; a second Ctrl-C stops waiting for the clean shutdown."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def _on_signal(self, *_):
        if self.is_set():
            raise KeyboardInterrupt
        self.set()

    def listen(self) -> None:
        for s in self.SIGNALS:
            signal.signal(s, self._on_signal)

    @contextlib.contextmanager
    def listening(self):
        previous = {s: signal.getsignal(s) for s in self.SIGNALS}
        self.listen()
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def check_port_free(host: str, port: int) -> None:
    """Bind the port ourselves first: Serve's proxy would otherwise fail in a log file, unseen."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ImgtrainError(f"cannot listen on host {host!r}: {e.strerror}") from None
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is no conflict
        try:
            s.bind(sockaddr)
        except OSError as e:
            raise ImgtrainError(f"cannot listen on {host}:{port}: {e.strerror or e}; "
                                "is another server using it? pick another --port") from None


def free_port(host: str) -> int:
    """A port nothing listens on now, from the kernel."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind(sockaddr)
        return s.getsockname()[1]


def _check_http_config(host: str, port: int) -> None:
    """On a joined cluster, Serve may already run with other HTTP options, which win silently."""
    from ray.serve.context import _get_global_client

    config = _get_global_client().http_config
    if (config.host, config.port) != (host, port):
        raise ImgtrainError(f"Ray Serve already runs on this cluster at {config.host}:{config.port}; "
                            f"pass --host {config.host} --port {config.port} or use another cluster")


def _wait_ready(host: str, port: int, stop: threading.Event, logs: Path) -> bool:
    """True once /healthz answers through the proxy; False if stopped; an error on failure or timeout."""
    url = f"{_url(host, port)}/healthz"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via $http_proxy
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not stop.is_set():
        app = serve.status().applications.get(APP_NAME)
        if app is not None and app.status == "DEPLOY_FAILED":
            detail = one_line(app.message, 100_000)[-300:]  # the end says what failed
            raise ImgtrainError(f"the model replica failed to start: {detail} (logs: {logs})")
        if app is not None and app.status == "RUNNING":
            with contextlib.suppress(OSError):
                with opener.open(url, timeout=2) as r:
                    if r.status == 200:
                        return True
        if time.monotonic() > deadline:
            raise ImgtrainError(f"the server did not answer on {url} within {STARTUP_TIMEOUT_S:.0f} s "
                                f"(application status: {app.status if app else 'not deployed'}); logs: {logs}")
        stop.wait(0.25)
    return False


def _stop_serve(joined: bool) -> None:
    """Take our app down; on a cluster that was joined, leave Serve to the other apps there."""
    with contextlib.suppress(Exception):  # already down, or the cluster went away: nothing to clean
        if joined:
            serve.delete(APP_NAME)
            if serve.status().applications:
                return
        serve.shutdown()


def _url(host: str, port: int, connect: bool = True) -> str:
    """The server's base URL; to connect, a wildcard host means this machine's loopback."""
    if connect and host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1" if host != "::" else "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
