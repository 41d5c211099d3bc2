"""A TCP proxy in front of the test S3 server that can lose the way to it, as a real outage does:
every open connection is dropped and new ones are refused (nothing listens on its port) until
``restore()``. ``cut_on``: the outage starts the moment a request starting with those bytes
arrives (that request is not forwarded)."""

from __future__ import annotations

import socket
import threading


class FlakyStore:
    def __init__(self, upstream: str, cut_on: bytes | None = None):
        host, _, port = upstream.removeprefix("http://").rpartition(":")
        self.upstream = (host, int(port))
        self.cut_on = cut_on
        self.was_cut = threading.Event()
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._start()

    def _start(self) -> None:
        threading.Thread(target=self._accept, args=(self._listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # closed: the store is unreachable
                return
            upstream = socket.create_connection(self.upstream)
            with self._lock:
                self._connections |= {client, upstream}
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if from_client and self.cut_on and self.cut_on in data and not self.was_cut.is_set():
                    self.cut()
                    return
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            self._close(sock)

    def _close(self, sock: socket.socket) -> None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()
        with self._lock:
            self._connections.discard(sock)

    def cut(self) -> None:
        """The store becomes unreachable: connections dropped, new ones refused."""
        self.was_cut.set()
        self._close(self._listener)  # shutdown wakes the accept() blocked on it
        with self._lock:
            open_now = list(self._connections)
        for sock in open_now:
            self._close(sock)

    def restore(self) -> None:
        """The store is back, on the same address."""
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._start()

    def close(self) -> None:
        self.cut()
