"""The mailbox from rank 0 to the driver: progress and history records, never a barrier."""

from __future__ import annotations

import ray


@ray.remote(num_cpus=0)
class Monitor:
    """Rank 0 pushes records fire-and-forget; the driver drains them twice a second."""

    def __init__(self):
        self.records: list[dict] = []

    def push(self, record: dict) -> None:
        self.records.append(record)

    def drain(self) -> list[dict]:
        out, self.records = self.records, []
        return out
