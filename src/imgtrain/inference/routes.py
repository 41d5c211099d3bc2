"""The HTTP API of ``imgtrain serve``: the FastAPI app and the replica (``ModelServer``) whose
methods are its routes. A new route is a method of ``ModelServer`` here, nothing else.

    POST /predict   body: PNG/JPEG bytes (any Content-Type but JSON), or JSON pixels 0..255:
                    one image as [H][W], [H][W][C] or a flat list of H*W*C values, ``{"pixels": ...}``,
                    or a list of images / ``{"images": [...]}`` for a batch
                    -> {"label", "index", "confidence", "probabilities": {class: prob},
                        "ood": {"method", "score"[, "threshold", "rejected"]}} (a list for a batch);
                    with --reject, a rejected image's "label" is "unknown" and its "index" -1;
                    a multi-label model: {"labels": [{"label", "probability"}, ...] (the classes at or
                    over their thresholds, most probable first), "probabilities"} (multilabel_answers.py)
    POST /explain   the same bodies -> /predict's answer with "explanation": {"size" [H, W], "overlay_png",
                    "map_png"} (base64 PNGs at the size of the image as sent): where the model looked
                    for its predicted class (explain.py); 409 from an export (--engine)
    GET  /healthz   -> {"status": "ok", "checkpoint" (its name), "classes", "image_shape",
                        "forward_passes", "images_predicted" (this replica's, since it started),
                        "tta" (none, or flip: --tta), "engine" (torch, or onnxruntime: --engine),
                        "preset" (digits or photos: the try page draws digits, takes photos),
                        "temperature" (calibration's T, 1 without), "ood": {"method", "threshold"},
                        "explain" (whether /explain answers: a checkpoint, not an export);
                        a multi-label model's also "multi_label": true and "thresholds": {class: threshold}}
    GET  /          a page to try the model in a browser (try_page.py)
    GET  /openapi.json  only with ``--openapi`` (no /docs or /redoc: they load outside scripts)

What a request may be, and the 4xx for what it may not, is in ``requests.py``. There is no
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
33).
"""

# No ``from __future__ import annotations``: @serve.ingress pickles the routes with only the
# globals they use, so FastAPI could not resolve a string annotation ``"Request"`` (it would
# take ``request`` for a query parameter and answer 422).
import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from imgtrain.inference.batcher import Batcher
from imgtrain.inference.explain import NEEDS_CHECKPOINT, Explainer, explanation_view
from imgtrain.inference.multilabel_answers import answer as multilabel_answer
from imgtrain.inference.ood import UNKNOWN
from imgtrain.inference.options import Limits
from imgtrain.inference.predictor import Predictor
from imgtrain.inference.requests import RETRY_AFTER, RequestError, decode_explain_request, decode_request, read_body
from imgtrain.inference.try_page import CONTENT_SECURITY_POLICY, PAGE
from imgtrain.ops.process import torch_threads

REPLICA_CPUS = 0.5  # logical: a replica mostly waits for requests; its torch threads: serve._deploy

# No interactive docs: /docs and /redoc load scripts from a CDN; /openapi.json is a route of
# ModelServer, off unless --openapi.
http_app = FastAPI(title="imgtrain", docs_url=None, redoc_url=None, openapi_url=None)


@http_app.exception_handler(RequestError)
async def _request_error(request: Request, e: RequestError):
    return JSONResponse({"error": str(e)}, status_code=e.status, headers=e.headers)


@http_app.exception_handler(StarletteHTTPException)  # 404 / 405 in the same {"error"} shape
async def _http_error(request: Request, e: StarletteHTTPException):
    return JSONResponse({"error": str(e.detail)}, status_code=e.status_code, headers=e.headers)


