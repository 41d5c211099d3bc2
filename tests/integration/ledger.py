"""The sample ledger read back (``--ledger``): which rows went into each global step, as the
final weights saw them. Shared by the tests that prove a run resumed, retried or resized
trained on exactly what an uninterrupted run trains on (test_resume.py has the same reading)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from imgtrain.storage import runs


def ledger_lines(run_dir: Path) -> list[dict]:
    return [line for path in sorted((run_dir / "ledger").glob("rank-*.jsonl")) for line in runs.read_jsonl(path)]


def committed_batches(run_dir: Path) -> dict[int, dict[int, list[int]]]:
    """{global step: {rank: ids}} as they went into the final weights: when a step was trained
    again after a failure, the worker group that trained it last is the one whose update
    survived (the dead group's work after its last checkpoint was lost with it)."""
    started: dict[int, float] = {}
    steps: dict[int, dict[int, dict[int, list[int]]]] = defaultdict(lambda: defaultdict(dict))
    for line in ledger_lines(run_dir):
        started[line["group"]] = min(started.get(line["group"], line["group_started"]), line["group_started"])
        steps[line["step"]][line["group"]][line["rank"]] = line["ids"]
    return {step: by_group[max(by_group, key=started.get)] for step, by_group in steps.items()}


def global_batches(run_dir: Path) -> dict[int, list[int]]:
    """{global step: the ids of the whole global batch, rank 0's rows first}."""
    return {step: [i for rank in sorted(ranks) for i in ranks[rank]]
            for step, ranks in committed_batches(run_dir).items()}
