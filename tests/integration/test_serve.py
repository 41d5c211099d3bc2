"""``imgtrain serve`` for real: the CLI in its own process, with its own Ray cluster, over HTTP.

One server, started once, takes every request test; a second joins the session's cluster (the
proxy ingress). Refusals before Ray starts run the CLI in this process."""

import base64
import contextlib
import http.client
import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from imgtrain.data.format import read_split
from imgtrain.inference.inputs import conform
from imgtrain.inference.predictor import Predictor
from imgtrain.inference.options import Limits
from tests.browser import BrowserPage
from tests.conftest import assert_one_line_error, cli_here, copy_run, run_cli, wait_for
from tests.ports import unused_port

# Training a model, then starting Ray, Serve and a replica on 2 busy cores: minutes, not seconds.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

MAX_BYTES = 100_000  # small, so that an oversized body fits in the socket buffers
MAX_BATCH = 8
# Small on purpose, so that a burst of requests fills them: a forward pass gathers up to FORWARD_BATCH
# images and waits up to BATCH_WAIT_MS for them; past MAX_QUEUED + FORWARD_BATCH requests in the
# replica, or as many waiting in Ray's proxy for it, new ones get 503.
FORWARD_BATCH = 8
BATCH_WAIT_MS = 50
MAX_QUEUED = 16
START_TIMEOUT_S = 300
STOP_TIMEOUT_S = 60
NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1 even with $http_proxy


@pytest.fixture(scope="module")
def trained(local_run, tmp_path_factory):
    """(storage, best checkpoint) of a copy of the session's local run: a server writes its logs
    into the run it serves."""
    storage = copy_run(local_run, tmp_path_factory.mktemp("runs"))
    return storage, storage / local_run.name / local_run.best_checkpoint.name


def run_name(trained) -> str:
    return trained[1].parent.name


def request(port: int, path: str, body=None, content_type=None, timeout=30, method=None):
    """(status, parsed JSON body) of one HTTP request; 4xx/5xx are returned, not raised."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method=method)
    if content_type:
        req.add_header("Content-Type", content_type)
    try:
        with NO_PROXY.open(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@contextlib.contextmanager
def serving(storage: Path, out_dir: Path, *options: str, run: str = "srv"):
    """The real ``imgtrain serve`` of ``run`` in a subprocess; yields once /healthz answers, kills it at the end."""
    port = unused_port()
    stdout, stderr = out_dir / "stdout.txt", out_dir / "stderr.txt"
    with open(stdout, "w") as out, open(stderr, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "imgtrain.cli", "serve", run, "--storage", str(storage), "--port", str(port),
             *options], stdout=out, stderr=err, env={**os.environ, "COLUMNS": "300"},
        )
    try:
        started = time.monotonic()
        deadline = started + START_TIMEOUT_S
        while True:
            assert proc.poll() is None, f"serve exited with {proc.returncode}: {stderr.read_text()}"
            assert time.monotonic() < deadline, f"no answer on /healthz in {START_TIMEOUT_S} s: {stderr.read_text()}"
            try:  # /healthz, and the announce line printed just after it
                if request(port, "/healthz", timeout=2)[0] == 200 and "serving" in stdout.read_text():
                    break
            except (OSError, ValueError):  # not listening yet, or the proxy's 503 while deploying
                pass
            time.sleep(0.5)  # polling interval of the wait-for, not a fixed wait
        print(f"serve answered after {time.monotonic() - started:.1f} s")
        yield proc, port, stdout, stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=STOP_TIMEOUT_S)


@pytest.fixture(scope="module")
def server(trained, tmp_path_factory):
    """The server most tests share: the default ingress (direct), small limits."""
    with serving(trained[0], tmp_path_factory.mktemp("serve-out"), "--max-request-bytes", str(MAX_BYTES),
                 "--max-batch-images", str(MAX_BATCH), "--max-batch-size", str(FORWARD_BATCH),
                 "--batch-wait-ms", str(BATCH_WAIT_MS), "--max-queued-requests", str(MAX_QUEUED),
                 run=run_name(trained)) as running:
        yield running


@pytest.fixture(scope="module")
def digit(tiny_data, trained):
    """A real MNIST test digit uint8 [28, 28, 1] and the local Predictor's probabilities for it."""
    _, images, _ = read_split(tiny_data, "test")
    predictor = Predictor(trained[1])
    return images[0], predictor


