"""The mailbox from the workers to the driver: records and heartbeats, never a barrier."""

from __future__ import annotations

import ray


@ray.remote(num_cpus=0)
class Monitor:
    """Rank 0 pushes progress and history records, every rank heartbeats (with its step
    records), all fire and forget; the driver drains them twice a second."""

    def __init__(self):
        self.records: list[dict] = []
        self.beats: dict[tuple[int, int], dict] = {}  # (rank, pid) -> its latest heartbeat

    def push(self, *records: dict) -> None:
        self.records.extend(records)

    def heartbeat(self, beat: dict, records: list[dict] = ()) -> None:
        """A rank's heartbeat, with the records that waited for it (``health.Outbox``)."""
        self.records.extend(records)
        self.beats[(beat["rank"], beat["pid"])] = beat

    def drain(self) -> tuple[list[dict], list[dict]]:
        out, self.records = self.records, []
        beats, self.beats = list(self.beats.values()), {}
        return out, beats
