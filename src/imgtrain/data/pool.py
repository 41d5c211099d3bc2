"""The process pool ``data prepare`` and ``data inspect`` work in: results in order, only a few
tasks in flight (memory stays bounded whatever the number of tasks)."""

from __future__ import annotations

import ast
import concurrent.futures
import multiprocessing
import os
import sys
import tokenize
import warnings
from collections import deque
from typing import Callable, Iterator, Sequence, TypeVar

from imgtrain.errors import ImgtrainWarning

Task = TypeVar("Task")


def ordered_map(work: Callable, tasks: Sequence[Task], workers: int) -> Iterator[tuple[Task, object]]:
    """(task, work(task)) in the order of ``tasks``: in a pool of ``workers`` processes (0: one
    per core) holding at most two tasks per process in flight, or in this process when there
    is one worker or at most two tasks. ``work`` and the tasks are pickled: ``work`` is a
    module-level function or a ``functools.partial`` of one."""
    if len(tasks) > 2 and workers != 1 and (where := unguarded_main_line()):
        warnings.warn_explicit("imgtrain works in this one process, not a pool: this line is outside `if __name__ == "
                               "\"__main__\":`, and each pool process, which imports the script, would run it again; "
                               "put the script's work under that guard to use every core", ImgtrainWarning, *where)
        workers = 1
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


def unguarded_main_line() -> tuple[str, int] | None:
    """(file, line) of the main script's line running now, when it is top-level code outside an
    ``if __name__ == "__main__":`` block: a 'spawn' pool process imports the script (as
    ``__mp_main__``) and would run that line again, starting a pool of its own, which Python
    refuses mid-import (the parent sees BrokenProcessPool). None when the pool is safe: an
    interactive session, ``python -c``, ``python -m package`` (its ``__main__`` is not
    imported again), or a call from inside the guard or from another thread."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    spec_name = getattr(getattr(main, "__spec__", None), "name", None) or ""
    if not path or spec_name == "__main__" or spec_name.endswith(".__main__"):
        return None
    frame, line = sys._getframe(1), None
    while frame is not None:  # the outermost frame of the script's own top-level code
        if frame.f_globals is main.__dict__ and frame.f_code.co_name == "<module>":
            line = frame.f_lineno
        frame = frame.f_back
    if line is None:
        return None
    try:
        with tokenize.open(path) as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None
    guarded = any(isinstance(node, ast.If) and _is_main_test(node.test)
                  and node.body[0].lineno <= line <= node.body[-1].end_lineno for node in ast.walk(tree))
    return None if guarded else (path, line)


def _is_main_test(test: ast.expr) -> bool:
    """``__name__ == "__main__"``, either way round."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    return {ast.unparse(test.left), ast.unparse(test.comparators[0])} == {"__name__", "'__main__'"}
