"""Headless Chromium for the browser tests: the binary (a failure under CI=true when missing),
and a page driven over the DevTools protocol (mouse, clicks, reading the DOM, screenshots)."""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    why = "no chromium binary on this machine (`make browser` or apt-get install chromium)"
    if os.environ.get("CI", "").lower() == "true":  # CI must check the page, never skip it
        pytest.fail(why)
    pytest.skip(why)


class BrowserPage:
    """One tab of a real headless Chromium at ``url``, driven over its DevTools websocket."""

    def __init__(self, url: str, profile: Path, size=(1000, 800), timeout: float = 60):
        from websockets.sync.client import connect

        self.url = url
        self.proc = subprocess.Popen(
            [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--remote-debugging-port=0", f"--user-data-dir={profile}", f"--window-size={size[0]},{size[1]}", url],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file, deadline = profile / "DevToolsActivePort", time.monotonic() + timeout
        while not port_file.is_file() or not port_file.read_text().strip():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.close()
                raise AssertionError("chromium did not open its DevTools port")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        targets = json.loads(NO_PROXY.open(f"http://127.0.0.1:{port}/json/list", timeout=10).read())
        page = next(t for t in targets if t["type"] == "page")
        self.closing = contextlib.ExitStack()
        self.ws = self.closing.enter_context(connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=10))
        self.ids = itertools.count(1)

    def send(self, method: str, **params) -> dict:
        msg_id = next(self.ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            reply = json.loads(self.ws.recv(timeout=60))
            if reply.get("id") == msg_id:
                if "error" in reply:
                    raise AssertionError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def js(self, expression: str):
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not self.js(expression):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {expression}")
            time.sleep(0.1)

    def wait_loaded(self, timeout: float = 30) -> None:
        """The page asked for is loaded, its images included. Right after Chromium starts, the tab
        may still show about:blank, which is "complete" too: a page's queries would find nothing."""
        self.wait_for(f"location.href === {json.dumps(self.url)} && document.readyState === 'complete' "
                      "&& [...document.images].every(i => i.complete)", timeout)

    def drag(self, points: list[tuple[float, float]]) -> None:
        """A mouse stroke through ``points`` (page coordinates), button held down."""
        first, *rest = points
        self.send("Input.dispatchMouseEvent", type="mousePressed", x=first[0], y=first[1], button="left",
                  buttons=1, clickCount=1)
        for x, y in rest:
            self.send("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y, button="left", buttons=1)
        self.send("Input.dispatchMouseEvent", type="mouseReleased", x=rest[-1][0], y=rest[-1][1], button="left",
                  buttons=0, clickCount=1)

    def choose_file(self, selector: str, path: Path) -> None:
        """As if the user picked ``path`` in the file input ``selector``."""
        root = self.send("DOM.getDocument")["root"]["nodeId"]
        node = self.send("DOM.querySelector", nodeId=root, selector=selector)["nodeId"]
        self.send("DOM.setFileInputFiles", files=[str(path)], nodeId=node)

    def screenshot(self, path: Path) -> Path:
        path.write_bytes(base64.b64decode(self.send("Page.captureScreenshot", format="png")["data"]))
        return path

    def close(self) -> None:
        if getattr(self, "closing", None) is not None:
            self.closing.close()
        self.proc.kill()
        self.proc.wait(timeout=30)
