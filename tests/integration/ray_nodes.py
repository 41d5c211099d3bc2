"""Ray nodes a test starts with `ray start`, as users do: the command, waiting for its start, and
finding what outlived it."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

RAY = str(Path(sys.executable).parent / "ray")


def wait_for_line(log: Path, text: str, proc: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while text not in (log.read_text(errors="replace") if log.exists() else ""):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"no {text!r} from {proc.args} (exit {proc.poll()}):\n{log.read_text()[-3000:]}")
        time.sleep(0.3)


def processes_mentioning(fragment: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if fragment.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
    return found
