"""A rank's outbox (``health.Outbox``): the records the driver gets from a worker, and when.

What the display, metrics.jsonl and the watchdog rely on: every record arrives, in the order the
rank sent it, step records within a heartbeat (a second), anything else at once. What the
training step relies on: sending a step record makes no actor call (issue 51: a call from the
step cost it up to half a millisecond of the GIL). The actor handle is a stand-in that calls a
plain mailbox as Ray calls ``Monitor``'s methods; the outbox is the real one.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

from imgtrain.training.health import Outbox


class Mailbox:
    """The driver's side, as ``monitor.Monitor`` keeps it."""

    def __init__(self):
        self.records, self.beats, self.calls = [], [], []

    def push(self, *records):
        self.records.extend(records)

    def heartbeat(self, beat, records=()):
        self.records.extend(records)
        self.beats.append(beat)


class Handle:
    """``handle.method.remote(*args)``: counted, then run on the mailbox."""

    def __init__(self, mailbox: Mailbox):
        self.mailbox = mailbox

    def __getattr__(self, name):
        def remote(*args):
            self.mailbox.calls.append(name)
            getattr(self.mailbox, name)(*args)
        return SimpleNamespace(remote=remote)


def step(n):
    return {"kind": "step", "step": n}


def rank(n):
    return {"kind": "rank", "rank": 0, "step": n}


def test_step_records_make_no_call_and_go_with_the_next_heartbeat_in_order():
    mailbox = Mailbox()
    outbox = Outbox(Handle(mailbox))
    for n in (10, 20):
        outbox.send(step(n))
        outbox.send(rank(n))
    assert mailbox.calls == []  # nothing left the training step
    outbox.flush({"rank": 0, "phase": "compute"})
    assert mailbox.calls == ["heartbeat"]  # one call a second carries them
    assert mailbox.records == [step(10), rank(10), step(20), rank(20)]
    outbox.flush({"rank": 0, "phase": "compute"})  # a heartbeat with nothing waiting is still one
    assert mailbox.calls == ["heartbeat", "heartbeat"] and len(mailbox.records) == 4


def test_any_other_record_goes_at_once_after_the_step_records_before_it():
    mailbox = Mailbox()
    outbox = Outbox(Handle(mailbox))
    outbox.send({"kind": "phase", "phase": "loading data"})
    assert mailbox.records == [{"kind": "phase", "phase": "loading data"}]
    outbox.send(step(30))
    outbox.send(rank(30))
    outbox.send({"kind": "epoch", "epoch": 0, "step": 30})  # the epoch's last step record first
    assert mailbox.calls == ["push", "push"]
    assert [r["kind"] for r in mailbox.records] == ["phase", "step", "rank", "epoch"]
    outbox.flush()  # the rank stops: nothing waits, nothing is sent
    assert mailbox.calls == ["push", "push"]


def test_what_waits_when_the_rank_stops_is_sent():
    mailbox = Mailbox()
    outbox = Outbox(Handle(mailbox))
    outbox.send(step(5))
    outbox.flush()
    assert mailbox.records == [step(5)] and mailbox.beats == []


def test_records_sent_while_the_heartbeat_thread_flushes_all_arrive_in_order():
    mailbox = Mailbox()
    outbox = Outbox(Handle(mailbox))
    done = threading.Event()

    def heartbeats():
        while not done.is_set():
            outbox.flush({"rank": 0})

    beating = threading.Thread(target=heartbeats)
    beating.start()
    try:
        for n in range(20000):
            outbox.send(step(n))
            if n % 1000 == 999:
                outbox.send({"kind": "checkpoint", "step": n})
    finally:
        done.set()
        beating.join()
    outbox.flush()
    assert [r["step"] for r in mailbox.records if r["kind"] == "step"] == list(range(20000))
    kinds = [(r["kind"], r["step"]) for r in mailbox.records]
    assert kinds.index(("checkpoint", 999)) == kinds.index(("step", 999)) + 1


def test_a_rank_without_a_driver_sends_nothing():
    outbox = Outbox(None)
    outbox.send(step(1))
    outbox.send({"kind": "epoch", "epoch": 0})
    outbox.flush()
    assert outbox.waiting == []
