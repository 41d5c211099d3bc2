"""Knowledge distillation (``--teacher``, training/distill.py and teacher_cache.py): the teacher's
logits cached and reused, recomputed when the teacher or the data change, exact resume in both
modes, the mode chosen from the augmentation, and the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from imgtrain.config import TrainConfig
from imgtrain.errors import ImgtrainError
from imgtrain.training import distill, logits_table, teacher_cache
from tests.conftest import assert_one_line_error, cli_here, quiet_display, subset, tiny_config

STUDENT = "timm:test_resnet"


def _teacher(data, storage, name, seed=0, steps=4):
    """A tiny teacher: a few steps of the small timm ResNet, trained here on the local backend."""
    import imgtrain

    cfg = tiny_config(data, storage, name, backend="local", workers=1, model=STUDENT, epochs=1,
                      limit_train_batches=steps, bn_calibration=0, seed=seed)
    return imgtrain.train(cfg, display=quiet_display()).path


@pytest.fixture(scope="module")
def tiny_data(tiny_data, tmp_path_factory):
    """The session's tiny set, copied: cached distillation writes the teachers' logits beside the
    data set, and the session's is read by every other test (test_clean lists its files)."""
    import shutil

    copy = tmp_path_factory.mktemp("distill-data") / "tiny"
    shutil.copytree(tiny_data, copy)
    return copy


@pytest.fixture(scope="module")
def teachers(tiny_data, tmp_path_factory):
    storage = tmp_path_factory.mktemp("teachers")
    return _teacher(tiny_data, storage, "t0"), _teacher(tiny_data, storage, "t1", seed=1, steps=1)


def _student(data, storage, name, teacher, **more):
    return tiny_config(data, storage, name, backend="local", workers=1, model=STUDENT, epochs=1,
                       limit_train_batches=6, bn_calibration=0, deterministic=True, teacher=str(teacher), **more)


@pytest.mark.integration
@pytest.mark.parametrize("augment", [False, True], ids=["cached", "online"])
def test_a_resumed_distillation_ends_with_the_uninterrupted_runs_bits(tiny_data, teachers, tmp_path, monkeypatch,
                                                                      augment):
    """Cut by a fault at step 4 and resumed from the step-3 checkpoint: the same weights as the
    run never cut, in the mode augmentation chooses (online with it: every step's image is new)."""
    import imgtrain
    from imgtrain.storage import checkpoint as ckpt
    from imgtrain.training.faults import ENV_VAR

    def train(name):
        return imgtrain.train(_student(tiny_data, tmp_path, name, teachers[0], augment=augment,
                                       checkpoint_every_steps=3, accumulate=2), display=quiet_display())

    reference = train("whole")
    monkeypatch.setenv(ENV_VAR, "raise:0:4")
    with pytest.raises(Exception, match="injected fault"):
        train("cut")
    monkeypatch.delenv(ENV_VAR)
    resumed = train("cut")
    assert resumed.status == "finished"
    final = [ckpt.load_model_state(r.path / r.history[-1]["checkpoint"]) for r in (reference, resumed)]
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])
    config = json.loads((resumed.path / "config.json").read_text())
    assert config["distill_mode"] == ("online" if augment else "cached")
    assert config["teacher"] == str(teachers[0]) and len(config["teacher_sha256"]) == 64
    assert config["distillation"].startswith(f"{teachers[0].name} (sha256 {config['teacher_sha256'][:16]})")
    if augment:
        return
    # the teacher changes the student: the same run without it ends elsewhere
    alone = imgtrain.train(tiny_config(tiny_data, tmp_path, "alone", backend="local", workers=1, model=STUDENT,
                                       epochs=1, limit_train_batches=6, bn_calibration=0, deterministic=True,
                                       augment=augment, checkpoint_every_steps=3, accumulate=2),
                           display=quiet_display())
    plain = ckpt.load_model_state(alone.path / alone.history[-1]["checkpoint"])
    assert not all(torch.equal(plain[k], final[0][k]) for k in plain)