def png_bytes(pixels: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels[..., 0] if pixels.shape[-1] == 1 else pixels).save(buf, format="PNG")
    return buf.getvalue()


def assert_prediction(answer: dict, probs: np.ndarray, classes) -> None:
    assert answer["index"] == int(probs.argmax())
    assert answer["label"] == classes[int(probs.argmax())]
    assert answer["confidence"] == pytest.approx(float(probs.max()), abs=1e-4)
    assert list(answer["probabilities"]) == list(classes)
    assert sum(answer["probabilities"].values()) == pytest.approx(1.0, abs=1e-4)
    assert np.allclose(list(answer["probabilities"].values()), probs, atol=1e-4)


def test_healthz(server, trained):
    _, port, stdout, _ = server
    status, body = request(port, "/healthz")
    assert status == 200
    assert body["status"] == "ok"
    # Its name, not where it lies on the server's disk: anyone who can connect may ask.
    assert body["checkpoint"] == f"{run_name(trained)}/{trained[1].name}"
    assert body["classes"] == [str(i) for i in range(10)]
    assert body["preset"] == "digits"  # the try page draws digits; a photo model gets photos (test_try_page.py)
    assert body["explain"] is True  # a checkpoint: /explain answers (an export's server says false)
    assert f"serving {trained[1]} at http://127.0.0.1:{port}" in stdout.read_text()


def test_png_of_a_digit_gets_the_same_answer_as_the_local_predictor(server, digit):
    _, port, _, _ = server
    pixels, predictor = digit
    probs = predictor.predict_proba(pixels[None])[0]
    for content_type in ("image/png", "application/octet-stream"):
        status, answer = request(port, "/predict", png_bytes(pixels), content_type)
        assert status == 200, answer
        assert_prediction(answer, probs, predictor.loaded.preprocess.classes)


def test_json_pixels_in_every_accepted_form(server, digit):
    _, port, _, _ = server
    pixels, predictor = digit
    probs = predictor.predict_proba(pixels[None])[0]
    classes = predictor.loaded.preprocess.classes
    for payload in (pixels[..., 0].tolist(), pixels.tolist(), pixels.ravel().tolist(),
                    {"pixels": pixels[..., 0].tolist()}):
        status, answer = request(port, "/predict", json.dumps(payload).encode(), "application/json")
        assert status == 200, (answer, np.shape(payload))
        assert_prediction(answer, probs, classes)
    batch = np.stack([pixels, 255 - pixels])
    status, answers = request(port, "/predict", json.dumps({"images": batch.tolist()}).encode(), "application/json")
    assert status == 200 and len(answers) == 2
    for answer, p in zip(answers, predictor.predict_proba(batch)):
        assert_prediction(answer, p, classes)


