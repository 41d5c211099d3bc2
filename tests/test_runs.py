import json

from imgtrain.checkpoint_policy import POLICY
from imgtrain.storage import checkpoint as ckpt
from imgtrain.storage import runs


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
    d = run_dir / POLICY.epoch_name(epoch)
    ckpt.save(d, {}, {}, {"epoch": epoch, "step": epoch * 10, "metrics": {"val_accuracy": acc}})
    return d


def test_retention_keeps_best_and_latest(tmp_path):
    dirs = [make_ckpt(tmp_path, e, acc) for e, acc in enumerate([0.5, 0.9, 0.7, 0.6])]
    ckpt.retain(tmp_path, POLICY.keeping(1))
    assert [p for p, _ in ckpt.listing(tmp_path)] == [dirs[1], dirs[3]]
    assert ckpt.best_and_latest(tmp_path) == (dirs[1], dirs[3])


def test_incomplete_checkpoint_is_invisible(tmp_path):
    make_ckpt(tmp_path, 0, 0.5)
    (tmp_path / POLICY.epoch_name(1)).mkdir()  # a crash before meta.json was written
    assert [p.name for p, _ in ckpt.listing(tmp_path)] == [POLICY.epoch_name(0)]


def test_status_of_a_killed_driver_reads_interrupted(tmp_path):
    (tmp_path / runs.STATUS_FILE).write_text(json.dumps(
        {"status": "running", "pid": 2**22 + 12345, "host": __import__("socket").gethostname()}))
    assert runs.read_status(tmp_path)["status"] == "interrupted"


def test_checkpoint_meta_without_metrics_does_not_break_listing(tmp_path):
    ckpt.save(tmp_path / POLICY.epoch_name(0), {}, {}, {"epoch": 0})
    good = make_ckpt(tmp_path, 1, 0.7)
    assert ckpt.best_and_latest(tmp_path) == (good, good)


def test_a_start_record_brings_back_the_epochs_its_checkpoint_holds(tmp_path):
    # A retried worker group starts from a checkpoint whose epoch record never reached the
    # file (rank 0 died after storing it): the history it carries fills the gap, once.
    from imgtrain.training.driver import Records
    from imgtrain.training.progress import TrainingDisplay

    class Logged(list):  # what a tracker (MLflow, TensorBoard) is given
        def log(self, record):
            self.append(record)

    tracked = Logged()
    records = Records(tmp_path, TrainingDisplay(quiet=True), trackers=[tracked])
    records.send({"kind": "start", "step": 0, "history": [], "restored_from": None})
    epoch0 = {"kind": "epoch", "epoch": 0, "step": 10, "val_accuracy": 0.5, "checkpoint": POLICY.epoch_name(0)}
    records.send(dict(epoch0))
    epoch1 = dict(epoch0, epoch=1, step=20, checkpoint=POLICY.epoch_name(1))
    records.send({"kind": "step", "epoch": 2, "step": 25})  # trained after the lost record: dropped
    restart = {"kind": "start", "step": 20, "history": [epoch0, epoch1], "restored_from": POLICY.epoch_name(1)}
    records.send(dict(restart))
    records.send(dict(restart))  # a second retry from the same checkpoint adds nothing
    epochs = [r for r in runs.read_metrics(tmp_path) if r["kind"] == "epoch"]
    assert [(r["epoch"], r.get("recovered_from")) for r in epochs] == [(0, None), (1, POLICY.epoch_name(1))]
    assert not any(r["kind"] == "step" for r in runs.read_metrics(tmp_path))
    assert all("history" not in r for r in runs.read_metrics(tmp_path))  # not copied into every start line
    assert [(r["kind"], r.get("epoch")) for r in tracked if r["kind"] == "epoch"] == [("epoch", 0), ("epoch", 1)]
    assert tracked.index(next(r for r in tracked if r.get("recovered_from"))) > tracked.index(
        next(r for r in tracked if r["kind"] == "start" and r["step"] == 20))  # after the restart's purge


def test_json_output_is_alone_on_stdout_whatever_else_prints_meanwhile(tmp_path, capsys, monkeypatch):
    # `imgtrain ... --json | jq` must parse: Ray's driver prints the raylet's warnings on stdout
    # from a thread of its own while a command works. Stood in for by a print inside the work.
    from tests.conftest import cli_here

    def listing_that_chatters(storage):
        print("(raylet) WARNING: 8 PYTHON worker processes have been started")
        return []

    monkeypatch.setattr("imgtrain.storage.runs.list_runs", listing_that_chatters)
    proc = cli_here(capsys, "runs", "list", "--storage", str(tmp_path), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []
    assert "(raylet) WARNING" in proc.stderr  # not lost: on stderr


def test_a_printed_path_stays_one_line_however_long(tmp_path, capsys):
    # Off a terminal rich cuts lines at 80 columns: a script reading `report: PATH` or a user
    # copying a path got half of it (a CI run's longer temporary folders found it).
    from tests.conftest import cli_here

    deep = tmp_path.joinpath(*["a-rather-long-folder-name"] * 6)
    proc = cli_here(capsys, "runs", "list", "--storage", str(deep))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [f"no runs in {deep}"]