@pytest.mark.integration
def test_the_teacher_logits_are_reused_and_recomputed_when_the_teacher_or_the_data_change(
        teachers, sample_raw, tmp_path):
    from imgtrain.data.format import load_manifest
    from imgtrain.data.writer import write_dataset

    data, other_data = tmp_path / "data", tmp_path / "other"  # their own: no other test's table in them
    write_dataset(subset(sample_raw, 256, 100), data, name="tiny", source="mnist-sample")
    write_dataset(subset(sample_raw, 200, 50), other_data, name="other", source="mnist-sample")
    notes = []

    def table(data, teacher):
        cfg = TrainConfig(data=str(data), teacher=str(teacher), eval_batch_size=100)
        cfg = distill.resolved(cfg, load_manifest(data), None, lambda _: None)
        ref = teacher_cache.ensure(cfg, load_manifest(data), notes.append, on_ray=False)
        assert ref == teacher_cache.ref_for(cfg, load_manifest(data))
        assert len(json.dumps(ref.to_dict())) < 1000  # what the train loop's config carries: where, not the numbers
        return Path(ref.logits), np.load(ref.ids, allow_pickle=False), np.load(ref.logits, allow_pickle=False)

    first, ids, logits = table(data, teachers[0])
    assert first.parent == data / teacher_cache.FOLDER and "stored in" in notes[-1]
    assert ids.shape == (256,) and logits.shape == (256, 10) and (ids[1:] > ids[:-1]).all()
    stamp = first.stat().st_mtime_ns
    again, ids2, logits2 = table(data, teachers[0])
    assert again == first and notes[-1] == f"teacher logits: reusing {first}" and first.stat().st_mtime_ns == stamp
    assert (ids2 == ids).all() and (logits2 == logits).all()
    other_teacher, _, logits3 = table(data, teachers[1])
    assert other_teacher != first and "stored in" in notes[-1] and not (logits3 == logits).all()
    other_set, ids4, _ = table(other_data, teachers[0])
    assert other_set.parent == other_data / teacher_cache.FOLDER and "stored in" in notes[-1] and ids4.shape == (200,)
    with open(first, "r+b") as f:  # a damaged table is computed again, never read
        f.truncate(first.stat().st_size - 1)
    table(data, teachers[0])
    assert "stored in" in notes[-1] and logits_table.read(logits_table.Ref(str(first).replace(".logits.", ".ids."),
                                                                             str(first), 256, 10)) is not None
    assert not list(first.parent.glob("*.tmp"))


@pytest.mark.integration
def test_a_teacher_of_other_classes_or_unreadable_is_refused_in_one_line(capsys, tiny_data, teachers, sample_raw,
                                                                        tmp_path):
    from imgtrain.data.raw import RawDataset
    from imgtrain.data.writer import write_dataset

    raw = subset(sample_raw, 64, 20)
    letters = tmp_path / "letters"
    write_dataset(RawDataset(classes=list("abcdefghij"), train=raw.train, test=raw.test), letters, name="letters",
                  source="mnist-sample")
    common = ("train", "--backend", "local", "--storage", str(tmp_path / "runs"), "--name", "s", "--model", STUDENT)
    proc = cli_here(capsys, *common, "--data", str(letters), "--teacher", str(teachers[0]))
    assert_one_line_error(proc, f"--teacher {teachers[0]} knows 10 classes (0, 1, 2, 3, ...)", "(a, b, c, d, ...)")
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a model")
    for target in (str(junk), str(tmp_path / "nowhere"), "no-such-run"):
        proc = cli_here(capsys, *common, "--data", str(tiny_data), "--teacher", target)
        assert_one_line_error(proc, f"--teacher {target}")
    assert not (tmp_path / "runs" / "s").exists()


def test_online_is_chosen_when_every_steps_images_are_new():
    assert distill.mode_for(TrainConfig(augment=True)) == "online"
    assert distill.mode_for(TrainConfig(augment=False)) == "cached"
    assert distill.mode_for(TrainConfig(augment=False, mixup=0.2)) == "online"
    assert distill.mode_for(TrainConfig(augment=False, cutmix=1.0)) == "online"
    assert distill.mode_for(TrainConfig(augment=True, distill_mode="cached")) == "cached"  # asked for


def test_the_loss_is_hintons():
    """(1 - w) CE + w T^2 KL: the labels alone at w = 0, nothing soft where the student already
    answers as the teacher, and the soft term's gradient T^2 / T = T times the logit gap's."""
    student, teacher = torch.randn(5, 10), torch.randn(5, 10)
    signal = distill.Signal.__new__(distill.Signal)
    signal.temperature, signal.weight = 4.0, 0.0
    hard = torch.tensor(3.0)
    assert signal.loss(student, teacher, hard) == hard
    signal.weight = 1.0
    assert signal.loss(teacher, teacher, hard).abs() < 1e-5
    s = student.clone().requires_grad_(True)
    signal.loss(s, teacher, hard).backward()
    expected = 4.0 * ((s / 4).softmax(1) - (teacher / 4).softmax(1))
    assert torch.allclose(s.grad, expected, atol=1e-5)


