"""imgtrain as a library in a notebook: train and evaluate in one Python process, and the
process is left as it was found (environment, file descriptors, loggers, warnings, torch).

It runs in a fresh interpreter of its own: the state it checks is the whole process's.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

SCRIPT = r'''
import json, logging, os, signal, sys, warnings
import torch

def state():
    loggers = {}
    for name in ("", "ray", "ray.train", "ray.data", "mlflow", "alembic"):
        logger = logging.getLogger(name)
        loggers[name or "root"] = [logger.level, logger.propagate, [type(h).__name__ for h in logger.handlers]]
    return {
        "environ": dict(os.environ), "fd2": os.readlink("/proc/self/fd/2"), "stdout": repr(sys.stdout),
        "loggers": loggers, "threads": torch.get_num_threads(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "rng": torch.get_rng_state().tolist()[:64], "showwarning": repr(warnings.showwarning),
        "signals": {s.name: repr(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM)},
        "cwd": os.getcwd(),
    }

torch.set_num_threads(1)  # a notebook's own choices, which imgtrain must leave alone
torch.manual_seed(1234)
import ray.data
bars = ray.data.DataContext.get_current().enable_progress_bars
before = state()
import imgtrain
cfg = imgtrain.TrainConfig(data=sys.argv[1], storage=sys.argv[2], name="nb", backend="local", epochs=1,
                           batch_size=64, eval_batch_size=50, deterministic=True, limit_train_batches=2)
result = imgtrain.train(cfg, display=None)
local = imgtrain.evaluate("nb", storage=sys.argv[2], options=imgtrain.InferenceOptions(backend="local", threads=2))
on_ray = imgtrain.evaluate("nb", storage=sys.argv[2])  # starts Ray, shuts it down
import ray
after = state()
print(json.dumps({"before": before, "after": after, "accuracy": [local.accuracy, on_ray.accuracy],
                  "ray_running": ray.is_initialized(), "status": result.status,
                  "progress_bars": [bars, ray.data.DataContext.get_current().enable_progress_bars]}))
'''


def test_train_and_evaluate_leave_the_process_as_they_found_it(tiny_data, tmp_path):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_data), str(tmp_path / "runs")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    before, after = out["before"], out["after"]
    assert out["status"] == "finished" and out["accuracy"][0] == out["accuracy"][1]
    assert not out["ray_running"] and out["progress_bars"][0] == out["progress_bars"][1]
    added = {k: v for k, v in after["environ"].items() if before["environ"].get(k) != v}
    assert added == {}, added  # e.g. RAY_TRAIN_ENABLE_PREEMPTION_WATCHER, MLFLOW_DISABLE_TELEMETRY
    assert [k for k in before["environ"] if k not in after["environ"]] == []
    for key in ("fd2", "stdout", "loggers", "threads", "deterministic", "rng", "showwarning", "signals", "cwd"):
        assert after[key] == before[key], key
