"""``imgtrain export``: each format, from a digits run (ResNet-18) and from photo runs (a
torchvision and a timm model), loaded back by its own runtime in a fresh process that never
imports imgtrain, answering as the PyTorch model does; and the refusals, in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import imgtrain
from imgtrain.inference import export as export_mod
from imgtrain.inference.export import FORMATS, export
from tests.conftest import assert_one_line_error, cli_here, quiet_display, tiny_config

# Loads each exported model with its own runtime only and prints its probabilities for the
# images given, as JSON; fails if anything imported imgtrain.
FRESH_PROCESS = r"""
import json, sys
import numpy as np
out = {}
for path, images in json.loads(sys.argv[1]):
    images = np.load(images)
    if path.endswith(".onnx"):
        import onnxruntime
        session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
        run = lambda x: session.run(None, {session.get_inputs()[0].name: x})[0]
    else:
        import torch, warnings
        warnings.simplefilter("ignore")
        model = torch.jit.load(path) if path.endswith(".torchscript.pt") else torch.export.load(path).module()
        run = lambda x: model(torch.from_numpy(x)).detach().numpy()
    out[path] = [run(images[:1]).tolist(), run(images).tolist()]  # a batch of 1 and of 5
assert not any(m.startswith("imgtrain") for m in sys.modules), "imgtrain was imported"
print(json.dumps(out))
"""
# Every format from the digits run (imgtrain's ResNet-18) and from a photo run: a timm model
# (ONNX, TorchScript) and a torchvision one (pt2), the cheapest split that covers them all.
PHOTO_EXPORTS = {"timm:test_resnet": ("onnx", "torchscript"), "mobilenet_v3_small": ("pt2",)}


@pytest.fixture(scope="module")
def photo_data(tmp_path_factory) -> Path:
    from imgtrain.data.options import PrepareOptions
    from imgtrain.data.prepare import prepare
    from tests.integration.test_streamed import make_photos

    root = tmp_path_factory.mktemp("export-photos")
    make_photos(root / "src", per_class=10, size=24)
    prepare("folder", root / "data", root / "src", PrepareOptions(size=(24, 24)))
    return root / "data"


@pytest.fixture(scope="module")
def exports(local_run, photo_data, tmp_path_factory):
    """[(run path, format, ExportResult, what the CLI printed)]: the digits run's through the CLI."""
    root = tmp_path_factory.mktemp("exports")
    done = []
    for fmt in FORMATS:
        result = export(local_run.path, fmt, root / "digits" / fmt)
        done.append((local_run.path, fmt, result))
    for model, formats in PHOTO_EXPORTS.items():
        run = imgtrain.train(tiny_config(photo_data, root, model.replace(":", "-"), backend="local", workers=1,
                                         epochs=1, batch_size=16, model=model), display=quiet_display())
        done += [(run.path, fmt, export(run.path, fmt, root / run.name / fmt)) for fmt in formats]
    return done