def test_the_defaults_teach_the_teachers_own_probabilities():
    """By default (T 1, weight 0.5) the student is pulled towards half its label and half the
    teacher's own probabilities, unflattened: the loss's gradient is softmax(student) -
    (onehot(label) + softmax(teacher)) / 2, row by row. The former T 4 pulled towards the teacher's
    flattened distribution (its most probable class at 0.43 where it was 0.90 at T 1, on the
    digits) and a 3-epoch student 13 points under its teacher lost 10 points to the same student
    alone (docs/training.md, "Distillation"; measured in training by bench/distill_diagnose.py)."""
    cfg = TrainConfig()
    signal = distill.Signal.__new__(distill.Signal)
    signal.temperature, signal.weight = cfg.distill_temperature, cfg.distill_weight
    generator = torch.Generator().manual_seed(0)
    student = torch.randn(6, 10, generator=generator).requires_grad_(True)
    teacher, labels = torch.randn(6, 10, generator=generator) * 3, torch.arange(6)
    hard = torch.nn.functional.cross_entropy(student, labels, reduction="sum")
    signal.loss(student, teacher, hard).backward()
    target = (torch.nn.functional.one_hot(labels, 10) + teacher.softmax(1)) / 2
    assert torch.allclose(student.grad, student.softmax(1) - target, atol=1e-6)


def test_the_report_and_the_model_card_name_the_teacher():
    from imgtrain.inference.model_card import RECIPE_KEYS
    from imgtrain.inference.report import _model_line

    identity = "big (sha256 0123456789abcdef), cached, T 4, weight 0.5"
    line = _model_line({"architecture": STUDENT, "in_channels": 1, "num_classes": 10}, {"distillation": identity})
    assert line.endswith(f", distilled from {identity}")
    assert "distillation" in RECIPE_KEYS  # a row of the card's recipe, where not empty


@pytest.mark.integration
def test_a_data_set_in_an_object_store_gets_its_teacher_logits_beside_it_for_every_node(
        teachers, tiny_data, s3_server, monkeypatch, tmp_path):
    """Computed once by the driver and uploaded beside the data set; a driver on another machine
    (a cache of its own) finds them there, and its workers read the same rows from their copy."""
    import shutil
    import uuid

    import pyarrow.fs as pafs

    from imgtrain.data.format import load_manifest
    from imgtrain.ops import remote

    for name, value in s3_server.items():
        monkeypatch.setenv(name, value)
    data = f"s3://imgtrain/{uuid.uuid4().hex[:8]}/tiny"
    fs, root = remote.split(data)
    clean = tmp_path / "tiny"  # without the tables other tests cached beside it
    shutil.copytree(tiny_data, clean, ignore=shutil.ignore_patterns(teacher_cache.FOLDER))
    pafs.copy_files(str(clean), root, destination_filesystem=fs)
    manifest = load_manifest(tiny_data)
    cfg = distill.resolved(TrainConfig(data=data, teacher=str(teachers[0]), eval_batch_size=100, distill_mode="cached"),
                           manifest, None,
                           lambda _: None)
    notes, refs = [], []
    for machine in ("first", "second"):
        monkeypatch.setenv("IMGTRAIN_CACHE", str(tmp_path / machine))
        refs.append(teacher_cache.ensure(cfg, manifest, notes.append, on_ray=False))
    assert "stored in" in notes[0] and notes[1].startswith("teacher logits: reusing")
    assert refs[1].on_this_node() == refs[1] and refs[0].uri == refs[1].uri == f"{data}/{teacher_cache.FOLDER}"
    rows = [np.load(tmp_path / machine / "teacher-logits" / Path(refs[0].logits).name) for machine in ("first", "second")]
    assert np.array_equal(rows[0], rows[1])
    monkeypatch.setenv("IMGTRAIN_CACHE", str(tmp_path / "worker"))  # a worker on a third node
    signal = distill.Signal(cfg, manifest, "cpu", refs[0].to_dict())
    ids = np.load(tmp_path / "first" / "teacher-logits" / Path(refs[0].ids).name)
    assert torch.equal(signal.logits({"id": torch.from_numpy(ids[::5])}, None), torch.from_numpy(rows[0][::5]))
