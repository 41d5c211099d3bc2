"""Dynamic batching for ``serve``: single images from concurrent requests, one forward pass.

Hand-written instead of ``@serve.batch`` because of what was measured (BENCHMARKS.md, issue 23):
``@serve.batch`` forms the next batch as soon as its wait expires and queues it behind the one
running, so on 2 cores its batches stayed at 1.3-1.4 images under 64 concurrent clients. Here the
next batch is formed when the model is free, from everything that arrived meanwhile: under load
batches grow by themselves, and a lone request waits at most ``wait_s``.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

import numpy as np


class Batcher:
    """``await batcher(image)`` -> that image's row of ``run(np.stack(images))``.

    ``run`` is an async function from uint8 [B, H, W, C] to an array with one row per image,
    called once at a time, with at most ``max_size`` images.
    """

    def __init__(self, run: Callable[[np.ndarray], Awaitable[np.ndarray]], max_size: int, wait_s: float):
        self.run, self.max_size, self.wait_s = run, max_size, wait_s
        self.pending: list[tuple[np.ndarray, asyncio.Future]] = []
        self.arrived = asyncio.Event()
        self.worker: asyncio.Task | None = None

    async def __call__(self, image: np.ndarray) -> np.ndarray:
        answer = asyncio.get_running_loop().create_future()
        self.pending.append((image, answer))
        self.arrived.set()
        if self.worker is None:  # started in the loop that serves the requests
            self.worker = asyncio.create_task(self._work())
        return await answer

    async def _work(self) -> None:
        while True:
            await self.arrived.wait()
            if len(self.pending) < self.max_size and self.wait_s > 0:
                await asyncio.sleep(self.wait_s)  # let the requests arriving together join
            batch, self.pending = self.pending[: self.max_size], self.pending[self.max_size:]
            if not self.pending:
                self.arrived.clear()
            batch = [(image, answer) for image, answer in batch if not answer.done()]  # timed out: skipped
            if not batch:
                continue
            try:
                rows = await self.run(np.stack([image for image, _ in batch]))
            except Exception as e:  # every request of the batch gets the error
                for _, answer in batch:
                    if not answer.done():
                        answer.set_exception(e)
                continue
            for (_, answer), row in zip(batch, rows):
                if not answer.done():
                    answer.set_result(row)