def _bind_as_serves_proxy_does() -> None:
    """Ray 2.60 binds a direct-ingress replica's socket without SO_REUSEADDR
    (``ray/serve/_private/replica.py`` passes ``enable_so_reuseport=False``), unlike its proxy:
    the connections the server closed stay in TIME_WAIT for a minute after it stops, and keep the
    next ``imgtrain serve`` from the port until then. Bind it as the proxy does (its default,
    SERVE_SOCKET_REUSE_PORT_ENABLED): ``check_port_free`` still refuses a port another server
    listens on, before Ray starts."""
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

    def __init__(self, checkpoint_dir: str, limits: Limits, threads: int, openapi: bool = False, tta: str = "none",
                 engine: str = "torch", ood_score: str = "energy", threshold=None):
        _bind_as_serves_proxy_does()  # before Serve starts this replica's HTTP server (direct ingress)
        # verifies the sha256s again; every forward pass below is its predict_with_scores (tta included)
        self.predictor = Predictor(checkpoint_dir, threads=threads, tta=tta, engine=engine, ood_score=ood_score,
                                   threshold=threshold)
        self.engine = engine
        self.shape = self.predictor.loaded.preprocess.image_shape  # (H, W, C)
        self.classes = list(self.predictor.loaded.preprocess.classes)
        self.multi_label = self.predictor.multi_label
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
        self.queued = 0  # /predict and /explain requests here with their body in: being decoded, batched or answered
        self.explainer = None  # made at the first /explain (_explain)

    @http_app.get("/")
    def page(self):
        """A page to try the model in a browser (draw a digit or drop an image)."""
        return HTMLResponse(PAGE, headers={"Content-Security-Policy": CONTENT_SECURITY_POLICY,
                                           "X-Content-Type-Options": "nosniff"})

    @http_app.get("/healthz")
    def healthz(self):
        return {"status": "ok", "checkpoint": self.checkpoint, "classes": self.classes,
                "image_shape": list(self.shape), "forward_passes": self.forward_passes,
                "images_predicted": self.images_predicted, "tta": self.predictor.tta,
                "engine": self.engine, "preset": self.predictor.loaded.preprocess.preset,
                "temperature": self._temperature(),
                **({} if self.multi_label else
                   {"ood": {"method": self.predictor.ood_score, "threshold": self.predictor.threshold}}),
                "explain": self.engine == "torch",  # /explain needs the checkpoint's gradients
                **({"multi_label": True, "thresholds": dict(zip(self.classes, self.predictor.thresholds.tolist()))}
                   if self.multi_label else {})}

    @http_app.get("/openapi.json")
    def openapi_schema(self):
        if not self.openapi:
            raise StarletteHTTPException(404, "Not Found")
        from fastapi.openapi.utils import get_openapi

        return get_openapi(title="imgtrain", version="1", routes=http_app.routes)

    @http_app.post("/predict")
    async def predict(self, request: Request):
        return await self._queued(request, self._answer)

    @http_app.post("/explain")
    async def explain(self, request: Request):
        """/predict's answer with where the model looked (explain.py); the same bodies and limits."""
        if self.engine != "torch":  # an export: no gradients, so no map; /predict still answers
            raise RequestError(409, NEEDS_CHECKPOINT)
        return await self._queued(request, self._explained)

    async def _queued(self, request: Request, answer):
        """``answer(body, is_json)`` for the request, within the queue's places and the deadlines."""
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
                return await asyncio.wait_for(answer(body, is_json), timeout)
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
        images, batch = await loop.run_in_executor(
            self.decoders, decode_request, body, is_json, self.shape, self.max_pixels,
            self.predictor.loaded.preprocess.preset, self.limits.max_batch_images)
        if batch:  # a request's own batch runs as it is, between the gathered ones
            rows = await self._run_model(images)
        else:
            rows = (await self.batcher(images[0]))[None]
        answers = self._answers(rows)
        return answers if batch else answers[0]

    async def _explained(self, body: bytes, is_json: bool):
        """Each image's answer with ``explanation``: its map of the predicted class (a multi-label
        model's most probable label) over the image as sent (``explain.explanation_view``). A request's images
        run as their own batch, not gathered with others: their maps take a backward pass."""
        loop = asyncio.get_running_loop()
        images, sent, batch = await loop.run_in_executor(
            self.decoders, decode_explain_request, body, is_json, self.shape, self.max_pixels,
            self.predictor.loaded.preprocess.preset, self.limits.max_batch_images)
        rows, maps = await loop.run_in_executor(self.model_thread, self._explain, images)
        answers = self._answers(rows)
        preprocess = self.predictor.loaded.preprocess
        views = await loop.run_in_executor(self.decoders, lambda: [
            explanation_view(cam, image, not is_json, preprocess.image_shape, preprocess.preset)
            for cam, image in zip(maps, sent)])
        for answer, view in zip(answers, views):
            answer["explanation"] = view
        return answers if batch else answers[0]

    def _explain(self, images: np.ndarray):
        """In the model thread only: ``_predict_proba``'s rows and the maps of the most probable classes."""
        if self.explainer is None:  # captum and the layer's search: at the first /explain, not at start
            self.explainer = Explainer(self.predictor.loaded, self.predictor.tta)
        rows = self._predict_proba(images)
        with torch_threads(self.predictor.threads):
            return rows, self.explainer.maps(images, rows[:, :-1].argmax(1))

    def _answers(self, rows: np.ndarray) -> list[dict]:
        """The answers to ``_predict_proba``'s rows (each image's probabilities, then its score)."""
        probs, scores = rows[:, :-1], rows[:, -1]
        if self.multi_label:
            return [multilabel_answer(p, self.predictor.thresholds, self.classes) for p in probs]
        return [self._single_label_answer(p, float(s)) for p, s in zip(probs, scores)]

    def _single_label_answer(self, p: np.ndarray, score: float) -> dict:
        index, threshold = int(p.argmax()), self.predictor.threshold
        answer = {"label": self.classes[index], "index": index, "confidence": float(p.max()),
                  "probabilities": {c: float(v) for c, v in zip(self.classes, p)},
                  "ood": {"method": self.predictor.ood_score, "score": score}}
        if threshold is not None:
            answer["ood"].update(threshold=threshold, rejected=score < threshold)
            if score < threshold:
                answer.update(label=UNKNOWN, index=-1)
        return answer

    def _temperature(self) -> float:
        calibration = self.predictor.calibration
        return calibration.temperature if calibration else 1.0

    async def _run_model(self, images: np.ndarray) -> np.ndarray:
        return await asyncio.get_running_loop().run_in_executor(self.model_thread, self._predict_proba, images)

    def _predict_proba(self, images: np.ndarray) -> np.ndarray:
        """In the model thread only: float64 [B, K + 1], each image's probabilities, then its
        out-of-distribution score (0 for a multi-label model, which has none)."""
        self.forward_passes, self.images_predicted = self.forward_passes + 1, self.images_predicted + len(images)
        probs, scores = self.predictor.predict_with_scores(images)
        scores = np.zeros(len(probs)) if scores is None else scores
        return np.concatenate([probs.astype(np.float64), scores[:, None]], axis=1)
