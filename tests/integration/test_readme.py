"""The README's Python code, run as a user runs it (issue 46): its ```python blocks, in order,
as one script in an empty folder, in a Python process of its own. It runs as written: the
embedded digits need no download, and the training settings a user would shorten for a quick
try come from a config file named by IMGTRAIN_CONFIG, as a user could name one too."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

README = Path(__file__).resolve().parents[2] / "README.md"
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
# one epoch of two steps in this process: what is checked is that the code runs, not what it learns
QUICK = """\
backend = "local"
epochs = 1
limit_train_batches = 2
bn_calibration = 64
"""


def test_the_readmes_python_runs_as_a_users_script(tmp_path):
    blocks = PYTHON_BLOCK.findall(README.read_text())
    assert blocks, "no ```python block in the README: is the pattern broken?"
    script = tmp_path / "readme.py"
    script.write_text("\n".join(blocks))
    (tmp_path / "quick.toml").write_text(QUICK)
    env = {**os.environ, "IMGTRAIN_CONFIG": str(tmp_path / "quick.toml")}
    proc = subprocess.run([sys.executable, script.name], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "settings from IMGTRAIN_CONFIG: backend, bn_calibration, epochs, limit_train_batches" in proc.stdout
    config = json.loads((tmp_path / "runs" / "demo" / "config.json").read_text())
    assert (config["epochs"], config["backend"], config["workers"]) == (1, "local", 2)  # the script's workers kept
    assert json.loads((tmp_path / "runs" / "demo" / "status.json").read_text())["status"] == "finished"
