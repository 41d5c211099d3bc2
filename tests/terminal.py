"""A real terminal for the CLI: a pseudo-terminal of a given size whose output a terminal
emulator (pyte) turns into the screen a person would read, at any moment of the run."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import signal
import struct
import subprocess
import termios
import threading

import pyte


class Terminal:
    """``args`` running in a ``columns`` x ``lines`` terminal; ``text()`` is the screen now."""

    def __init__(self, args: list[str], cwd, columns: int = 140, lines: int = 30, stderr=None):
        """``stderr``: a file the command's stderr goes to instead (``2>file`` in a shell)."""
        self.screen = pyte.Screen(columns, lines)
        self.stream = pyte.ByteStream(self.screen)
        self.lock = threading.Lock()
        self.closing = threading.Event()
        leader, follower = pty.openpty()
        fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", lines, columns, 0, 0))
        self.proc = subprocess.Popen(
            args, stdin=follower, stdout=follower, stderr=follower if stderr is None else stderr, cwd=cwd,
            start_new_session=True,
            env={**os.environ, "TERM": "xterm-256color", "COLUMNS": str(columns), "LINES": str(lines)})
        os.close(follower)
        self.leader = leader
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def hang_up(self) -> None:
        """Close the terminal, as closing its window does: the command's reads and writes on it
        fail from now on (EIO). The shell that ran the command would then send it SIGHUP
        (``os.killpg``): the caller does, when it wants to."""
        self.closing.set()
        self.reader.join()  # not reading it any more: closing the leader now hangs the terminal up
        os.close(self.leader)
        self.leader = None

    def _read(self) -> None:
        while not self.closing.is_set():
            if not select.select([self.leader], [], [], 0.1)[0]:
                continue
            try:
                data = os.read(self.leader, 65536)
            except OSError:  # EIO: every process holding the terminal has closed it
                return
            if not data:
                return
            with self.lock:
                self.stream.feed(data)

    def text(self) -> str:
        """The screen as a person reads it: its lines, trailing blanks and empty lines dropped."""
        with self.lock:
            return "\n".join(line.rstrip() for line in self.screen.display).rstrip("\n")

    def wait(self, timeout: float) -> int:
        """The command's exit status, once it has exited and all it drew is on the screen."""
        code = self.proc.wait(timeout=timeout)
        self.reader.join(timeout=10)
        return code

    def __enter__(self) -> Terminal:
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:  # a failed test: no command left running
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.leader is not None:
            os.close(self.leader)
