"""A port for a server a test starts in another process, which cannot be handed a bound socket.

Asking the kernel for port 0 and closing the socket is a race: the kernel hands the same
ephemeral port to the next ``bind(0)`` or outgoing connection, and with Ray running beside the
suite it did (a serve test's /healthz was answered by one of Ray's gRPC servers). So ports come
from below the kernel's ephemeral range and above Ray's worker ports (10002-19999), a block per
pytest process so that the two processes never offer the same one."""

from __future__ import annotations

import itertools
import os
import socket

FIRST, LAST = 20000, 32767  # Ray's max_worker_port is 19999; Linux's ephemeral range starts at 32768
_BLOCK = (LAST - FIRST + 1) // 8  # up to 8 pytest processes


def _block_start() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")  # "gw1" in the second process
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    return FIRST + (index % 8) * _BLOCK


_start = _block_start()
_offset = os.getpid() % _BLOCK  # a rerun soon after starts elsewhere than the last run's ports
_candidates = itertools.cycle([*range(_start + _offset, _start + _BLOCK), *range(_start, _start + _offset)])


def unused_port() -> int:
    """A 127.0.0.1 port of this process's block that nothing is bound to now."""
    for _ in range(_BLOCK):
        port = next(_candidates)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {_start}-{_start + _BLOCK - 1}")
