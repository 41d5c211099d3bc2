"""A slowloris against the real ``imgtrain serve``: clients that send their
headers, then trickle the body a byte at a time, must neither take the places of requests waiting
for the model nor hold their connection past the body deadline."""

import http.client
import json
import select
import socket
import threading
import time

import pytest

from imgtrain.data.format import read_split
from imgtrain.inference.serve import Limits
from tests.integration.test_serve import png_bytes, request, serving, trained  # noqa: F401 (trained: a fixture)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

QUEUED, FORWARD_BATCH = 2, 2  # places for /predict requests in the replica: QUEUED + FORWARD_BATCH = 4
SLOW_CLIENTS = 6  # more than those places, fewer than Serve's ongoing requests per replica (2 x 4)
TRICKLE_S = 0.5  # a byte this often: an idle (per-read) timeout of more than this would never fire
BODY_TIMEOUT_S = Limits().body_timeout_s
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
                if self.status is not None:
                    s.settimeout(SLACK_S)
                    self.closed = s.recv(1) == b""  # 408 means the server is done with this connection
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


def test_clients_trickling_their_bodies_neither_starve_others_nor_hold_on(trained, tiny_data, tmp_path):  # noqa: F811
    _, images, _ = read_split(tiny_data, "test")
    png = png_bytes(images[0])
    options = ("--max-queued-requests", str(QUEUED), "--max-batch-size", str(FORWARD_BATCH))
    with serving(trained[0], tmp_path, *options) as (_, port, _, _):
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
