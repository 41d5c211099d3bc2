import json

from imgtrain import checkpoint as ckpt
from imgtrain import runs


def test_metrics_log_drops_records_past_a_restart_point(tmp_path):
    log = runs.MetricsLog(tmp_path)
    log.append({"kind": "start", "step": 0})
    for epoch in range(3):
        log.append({"kind": "epoch", "epoch": epoch, "step": (epoch + 1) * 10, "val_accuracy": 0.1})
    # Restart from the checkpoint of epoch 0 (step 10): epochs 1 and 2 are redone.
    log.append({"kind": "start", "step": 10})
    log.append({"kind": "epoch", "epoch": 1, "step": 20, "val_accuracy": 0.2})
    history = runs.epoch_history(tmp_path)
    assert [r["epoch"] for r in history] == [0, 1]
    assert history[1]["val_accuracy"] == 0.2
    lines = (tmp_path / runs.METRICS_FILE).read_text().splitlines()
    assert sum(json.loads(line)["kind"] == "epoch" for line in lines) == 2


def make_ckpt(run_dir, epoch, acc):
    d = run_dir / f"checkpoint_epoch_{epoch:04d}"
    ckpt.save(d, {}, {}, {"epoch": epoch, "step": epoch * 10, "metrics": {"val_accuracy": acc}})
    return d


def test_retention_keeps_best_and_latest(tmp_path):
    dirs = [make_ckpt(tmp_path, e, acc) for e, acc in enumerate([0.5, 0.9, 0.7, 0.6])]
    runs.retain(tmp_path, num_to_keep=1)
    assert [p for p, _ in runs.list_checkpoints(tmp_path)] == [dirs[1], dirs[3]]
    assert runs.best_and_latest(tmp_path) == (dirs[1], dirs[3])


def test_incomplete_checkpoint_is_invisible(tmp_path):
    make_ckpt(tmp_path, 0, 0.5)
    (tmp_path / "checkpoint_epoch_0001").mkdir()  # a crash before meta.json was written
    assert [p.name for p, _ in runs.list_checkpoints(tmp_path)] == ["checkpoint_epoch_0000"]


def test_status_of_a_killed_driver_reads_interrupted(tmp_path):
    (tmp_path / runs.STATUS_FILE).write_text(json.dumps(
        {"status": "running", "pid": 2**22 + 12345, "host": __import__("socket").gethostname()}))
    assert runs.read_status(tmp_path)["status"] == "interrupted"


def test_checkpoint_meta_without_metrics_does_not_break_listing(tmp_path):
    ckpt.save(tmp_path / "checkpoint_epoch_0000", {}, {}, {"epoch": 0})
    good = make_ckpt(tmp_path, 1, 0.7)
    assert runs.best_and_latest(tmp_path) == (good, good)