def burst(port: int, bodies: list[bytes]) -> list[tuple]:
    """POST every body at once, one client thread each (connected first, then released together):
    [(status, JSON answer or text, Retry-After header, seconds)] in the order of ``bodies``."""
    import http.client
    import threading

    ready = threading.Barrier(len(bodies))
    results = [None] * len(bodies)

    def send(k: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.connect()
        ready.wait()
        started = time.monotonic()
        conn.request("POST", "/predict", body=bodies[k], headers={"Content-Type": "image/png"})
        r = conn.getresponse()
        body = r.read()
        # Answers are JSON; Ray's proxy refuses in plain text
        answer = json.loads(body) if r.getheader("Content-Type", "").startswith("application/json") else body.decode()
        results[k] = (r.status, answer, r.getheader("Retry-After"), time.monotonic() - started)
        conn.close()

    threads = [threading.Thread(target=send, args=(k,)) for k in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_concurrent_requests_are_batched_and_each_gets_its_own_answer(server, tiny_data, digit):
    _, port, _, _ = server
    _, predictor = digit
    _, images, _ = read_split(tiny_data, "test")
    images = images[:MAX_QUEUED]  # never more waiting than the server admits: every one is answered
    before = request(port, "/healthz")[1]
    results = burst(port, [png_bytes(im) for im in images])
    after = request(port, "/healthz")[1]
    singles = predictor.predict_proba(images)  # what each image gets alone
    for (status, answer, _, _), probs in zip(results, singles):
        assert status == 200, [r[:2] for r in results]
        assert_prediction(answer, probs, predictor.loaded.preprocess.classes)
    assert len({answer["index"] for _, answer, _, _ in results}) > 1  # not one answer copied to all
    images_done = after["images_predicted"] - before["images_predicted"]
    passes = after["forward_passes"] - before["forward_passes"]
    assert images_done == len(images)
    assert passes < len(images) / 2, f"{len(images)} concurrent images took {passes} forward passes"


def test_requests_past_the_queue_limit_get_503_with_retry_after_at_once(server, tiny_data, digit):
    _, port, _, _ = server
    _, predictor = digit
    _, images, _ = read_split(tiny_data, "test")
    images = images[np.arange(64) % len(images)]
    results = burst(port, [png_bytes(im) for im in images])
    statuses = [status for status, *_ in results]
    assert set(statuses) <= {200, 503}, statuses
    assert statuses.count(200) >= MAX_QUEUED and statuses.count(503) > 0, statuses
    rejected = [r for r in results if r[0] == 503]
    assert all(retry_after == "1" for _, _, retry_after, _ in rejected)
    slowest_answer = max(seconds for status, _, _, seconds in results if status == 200)
    assert max(seconds for *_, seconds in rejected) < slowest_answer  # refused at once, not after waiting
    singles = predictor.predict_proba(images).argmax(1)
    assert all(answer["index"] == single for (status, answer, _, _), single in zip(results, singles)
               if status == 200)


def test_rgb_image_of_another_size_is_converted(server, digit):
    _, port, _, _ = server
    pixels, predictor = digit
    rgb = np.asarray(Image.fromarray(pixels[..., 0]).convert("RGB").resize((56, 56)))  # [56, 56, 3]
    status, answer = request(port, "/predict", png_bytes(rgb), "image/png")
    assert status == 200, answer
    # The same conversion as `imgtrain predict`: convert("L"), then a bilinear resize to 28x28.
    expected = predictor.predict_proba(conform(rgb[None], (28, 28, 1))[0])[0]
    assert_prediction(answer, expected, predictor.loaded.preprocess.classes)


def test_explain_answers_the_prediction_with_the_map_on_the_image_as_sent(server, digit):
    """POST /explain: /predict's answer for the image, and the Grad-CAM map of the predicted class,
    computed from the converted image as /predict sees it, then put back on the image as sent
    (40x56 RGB here) as an overlay and as the map itself (PNGs, base64); JSON batches get one each."""
    from imgtrain.inference.explain import Explainer, source_map

    _, port, _, _ = server
    pixels, predictor = digit
    rgb = np.asarray(Image.fromarray(pixels[..., 0]).convert("RGB").resize((40, 56)))  # [56, 40, 3]
    status, answer = request(port, "/explain", png_bytes(rgb), "image/png")
    assert status == 200, answer
    seen = conform(rgb[None], (28, 28, 1))[0]
    probs = predictor.predict_proba(seen)[0]
    view = answer.pop("explanation")
    assert_prediction(answer, probs, predictor.loaded.preprocess.classes)
    assert view["size"] == [56, 40]
    overlay = Image.open(io.BytesIO(base64.b64decode(view["overlay_png"])))
    cam = np.asarray(Image.open(io.BytesIO(base64.b64decode(view["map_png"]))))
    assert (overlay.mode, overlay.size, cam.shape, cam.max()) == ("RGB", (40, 56), (56, 40), 255)
    expected = source_map(Explainer(predictor.loaded).maps(seen, [probs.argmax()])[0], (56, 40), (28, 28, 1), "digits")
    assert np.abs(cam / 255 - expected).max() <= 1 / 255 + 1e-4
    status, answers = request(port, "/explain", json.dumps({"images": [pixels.tolist()] * 2}).encode(),
                              "application/json")
    assert status == 200 and len(answers) == 2 and all(a["explanation"]["size"] == [28, 28] for a in answers)


@pytest.mark.parametrize("body, content_type, status, fragment", [
    (b"this is not an image", "image/png", 400, "not a readable PNG/JPEG"),
    (b"\x89PNG\r\n\x1a\n" + b"\0" * 50, "application/octet-stream", 400, "not a readable PNG/JPEG"),
    (b"", "image/png", 400, "empty body"),
    (b"[[1, 2], [3, 4]]", "application/json", 400, "[28][28]"),
    (json.dumps([[300] * 28] * 28).encode(), "application/json", 400, "0 to 255"),
    (json.dumps([[0.5] * 28] * 28).encode(), "application/json", 400, "0 to 255"),
    (json.dumps([["a"] * 28] * 28).encode(), "application/json", 400, "rectangular array of numbers"),
    (b"[[1, 2], [3]]", "application/json", 400, "rectangular array of numbers"),
    (b"{not json", "application/json", 400, "not valid JSON"),
    (b"x" * (MAX_BYTES + 1), "image/png", 413, "over the limit"),
    (b"[" * 60_000, "application/json", 400, "nested too deeply"),  # was a RecursionError: 500
    (json.dumps({"images": [[[0] * 28] * 28] * (MAX_BATCH + 1)}).encode(), "application/json", 413,
     f"over the limit of {MAX_BATCH}"),
])
@pytest.mark.parametrize("route", ["/predict", "/explain"])  # /explain takes the same bodies, within the same limits
def test_bad_requests_get_a_clear_4xx(server, body, content_type, status, fragment, route):
    _, port, _, _ = server
    got, answer = request(port, route, body, content_type, method="POST")
    assert got == status, answer
    assert fragment in answer["error"]


@pytest.mark.parametrize("size, mode", [((6000, 6000), "1"), ((4096, 4096), "L")])
def test_decompression_bomb_is_refused_before_decoding(server, size, mode):
    _, port, _, _ = server
    buf = io.BytesIO()
    Image.new(mode, size).save(buf, format="PNG")  # a few KB that would decode to 16.7-36 M pixels
    assert len(buf.getvalue()) < MAX_BYTES
    status, answer = request(port, "/predict", buf.getvalue(), "image/png")
    # the default cap for a 28x28 model: 1 megapixel, checked from the header
    assert status == 413 and "over the limit of 1,048,576 pixels" in answer["error"], answer


def test_a_gif_named_png_is_refused(server):
    _, port, _, _ = server
    buf = io.BytesIO()
    Image.new("L", (28, 28)).save(buf, format="GIF")
    status, answer = request(port, "/predict", buf.getvalue(), "image/png")
    assert status == 400 and "not a readable PNG/JPEG image (not a PNG or JPEG image)" in answer["error"], answer


def test_sixteen_bit_png_is_scaled_like_prepare_and_predict_scale_it(server, digit):
    _, port, _, _ = server
    pixels, predictor = digit
    buf = io.BytesIO()
    Image.fromarray(pixels[..., 0].astype(np.uint16) * 257).save(buf, format="PNG")  # mode I;16, same image
    status, answer = request(port, "/predict", buf.getvalue(), "image/png")
    assert status == 200, answer
    assert_prediction(answer, predictor.predict_proba(pixels[None])[0], predictor.loaded.preprocess.classes)


def test_jpeg_is_accepted(server, digit):
    _, port, _, _ = server
    buf = io.BytesIO()
    Image.fromarray(digit[0][..., 0]).save(buf, format="JPEG", quality=95)
    status, answer = request(port, "/predict", buf.getvalue(), "image/jpeg")
    assert status == 200 and answer["label"] in digit[1].loaded.preprocess.classes


def test_oversized_chunked_body_without_content_length_is_refused(server):
    _, port, _, _ = server
    chunks = (b"y" * 10_000 for _ in range(MAX_BYTES // 10_000 + 2))  # urllib sends it chunked
    status, answer = request(port, "/predict", chunks, "application/octet-stream")
    assert status == 413 and "over the limit" in answer["error"]


def test_unknown_route_and_method(server):
    _, port, _, _ = server
    assert request(port, "/nope")[0] == 404
    assert request(port, "/predict")[0] == 405  # GET
    for docs in ("/docs", "/redoc", "/openapi.json"):  # off unless --openapi
        assert request(port, docs)[0] == 404, docs


def listening_addresses(port: int) -> set[str]:
    """Local addresses of the sockets listening on ``port`` (Linux /proc/net/tcp, no tools)."""
    found = set()
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        for line in Path(table).read_text().splitlines()[1:]:
            local, _, state = line.split()[1:4]
            addr, port_hex = local.split(":")
            if state == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(addr)
                # The kernel prints each 32-bit word in host (little-endian) order.
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                found.add(socket.inet_ntop(socket.AF_INET if width == 4 else socket.AF_INET6, raw))
    return found


def test_listens_on_loopback_only(server):
    _, port, _, _ = server
    assert listening_addresses(port) == {"127.0.0.1"}


def test_the_page_draws_a_digit_and_shows_the_servers_answer(server, digit, tmp_path):
    """A person's view: open /, draw a 7 with the mouse, press Predict, read the top classes;
    then choose an image file."""
    _, port, _, _ = server
    with NO_PROXY.open(f"http://127.0.0.1:{port}/", timeout=30) as r:
        html = r.read().decode()
        assert r.headers["Content-Type"].startswith("text/html")
        assert "default-src 'none'" in r.headers["Content-Security-Policy"]
    assert "http://" not in html and "https://" not in html  # no script, style or font from elsewhere
    page = BrowserPage(f"http://127.0.0.1:{port}/", tmp_path / "profile")
    try:
        # no body yet while the tab is still loading the page: the expression then must not throw
        page.wait_for("document.body !== null && document.body.dataset.ready === '1'")
        assert "10 classes" in page.js("document.getElementById('about').textContent")
        box = page.js("(() => { const r = document.getElementById('pad').getBoundingClientRect();"
                      " return [r.left, r.top]; })()")
        left, top = box
        page.drag([(left + x, top + y) for x, y in [(70, 60), (140, 60), (210, 60), (180, 140), (150, 220)]])
        page.js("document.getElementById('predict').click()")
        page.wait_for("document.body.dataset.state === 'answered'")
        shown = page.js("[...document.querySelectorAll('#result li')].map(li => [li.dataset.class, +li.dataset.prob])")
        top_label = page.js("document.getElementById('top').textContent")
        sent = page.js("document.getElementById('seen').src")
        shot = page.screenshot(tmp_path / "page.png")
        (tmp_path / "digit.png").write_bytes(png_bytes(digit[0]))
        page.js("document.body.dataset.state = ''")
        page.choose_file("#file", tmp_path / "digit.png")
        page.wait_for("document.body.dataset.state === 'answered'")
        from_file = page.js("document.getElementById('top').textContent")
        # ticked, "show where the model looked" asks /explain: the map over the image sent
        assert page.js("document.getElementById('looked-box').hidden")
        page.js("document.getElementById('explain').click(); document.body.dataset.state = ''")
        (tmp_path / "again.png").write_bytes(png_bytes(digit[0]))  # the same file chosen again fires no change
        page.choose_file("#file", tmp_path / "again.png")
        page.wait_for("document.body.dataset.state === 'answered' "
                      "&& document.getElementById('looked').naturalWidth > 0")
        looked = page.js("[document.getElementById('looked-box').hidden, "
                         "document.getElementById('looked').naturalWidth, document.getElementById('top').textContent]")
    finally:
        page.close()
    probs = digit[1].predict_proba(digit[0][None])[0]
    assert from_file == digit[1].loaded.preprocess.classes[int(probs.argmax())]
    assert looked == [False, 28, from_file]  # shown, at the size of the file sent, beside the same answer
    # What the page sent, POSTed again by hand: the page shows the server's answer for it.
    png = base64.b64decode(sent.split(",", 1)[1])
    drawn = np.asarray(Image.open(io.BytesIO(png)).convert("L"))
    assert drawn.shape == (28, 28) and drawn.max() > 200 and drawn[:4].max() < 50  # framed like MNIST digits
    status, answer = request(port, "/predict", png, "image/png")
    assert status == 200
    expected = sorted(answer["probabilities"].items(), key=lambda kv: -kv[1])[:5]
    assert [c for c, _ in shown] == [c for c, _ in expected] and top_label == answer["label"]
    assert np.allclose([p for _, p in shown], [p for _, p in expected], atol=1e-6)
    image = Image.open(shot)
    colours = np.unique(np.asarray(image.convert("RGB")).reshape(-1, 3), axis=0)
    assert image.size[0] >= 800 and len(colours) > 50  # a real rendered page, not a blank one


# A slowloris: clients that send their headers, then trickle the body a byte at a time, must
# neither take the places of requests waiting for the model nor hold their connection past the
# body deadline.
SLOW_CLIENTS = 32  # more than the replica's places for /predict (MAX_QUEUED + FORWARD_BATCH = 24),
# fewer than Serve's ongoing requests per replica (2 x 24) less the normal request sent beside them
TRICKLE_S = 0.5  # a byte this often: an idle (per-read) timeout of more than this would never fire
BODY_TIMEOUT_S = Limits().body_timeout_s  # the shared server's: the default
SLACK_S = 5.0  # 2 busy cores: how late past the deadline a 408 may still come
NORMAL_WINDOW_S = 2.0  # normal requests are sent for this long, well inside the slow clients' deadline
PROMPT_S = 3.0  # a normal request alone takes milliseconds; this allows for 2 busy cores


class SlowClient(threading.Thread):
    """POSTs /predict from a raw socket: the headers with a Content-Length, then the body one byte
    per TRICKLE_S until the server answers (or BODY_TIMEOUT_S + SLACK_S pass)."""

    def __init__(self, port: int, body: bytes):
        super().__init__(daemon=True)
        self.port, self.body = port, body
        self.sending = threading.Event()  # set once the headers and a first byte are out
        self.status = self.answer = self.connection = self.closed = self.error = None
        self.answered_at = self.seconds = None

    def run(self) -> None:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=10) as s:
                self._trickle(s)
                if self.status is not None:  # 408 means the server is done with this connection
                    s.settimeout(SLACK_S)
                    try:
                        self.closed = s.recv(1) == b""
                    except ConnectionResetError:  # closed with a byte of ours unread (sent as the 408 came)
                        self.closed = True
        except Exception as e:  # reported by the test, not lost in a thread
            self.error = repr(e)
        finally:
            self.sending.set()

    def _trickle(self, s: socket.socket) -> None:
        # x-request-timeout-seconds 0 turns Ray Serve's own request timeout off: a client can, so
        # the server must not count on it.
        s.sendall(b"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: image/png\r\n"
                  b"x-request-timeout-seconds: 0\r\nContent-Length: %d\r\n\r\n" % len(self.body))
        started = time.monotonic()
        for byte in self.body:  # hundreds of bytes: minutes at this rate, never done before the deadline
            s.sendall(bytes([byte]))
            self.sending.set()
            answered = select.select([s], [], [], TRICKLE_S)[0]  # the wait between bytes ends on an answer
            if answered or time.monotonic() > started + BODY_TIMEOUT_S + SLACK_S:
                break
        if not answered:
            return
        self.answered_at, self.seconds = time.monotonic(), time.monotonic() - started
        r = http.client.HTTPResponse(s, method="POST")
        r.begin()
        self.status, self.connection = r.status, r.getheader("Connection")
        body = r.read()
        self.answer = json.loads(body) if r.getheader("Content-Type", "").startswith("application/json") \
            else body.decode(errors="replace")


def test_clients_trickling_their_bodies_neither_starve_others_nor_hold_on(server, digit):
    _, port, _, _ = server
    png = png_bytes(digit[0])
    slow = [SlowClient(port, png) for _ in range(SLOW_CLIENTS)]
    for client in slow:
        client.start()
    for client in slow:
        assert client.sending.wait(30) and client.error is None, client.error
    window_start = time.monotonic()
    normal = []  # (status, seconds, error) of requests sent one after another while the slow ones trickle
    while time.monotonic() < window_start + NORMAL_WINDOW_S or len(normal) < 3:
        sent = time.monotonic()
        status, answer = request(port, "/predict", png, "image/png", timeout=PROMPT_S + 10)
        normal.append((status, round(time.monotonic() - sent, 3), answer.get("error")))
        if status != 200:  # the first refusal says enough
            break
    window_end = time.monotonic()
    for client in slow:
        client.join(BODY_TIMEOUT_S + 2 * SLACK_S + 10)
    after = request(port, "/predict", png, "image/png", timeout=PROMPT_S + 10)
    outcome = [(c.status, c.seconds and round(c.seconds, 2), c.answer, c.connection, c.closed, c.error)
               for c in slow]
    statuses = sorted({status for status, _, _ in normal})
    print(f"{len(normal)} normal requests in {window_end - window_start:.1f} s: statuses {statuses}, slowest "
          f"{max(s for _, s, _ in normal)} s\nslow clients: {outcome}\nafterwards: {after[0]}")
    assert all(status == 200 and seconds < PROMPT_S for status, seconds, _ in normal), normal
    assert all(c.answered_at is not None and c.answered_at > window_end for c in slow), outcome  # still trickling
    for c in slow:
        assert c.error is None and c.status == 408, outcome
        assert isinstance(c.answer, dict) and "did not arrive whole within" in c.answer["error"], outcome
        assert BODY_TIMEOUT_S - 0.5 < c.seconds < BODY_TIMEOUT_S + SLACK_S, outcome
        assert c.connection == "close" and c.closed, outcome
    assert after[0] == 200, after


def ray_processes(session_dir: Path) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(session_dir) in (proc / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(proc.name))
        except OSError:  # exited meanwhile
            pass
    return pids


def test_sigterm_stops_cleanly_and_frees_the_port(server, trained):
    """Last in this module: it stops the shared server."""
    proc, port, stdout, stderr = server
    session = (trained[1].parent / "logs" / "ray-serve").resolve().parent  # this server's Ray session
    assert ray_processes(session), "the server's Ray processes should be running"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=STOP_TIMEOUT_S) == 0, stderr.read_text()
    assert "Traceback" not in stderr.read_text() + stdout.read_text()
    assert listening_addresses(port) == set()
    with socket.socket() as s:  # as the next server would
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while ray_processes(session) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not ray_processes(session), "Ray's processes outlived the server"


def test_unknown_run_fails_fast_in_one_line(tmp_path):
    started = time.monotonic()
    proc = run_cli("serve", "no-such-run", "--storage", str(tmp_path), "--port", str(unused_port()), timeout=120)
    assert_one_line_error(proc, "no-such-run")
    assert time.monotonic() - started < 60  # no Ray started; imports only


def test_port_in_use_is_one_clear_error(trained, capsys):
    storage, _ = trained
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = cli_here(capsys, "serve", run_name(trained), "--storage", str(storage), "--port", str(port))
    assert_one_line_error(proc, f"127.0.0.1:{port}", "--port")


def test_direct_ingress_is_refused_where_it_cannot_work(trained, capsys):
    proc = cli_here(capsys, "serve", run_name(trained), "--storage", str(trained[0]), "--ingress", "direct",
                    "--replicas", "2", "--port", str(unused_port()))
    assert_one_line_error(proc, "--ingress direct", "--ingress proxy")


def test_an_onnx_export_through_rays_proxy_with_tta_flip_answers_as_the_pytorch_model_and_stops_cleanly(
        ray_cluster, trained, digit, tmp_path):
    """``--ingress proxy``, what several replicas or a joined cluster use (here the session's, which
    spares a Ray start), serving an ONNX export of the run with ``--engine onnxruntime --tta flip``:
    the same routes; the replica's probabilities are the flip-averaged Predictor's on the same
    export, and within float error of the PyTorch model's; the driver warns once that a digits
    model never saw a mirrored digit; Ctrl-C stops it and leaves the cluster as it was. One server
    for both: each Serve application costs a controller, a proxy and a replica, processes that
    import Ray Serve and torch."""
    import ray
    from ray import serve

    from imgtrain.inference.export import export

    pixels, _ = digit
    exported = export(trained[1], "onnx", tmp_path / "export").out
    flipped = Predictor(exported, tta="flip", engine="onnxruntime")
    torch_flipped = Predictor(trained[1], tta="flip").predict_proba(pixels[None])[0]
    free_cpus = ray.available_resources().get("CPU")
    try:
        with serving(trained[0], tmp_path, "--ingress", "proxy", "--address", ray_cluster, "--tta", "flip",
                     "--engine", "onnxruntime", run=str(exported)) as (proc, port, stdout, stderr):
            assert "through Ray Serve's proxy" in stdout.read_text()
            health = request(port, "/healthz")[1]
            assert (health["tta"], health["engine"]) == ("flip", "onnxruntime")
            assert "warning: --tta flip" in stderr.read_text()
            assert health["explain"] is False
            status, refused = request(port, "/explain", png_bytes(pixels), "image/png")  # no gradients in an export
            assert status == 409 and "explanations need the PyTorch checkpoint" in refused["error"], refused
            status, answer = request(port, "/predict", png_bytes(pixels), "image/png")
            assert status == 200, answer
            assert_prediction(answer, flipped.predict_proba(pixels[None])[0], flipped.loaded.preprocess.classes)
            assert_prediction(answer, torch_flipped, flipped.loaded.preprocess.classes)
            results = burst(port, [png_bytes(pixels)] * 8)
            assert [r[0] for r in results] == [200] * 8
            assert all(r[1]["index"] == answer["index"] for r in results)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=STOP_TIMEOUT_S) == 0, stderr.read_text()
        wait_for(lambda: ray.available_resources().get("CPU") == free_cpus, STOP_TIMEOUT_S,
                 "the replica's CPUs back in the session's cluster")
    finally:  # a server killed mid-test leaves Serve in the session's cluster: not for the tests after
        serve.shutdown()
