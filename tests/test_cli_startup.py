"""What the CLI does before any work: quick answers stay quick (no torch, no Ray for --version,
--help or a refusal), and a plan that oversubscribes the cores is said before Ray starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from imgtrain import cluster
from imgtrain.errors import ImgtrainWarning
from imgtrain.storage import location, ownership, runs
from imgtrain.training import tracking
from tests.conftest import quiet_display, tiny_config

# Each import costs seconds on a loaded 2-core machine (torch 2-8 s, ray.train 1-6 s) before the
# answer shows. numpy and pyarrow are allowed once the data set is read (its manifest's checks).
HEAVY = ("torch", "ray", "pandas", "matplotlib")
DATA = ("numpy", "pyarrow")

# The commands run one after another in one process: what one imports stays for the next, so
# the data set's check (numpy, pyarrow) comes last.
RUN_COMMANDS = """
import json, sys
from imgtrain import cli
commands, forbidden, out = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
for args, extra in commands:
    sys.argv = ["imgtrain", *args]
    try:
        cli.main()
        code = 0
    except SystemExit as e:
        code = e.code
    with open(out, "a") as f:
        print(json.dumps({"args": args, "code": code,
                          "imported": [m for m in forbidden + extra if m in sys.modules]}), file=f)
"""


def _stored_run(storage, data, name: str) -> None:
    """A run NAME in ``storage`` as the driver leaves it: its marker and its config."""
    cfg = tiny_config(data, storage, name)
    ownership.claim(location.run_path(str(storage), name))
    runs.write_config(location.run_path(str(storage), name), {**tracking.public_config(cfg), **runs.versions()})


def test_version_help_and_refusals_import_neither_torch_nor_ray(tmp_path):
    data = tmp_path / "data"  # never made: the run below is refused before its data set is read
    _stored_run(tmp_path / "runs", data, "taken")
    storage = ["--storage", str(tmp_path / "runs")]
    commands = [
        (["--version"], DATA), (["--help"], DATA), (["train", "--help"], DATA), (["data", "prepare", "--help"], DATA),
        (["tune", "--help"], DATA), (["train", "--name", "x", "--data", str(data), "--lr", "-1", *storage], DATA),
        (["train", "--name", "taken", "--data", str(data), "--lr", "0.5", *storage], DATA),
        (["train", "--name", "x", "--data", str(tmp_path / "missing"), *storage], []),
    ]
    done = subprocess.run([sys.executable, "-c", RUN_COMMANDS, json.dumps(commands), json.dumps(HEAVY),
                           str(tmp_path / "found.jsonl")],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    found = [json.loads(line) for line in (tmp_path / "found.jsonl").read_text().splitlines()]
    assert [(r["args"][:2], r["code"], r["imported"]) for r in found] == [
        (["--version"], 0, []), (["--help"], 0, []), (["train", "--help"], 0, []), (["data", "prepare"], 0, []),
        (["tune", "--help"], 0, []), (["train", "--name"], 2, []), (["train", "--name"], 2, []),
        (["train", "--name"], 2, []),
    ]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 3, done.stderr
    assert "--lr must be above 0" in errors[0] and "with a different config (lr: " in errors[1]
    assert "does not exist" in errors[2]


def test_more_workers_than_cores_are_warned_of_before_ray_starts(tiny_data, tmp_path, monkeypatch):
    import imgtrain

    cores = len(os.sched_getaffinity(0))  # what this process may run on
    # Ray cannot be imported: the warning must come before the run needs it
    monkeypatch.setitem(sys.modules, "ray", None)
    cfg = tiny_config(tiny_data, tmp_path, "crowded", workers=cores + 1)
    with pytest.warns(ImgtrainWarning) as warned, pytest.raises(ImportError, match="ray"):
        imgtrain.train(cfg, display=quiet_display())
    assert [str(w.message) for w in warned] == [
        f"{cores + 1} workers x 1 CPU = {cores + 1} CPUs on this machine's {cores} cores: they take turns on the "
        f"cores, and start-up and every step are that much slower; --workers {cores} or fewer fit"]


def test_workers_that_fit_the_cores_or_a_joined_cluster_are_not_warned_of(tiny_data, tmp_path, monkeypatch):
    import warnings

    monkeypatch.setitem(sys.modules, "ray", None)  # this process has joined no cluster (another test's)
    cores = cluster.cores()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ImgtrainWarning)
        cluster.warn_if_oversubscribed(tiny_config(tiny_data, tmp_path, "fits", workers=cores))
        # a joined cluster is held to its own CPUs when it is joined (check_resources)
        cluster.warn_if_oversubscribed(tiny_config(tiny_data, tmp_path, "joined", workers=cores + 1,
                                                   address="10.0.0.1:6379"))
        cluster.warn_if_oversubscribed(tiny_config(tiny_data, tmp_path, "local", workers=1, backend="local"))
    with pytest.warns(ImgtrainWarning, match="lower --cpus-per-worker"):
        cluster.warn_if_oversubscribed(tiny_config(tiny_data, tmp_path, "wide", workers=1, cpus_per_worker=cores + 1))


def test_every_name_of_the_api_resolves_in_a_fresh_process_in_any_order():
    """The API's names are imported when first used: each, the first touched or not, is the object itself."""
    code = ("import imgtrain, sys; names = sys.argv[1:]; "
            "print(*[type(getattr(imgtrain, n)).__name__ for n in names], imgtrain.__version__)")
    names = [n for n in __import__("imgtrain").__all__ if n != "ImgtrainError"]
    for order in (names, names[::-1]):
        done = subprocess.run([sys.executable, "-c", code, *order], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split()[-1] != "unknown"  # the installed package's version
