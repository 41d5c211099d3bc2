"""The run's heartbeat in the store, which is its driver's lease on the run.

The driver of a run writes {"host", "pid", "started", "time", "token"} to HEARTBEAT_FILE every
few seconds (``mirror.mirrored``), and {"released": true} with them when it ends. That object is
the run's lease: while it is held no other driver starts the run. It is held while it is not
released and fresh: its time no older than HEARTBEAT_STALE_S and no later than this machine's
clock allows (a heartbeat dated in the future was written by no driver now); on this host, its
process must also still run and be the one that wrote it (a pid is reused). pyarrow's
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
import warnings

from imgtrain.errors import ImgtrainError, ImgtrainWarning, one_line
from imgtrain.ops import process
from imgtrain.ops.remote import Store, where
from imgtrain.storage import ownership

# A "running" status from another host whose heartbeat is older than HEARTBEAT_STALE_S is a
# driver that is gone (runs.read_status). Generous: clocks of two machines differ a little, and a
# busy store answers late.
HEARTBEAT_FILE = "heartbeat.json"
HEARTBEAT_STALE_S = 60.0
# How far another machine's clock may run ahead of this one's: a heartbeat dated later than that
# (a clock far wrong, or a record no driver wrote) holds nothing, or it would hold the run forever.
CLOCK_SKEW_S = 30.0
LEASE_SETTLE_S = 3.0
_held: set[str] = set()  # the tokens of the leases this process holds


def lease_holder(record) -> str | None:
    """'process PID on HOST (its heartbeat N s ago)' while the heartbeat ``record`` holds the
    run; None when it is released, stale, dated in the future, of a process of this host that
    is gone, or no heartbeat at all."""
    if not isinstance(record, dict) or record.get("released") or not isinstance(record.get("time"), (int, float)):
        return None
    age = time.time() - record["time"]
    if not -CLOCK_SKEW_S <= age <= HEARTBEAT_STALE_S:
        return None
    host, pid = record.get("host"), record.get("pid")
    if host == socket.gethostname():
        if not process.pid_alive(pid):
            return None
        # this process (a notebook, a test) holds a lease only inside ``leased``
        if pid == os.getpid() and record.get("token") not in _held:
            return None
        started = process.started(pid)  # another process with the pid of a driver that is gone
        if started and record.get("started") and record["started"] != started:
            return None
    return f"process {pid} on {host} (its heartbeat {max(0.0, age):.0f} s ago)"


def dated_in_the_future(record) -> str | None:
    """What a heartbeat ``record`` that claims a time later than this machine's clock allows
    says (it is no lease); None for any other."""
    if not isinstance(record, dict) or record.get("released") or not isinstance(record.get("time"), (int, float)):
        return None
    ahead = record["time"] - time.time()
    if ahead <= CLOCK_SKEW_S:
        return None
    return (f"its heartbeat names process {one_line(str(record.get('pid')), 40)} on "
            f"{one_line(str(record.get('host')), 100)} at a time {ahead:.0f} s after this machine's clock, more "
            f"than the {CLOCK_SKEW_S:.0f} s two clocks may differ: a clock far wrong, or a record no driver wrote")


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
    record = {"host": socket.gethostname(), "pid": os.getpid(), "started": process.started(os.getpid()),
              "time": time.time(), "token": token}
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
    found = read_beat(st, name)
    holder = lease_holder(found)
    if holder:
        raise ImgtrainError(f"run {name!r} is being trained right now by {holder}; {hint}")
    future = dated_in_the_future(found)
    if future:  # a live driver with a clock that far ahead still keeps the run: it beats within the settling below
        warnings.warn(f"run {name!r} in {st.uri}: {future}; not honoured as a lease", ImgtrainWarning, stacklevel=3)
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
