"""The try page of ``imgtrain serve`` in a real headless Chromium, for a digits model and for a
photo model. The page is the one the server sends (``try_page.PAGE``, with its Content-Security-
Policy); what answers it here is a small HTTP server speaking the routes' /healthz and /predict,
so no model has to be trained and served by Ray for a look at the page (tests/integration/
test_serve.py drives the page against the real server)."""

from __future__ import annotations

import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from PIL import Image

from imgtrain.inference.try_page import CONTENT_SECURITY_POLICY, PAGE
from tests.browser import BrowserPage, chromium

ANSWER = {"label": "cat", "index": 0, "confidence": 0.9, "probabilities": {"cat": 0.9, "dog": 0.1}}


def healthz(preset: str, shape: list[int]) -> dict:
    """/healthz as routes.ModelServer answers it."""
    return {"status": "ok", "checkpoint": "pets/checkpoint_epoch_0003", "classes": ["cat", "dog"],
            "image_shape": shape, "forward_passes": 0, "images_predicted": 0, "tta": "none", "engine": "torch",
            "preset": preset}


class Server:
    """The page and the two routes it calls on 127.0.0.1; ``received``: each /predict's (type, body)."""

    def __init__(self, health: dict, answer: dict = ANSWER):
        self.received: list[tuple[str, bytes]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def reply(self, body: bytes, content_type: str, **headers):
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                for name, value in headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/":
                    self.reply(PAGE.encode(), "text/html; charset=utf-8",
                               **{"Content-Security-Policy": CONTENT_SECURITY_POLICY})
                else:
                    self.reply(json.dumps(health).encode(), "application/json")

            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                outer.received.append((self.headers["Content-Type"], body))
                self.reply(json.dumps(answer).encode(), "application/json")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def opened(tmp_path):
    """open(health) -> (the page in Chromium, the server)."""
    chromium()  # skips (fails under CI=true) without one
    made = []

    def open_page(health: dict, answer: dict = ANSWER):
        server = Server(health, answer)
        page = BrowserPage(server.url, tmp_path / f"profile{len(made)}", size=(1000, 800))
        made.append((page, server))
        page.wait_for("document.body !== null && document.body.dataset.ready === '1'")
        return page, server

    yield open_page
    for page, server in made:
        page.close()
        server.close()


VISIBLE = "(id => { const r = document.getElementById(id).getBoundingClientRect(); return [r.width, r.height]; })"


def test_a_photo_model_gets_a_photo_drop_and_paste_and_no_drawing_pad(opened, tmp_path):
    """A colour photo model was offered the digits' black drawing pad."""
    page, server = opened(healthz("photos", [96, 96, 3]))
    assert page.js(f"{VISIBLE}('pad')") == [0, 0]  # not shown: strokes on black mean nothing to it
    assert page.js("document.body.dataset.mode") == "photos"
    width, height = page.js(f"{VISIBLE}('drop')")
    assert width >= 300 and height >= 150 and "paste" in page.js("document.getElementById('drop').textContent")

    photo = tmp_path / "cat.jpg"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (60, 80, 3), np.uint8)).save(photo)
    page.choose_file("#file", photo)
    page.wait_for("document.body.dataset.state === 'answered'")
    assert server.received == [("image/jpeg", photo.read_bytes())]
    assert page.js("document.getElementById('top').textContent") == "cat"
    page.screenshot(tmp_path / "photos.png")

    # A pasted image (a screenshot, an image copied in another tab) is sent as it is.
    page.js("document.body.dataset.state = ''")
    page.js("""(async () => {
      const c = document.createElement('canvas'); c.width = 4; c.height = 3;
      const blob = await new Promise(done => c.toBlob(done, 'image/png'));
      const data = new DataTransfer(); data.items.add(new File([blob], 'pasted.png', { type: 'image/png' }));
      document.dispatchEvent(new ClipboardEvent('paste', { clipboardData: data }));
    })()""")
    page.wait_for("document.body.dataset.state === 'answered'")
    content_type, body = server.received[-1]
    assert content_type == "image/png" and Image.open(io.BytesIO(body)).size == (4, 3)


def test_a_digits_model_keeps_the_drawing_pad(opened):
    page, _ = opened(healthz("digits", [28, 28, 1]))
    assert page.js(f"{VISIBLE}('pad')") == [280, 280]


def test_a_server_without_a_preset_is_read_by_its_channels(opened):
    """A server of an earlier imgtrain answers /healthz without "preset"."""
    health = healthz("photos", [64, 64, 3])
    del health["preset"]
    page, _ = opened(health)
    assert page.js(f"{VISIBLE}('pad')") == [0, 0] and page.js("document.body.dataset.mode") == "photos"


def test_a_multi_label_model_shows_every_label_over_its_threshold(opened, tmp_path):
    """A multi-label server answers {"labels": [...], "probabilities"} (routes.py): every label at or
    over its threshold is listed, however many, and none when there is none."""
    labels = [{"label": name, "probability": p} for name, p in
              [("dog", 0.97), ("cat", 0.91), ("tree", 0.88), ("car", 0.7), ("sky", 0.66), ("sun", 0.51)]]
    probabilities = {**{l["label"]: l["probability"] for l in labels}, "boat": 0.4}
    page, _ = opened({**healthz("photos", [32, 32, 3]), "multi_label": True},
                     {"labels": labels, "probabilities": probabilities})
    photo = tmp_path / "scene.png"
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(photo)
    page.choose_file("#file", photo)
    page.wait_for("document.body.dataset.state === 'answered'")
    listed = page.js("[...document.querySelectorAll('#result li')].map(li => li.dataset.class)")
    assert listed == ["dog", "cat", "tree", "car", "sky", "sun"]  # six: not the single-label top five
    assert page.js("document.getElementById('top').textContent") == "dog, cat, tree, car, sky, sun"


def test_a_multi_label_answer_without_a_label_says_so(opened, tmp_path):
    page, _ = opened({**healthz("photos", [32, 32, 3]), "multi_label": True},
                     {"labels": [], "probabilities": {"cat": 0.2, "dog": 0.1}})
    photo = tmp_path / "empty.png"
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(photo)
    page.choose_file("#file", photo)
    page.wait_for("document.body.dataset.state === 'answered'")
    assert page.js("document.querySelectorAll('#result li').length") == 0
    assert page.js("document.getElementById('top').textContent") == "no label over its threshold"
