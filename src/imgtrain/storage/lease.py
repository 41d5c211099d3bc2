"""The run's heartbeat in the store, which is its driver's lease on the run.

The driver of a run writes {"host", "pid", "time", "token"} to HEARTBEAT_FILE every few seconds
(``mirror.mirrored``), and {"released": true} with them when it ends. That object is the run's
lease: while it is held (not released, and fresh: a driver on this host that still runs, another
host's beat younger than HEARTBEAT_STALE_S) no other driver starts the run. pyarrow's
filesystems offer no conditional put, so two drivers that start at the same moment settle it
as leader elections on eventually quiet registers do: each writes its token, waits, and reads
the lease back; the last writer's token is there for both, and only its driver goes on. This
holds while either driver's read and write of the lease are less than LEASE_SETTLE_S apart.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid

from imgtrain.errors import ImgtrainError
from imgtrain.ops import ownership, process
from imgtrain.ops.remote import Store, where

# A "running" status from another host whose heartbeat is older than HEARTBEAT_STALE_S is a
# driver that is gone (runs.read_status). Generous: clocks of two machines differ a little, and a
# busy store answers late.
HEARTBEAT_FILE = "heartbeat.json"
HEARTBEAT_STALE_S = 60.0
LEASE_SETTLE_S = 3.0
_held: set[str] = set()  # the tokens of the leases this process holds


def lease_holder(record) -> str | None:
    """'process PID on HOST (its heartbeat N s ago)' while the heartbeat ``record`` holds the
    run; None when it is released, stale, or no heartbeat at all."""
    if not isinstance(record, dict) or record.get("released") or not isinstance(record.get("time"), (int, float)):
        return None
    host, pid = record.get("host"), record.get("pid")
    if host == socket.gethostname():
        # this process (a notebook, a test) holds a lease only inside ``leased``
        if not process.pid_alive(pid) or pid == os.getpid() and record.get("token") not in _held:
            return None
    elif time.time() - record["time"] > HEARTBEAT_STALE_S:
        return None
    return f"process {pid} on {host} (its heartbeat {max(0.0, time.time() - record['time']):.0f} s ago)"


def read_beat(st: Store, name: str):
    """The run's heartbeat in the store (None: none, or not JSON). Read again when it is not
    JSON: pyarrow reads an object as its size, then ranges of it, so a read while its driver
    replaces it can get pieces of two versions (seen against moto: the new record and a byte of
    the old one)."""
    path = f"{st.root}/{ownership.check_name(name)}/{HEARTBEAT_FILE}"
    for attempt in range(3):
        try:
            with st.fs.open_input_stream(path) as f:
                return json.loads(f.read(1 << 16))
        except FileNotFoundError:
            return None
        except ValueError:
            continue
        except OSError as e:
            raise where(e, st) from None
    return None


def beat(st: Store, name: str, token: str | None = None, released: bool = False) -> None:
    """Write the run's heartbeat to the store: its driver (this process) is alive (or is done)."""
    record = {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time(), "token": token}
    if released:
        record["released"] = True
    try:
        with st.fs.open_output_stream(f"{st.root}/{ownership.check_name(name)}/{HEARTBEAT_FILE}") as f:
            f.write(json.dumps(record).encode())
    except OSError as e:
        raise where(e, st) from None


@contextlib.contextmanager
def leased(st: Store | None, name: str, hint: str = "wait for it or stop it"):
    """Hold the run's lease while the block runs (a driver); yields its token (None without a
    store). Refused, before anything of the run is written, while another driver holds it, or
    when another one took it at the same moment."""
    if st is None:
        yield None
        return
    holder = lease_holder(read_beat(st, name))
    if holder:
        raise ImgtrainError(f"run {name!r} is being trained right now by {holder}; {hint}")
    token = uuid.uuid4().hex
    started = time.monotonic()
    beat(st, name, token)
    time.sleep(max(LEASE_SETTLE_S, 4 * (time.monotonic() - started)))  # a slow store: a longer window
    now = read_beat(st, name)
    if not isinstance(now, dict) or now.get("token") != token:
        raise ImgtrainError(f"run {name!r} was started at the same moment by {lease_holder(now) or 'another driver'}; "
                            f"that one trains it, this one stopped before writing anything: {hint}")
    _held.add(token)
    try:
        yield token
    finally:
        _held.discard(token)
        with contextlib.suppress(Exception):  # a store gone now: the heartbeat goes stale instead
            if (read_beat(st, name) or {}).get("token") == token:
                beat(st, name, token, released=True)
