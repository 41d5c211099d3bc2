"""The process pool ``data prepare`` and ``data inspect`` work in: results in order, only a few
tasks in flight (memory stays bounded whatever the number of tasks)."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
from collections import deque
from typing import Callable, Iterator, Sequence, TypeVar

Task = TypeVar("Task")


def ordered_map(work: Callable, tasks: Sequence[Task], workers: int) -> Iterator[tuple[Task, object]]:
    """(task, work(task)) in the order of ``tasks``: in a pool of ``workers`` processes (0: one
    per core) holding at most two tasks per process in flight, or in this process when there
    is one worker or at most two tasks. ``work`` and the tasks are pickled: ``work`` is a
    module-level function or a ``functools.partial`` of one."""
    if len(tasks) <= 2 or workers == 1:
        for task in tasks:
            yield task, work(task)
        return
    processes = workers or os.cpu_count() or 1
    # spawn, not fork: the caller may have threads (Ray, a notebook) that a fork would copy mid-step
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(processes, mp_context=context) as pool:
        pending: deque = deque()
        queue = iter(tasks)
        for task in queue:
            pending.append((task, pool.submit(work, task)))
            if len(pending) >= 2 * processes:
                break
        while pending:
            task, future = pending.popleft()
            yield task, future.result()
            nxt = next(queue, None)
            if nxt is not None:
                pending.append((nxt, pool.submit(work, nxt)))