def test_each_export_answers_as_pytorch_in_a_process_without_imgtrain(exports, tmp_path):
    import torch

    jobs, expected = [], {}
    for k, (run, fmt, result) in enumerate(exports):
        assert result.verification.passed, result.verification.line()
        model, preprocess = imgtrain.load_model(run)
        h, w, c = preprocess.image_shape
        images = np.random.default_rng(k).integers(0, 256, (5, h, w, c), dtype=np.uint8)
        with torch.no_grad():
            expected[str(result.model_file)] = model(preprocess(images)).softmax(1).numpy()
        np.save(tmp_path / f"{k}.npy", np.ascontiguousarray(images.transpose(0, 3, 1, 2)))
        jobs.append((str(result.model_file), str(tmp_path / f"{k}.npy")))
    proc = subprocess.run([sys.executable, "-c", FRESH_PROCESS, json.dumps(jobs)], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    answers = json.loads(proc.stdout)
    assert sorted(answers) == sorted(expected)
    for path, (one, five) in answers.items():
        # random pixels drive these barely trained models to extreme logits, where float32 kernels
        # differ most (measured up to 5e-4 for mobilenet's pt2): close, not bit-equal
        np.testing.assert_allclose(np.asarray(five), expected[path], atol=2e-3, err_msg=path)
        np.testing.assert_allclose(np.asarray(one), expected[path][:1], atol=2e-3, err_msg=path)


def test_an_export_folder_says_what_the_model_takes_and_how_well_it_does(exports, local_run):
    digits = exports[0][2]
    folder = digits.out
    assert sorted(p.name for p in folder.iterdir()) == ["MODEL_CARD.md", "labels.json", "model.onnx",
                                                        "preprocessing.json", "verification.json"]
    assert json.loads((folder / "labels.json").read_text()) == [str(d) for d in range(10)]
    pre = json.loads((folder / "preprocessing.json").read_text())
    assert pre["input"] == {"name": "images", "dtype": "uint8", "layout": "NCHW", "shape": ["batch", 1, 28, 28],
                            "channels": "grayscale", "range": [0, 255]}
    check = json.loads((folder / "verification.json").read_text())
    assert check["images"] == check["agreeing"] == 100 and check["max_prob_diff"] < 1e-4
    card = (folder / "MODEL_CARD.md").read_text()
    evaluated = imgtrain.evaluate(local_run.path, options=imgtrain.InferenceOptions(backend="local"))
    # the card's figures are evaluate's
    assert digits.test_metrics["accuracy"] == evaluated.accuracy
    assert f"accuracy {evaluated.accuracy:.2%}" in card and "| 9 |" in card and "Intended use" in card
    photo = exports[-1][2]
    pre = json.loads((photo.out / "preprocessing.json").read_text())
    assert pre["input"]["shape"] == ["batch", 3, 24, 24] and "centre region" in pre["before_the_model"]
    assert photo.verification.images == 8


def test_the_cli_prints_the_check(local_run, tmp_path, capsys):
    proc = cli_here(capsys, "export", str(local_run.path), "--format", "pt2", "--out", str(tmp_path / "pt2"))
    assert proc.returncode == 0, proc.stderr
    assert "top-1 identical to PyTorch on 100 of 100 images (100.00%" in proc.stdout, proc.stdout
    assert "largest probability difference" in proc.stdout and "MODEL_CARD.md" in proc.stdout


def test_an_export_that_disagrees_with_pytorch_fails_and_writes_nothing(local_run, tmp_path, monkeypatch, capsys):
    real_load = export_mod._load

    def shifted(fmt, path):  # an exporter bug: the classes come out rotated by one
        run = real_load(fmt, path)
        return lambda x: np.roll(run(x), 1, axis=1)

    monkeypatch.setattr(export_mod, "_load", shifted)
    proc = cli_here(capsys, "export", str(local_run.path), "--format", "pt2", "--out", str(tmp_path / "out"))
    assert_one_line_error(proc, "disagrees with PyTorch", "of 100 images", "nothing was written")
    assert list(tmp_path.iterdir()) == []  # nor left half-written beside it


def test_bad_export_requests_get_one_line(local_run, tmp_path, monkeypatch, capsys):
    out = str(tmp_path / "out")
    assert_one_line_error(cli_here(capsys, "export", "no-such-run", "--storage", str(tmp_path), "--out", out),
                          "no-such-run")
    assert_one_line_error(cli_here(capsys, "export", str(local_run.path), "--format", "tflite", "--out", out),
                          "--format must be one of onnx, torchscript, pt2")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "model.onnx").write_text("a user's file")
    assert_one_line_error(cli_here(capsys, "export", str(local_run.path), "--out", str(tmp_path / "taken")),
                          "--overwrite")
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnxruntime" else
                        find_spec(name, *a))
    assert_one_line_error(cli_here(capsys, "export", str(local_run.path), "--out", out), "onnxruntime",
                          "pip install")
    assert (tmp_path / "taken" / "model.onnx").read_text() == "a user's file" and not Path(out).exists()
