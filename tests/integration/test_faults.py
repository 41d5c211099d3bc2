"""Failures for real on Ray: a rank that stops making progress, a disk that fills up."""

from __future__ import annotations

import io
import re
import subprocess
from pathlib import Path

import pytest
from rich.console import Console

import imgtrain
from imgtrain.checkpoint_policy import POLICY
from imgtrain.config import TrainConfig
from imgtrain.errors import ImgtrainError
from imgtrain.storage import checkpoint as ckpt
from imgtrain.storage import runs
from imgtrain.training.faults import ENV_VAR as FAULT_ENV
from imgtrain.training.progress import TrainingDisplay
from tests.conftest import quiet_display

pytestmark = pytest.mark.integration


def test_a_stuck_rank_is_named_and_killed_within_the_stall_timeout(ray_cluster, tiny_data, tmp_path, monkeypatch):
    # Rank 1 stops making progress before its forward pass of step 3 (it sleeps forever, the
    # process alive); rank 0 waits in DDP's all-reduce, which by default would wait forever.
    # The driver runs here: what the terminal would show is what this display prints, and
    # `imgtrain train` prints the error's message after "error: " (exit 2).
    monkeypatch.setenv(FAULT_ENV, "hang:1:3")
    shown = io.StringIO()
    with pytest.raises(ImgtrainError) as failed:
        imgtrain.train(TrainConfig(data=str(tiny_data), name="stuck", epochs=1, batch_size=32, storage=str(tmp_path),
                                   stall_timeout_s=8, log_every_steps=1, model="timm:test_resnet", ingest="torch"),
                       display=TrainingDisplay(Console(file=shown, width=200)))

    message = str(failed.value)
    assert len(message.splitlines()) == 1, message
    assert message.startswith("training failed: rank 1 stuck: rank 1 (pid "), message
    assert "at step 3, in phase 'compute'" in message and "(rank 0 waited for it)" in message
    assert "no progress for 8 s (--stall-timeout)" in message

    # The diagnosis: the stuck rank's Python stack (where it hangs), its log files, where the
    # other rank waits, and every rank's full stacks in logs/hang-*.txt.
    out = shown.getvalue()
    stack = out.split("rank 1 (stuck) stack, innermost last:\n")[1].split("rank 1 logs")[0]
    frames = [line.strip() for line in stack.splitlines() if line.strip()]
    assert frames[0].endswith("in run_loop") and "training/loop.py" in frames[0]
    assert "faults.py" in frames[-1] and frames[-1].endswith("in maybe_fire"), frames  # the injected hang
    logs_line = next(line for line in out.splitlines() if line.strip().startswith("rank 1 logs (on "))
    log_files = logs_line.split("): ", 1)[1].split(", ")
    assert [Path(p).suffix for p in log_files] == [".out", ".err"] and all(Path(p).is_file() for p in log_files)
    assert "rank 0 waits in: File " in out
    report = Path(re.search(r"stacks and logs: (\S+hang-[0-9-]+\.txt)", message).group(1))
    assert "OOM" not in message  # the rank the watchdog killed is not reported as a possible OOM kill
    assert report.parent == tmp_path / "stuck" / "logs"
    text = report.read_text()
    assert "(pid" in text and ": STUCK" in text and ": waiting" in text
    assert text.count("in run_loop") == 2 and "in maybe_fire" in text  # both ranks' training threads

    records = runs.read_metrics(tmp_path / "stuck")
    last_step = max(r["time"] for r in records if r["kind"] == "step")
    failed_at = runs.read_status(tmp_path / "stuck")["time"]
    assert failed_at - last_step < 8 + 30  # detected and ended soon after the timeout, not never


def test_a_full_disk_leaves_no_broken_checkpoint_and_says_the_disk_is_full(ray_cluster, tiny_data, tmp_path):
    storage = tmp_path / "small-disk"
    storage.mkdir()
    # 280 MB: room for one checkpoint (about 171 MB for ResNet-18 with AdamW state), not two.
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=280m", "tmpfs", str(storage)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({mounted.stderr.strip()}); needs root")
    try:
        # In this process: what `imgtrain train` prints after "error: " (exit 2) is the message.
        # One worker (rank 0 alone writes checkpoints), two epochs of two steps: the second
        # epoch's checkpoint is the one that does not fit.
        with pytest.raises(ImgtrainError) as failed:
            imgtrain.train(TrainConfig(data=str(tiny_data), name="full", workers=1, threads_per_worker=1, epochs=2,
                                       batch_size=32, limit_train_batches=2, storage=str(storage), ingest="torch"),
                           display=quiet_display())
        message = str(failed.value)
        assert "is full (No space left on device)" in message, message
        assert "resumes from checkpoint_epoch_0000" in message
        run_dir = storage / "full"
        good, bad = ckpt.verified(run_dir)
        assert [p.name for p in good] == [POLICY.epoch_name(0)] and bad == []
        leftovers = [d.name for d in run_dir.iterdir() if d.is_dir() and POLICY.is_checkpoint(d.name)
                     and d not in good]
        assert leftovers == []  # nothing half written left visible
        model, _ = imgtrain.load_model(good[0])  # the last good checkpoint still loads
        assert sum(p.numel() for p in model.parameters()) > 11_000_000
    finally:
        subprocess.run(["umount", "-l", str(storage)], check=False)
