"""An export format is one module that declares itself and registers: the built-in ones are found
by name, an unknown one is refused in one line listing them, and a format registered by this test
alone (gzipped TorchScript, with an engine of its own) is exported, verified, loaded back and run
by ``predict`` with nothing else knowing about it. The run is the tiny CNN's, trained here."""

from __future__ import annotations

import gzip
import io
import json

import numpy as np
import pytest

import imgtrain
from imgtrain.errors import ImgtrainError
from imgtrain.inference import export_formats
from imgtrain.inference.export import export
from imgtrain.inference.export_formats import ENGINES, FORMATS, ExportFormat
from imgtrain.models import registry as models
from imgtrain.ops.files import sha256_file
from tests.conftest import assert_one_line_error, cli_here, quiet_display, tiny_config
from tests.test_model_registry import TINY_CNNS


def write(model, path, example, dynamic_shapes) -> None:
    import torch

    buffer = io.BytesIO()
    torch.jit.save(torch.jit.trace(model, example), buffer)
    path.write_bytes(gzip.compress(buffer.getvalue(), compresslevel=1))


def load(path, threads: int = 0):
    import torch

    module = torch.jit.load(io.BytesIO(gzip.decompress(path.read_bytes())))

    def run(x):
        with torch.no_grad():
            return module(torch.from_numpy(x)).numpy()

    return run


class GzModel:
    """What ``--engine ts-gz`` runs: uint8 [B, H, W, C] -> probabilities, as every engine's model."""

    def __init__(self, path, threads: int):
        self.run = load(path)

    def probabilities(self, images, tta: str = "none") -> np.ndarray:
        return self.run(np.ascontiguousarray(np.asarray(images).transpose(0, 3, 1, 2))).astype(np.float32)


TS_GZ = ExportFormat(name="ts-gz", file="model.ts.gz", runtime="torch and gzip", write=write, load=load,
                     summary="gzipped TorchScript", engine="ts-gz", open=GzModel)


@pytest.fixture
def ts_gz():
    """The format registered for one test, the registry put back afterwards (FORMATS and ENGINES
    are the registry's own dicts, which every module reads)."""
    saved = dict(FORMATS), dict(ENGINES)
    export_formats.register(TS_GZ)
    yield TS_GZ
    for registered, before in zip((FORMATS, ENGINES), saved):
        registered.clear()
        registered.update(before)


@pytest.fixture(scope="module")
def tiny_run(tiny_data, tmp_path_factory):
    """A one-epoch run of the tests' tiny CNN (its family registered while the module runs)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(models, "_FAMILIES", list(models._FAMILIES))
        models.register(TINY_CNNS)
        yield imgtrain.train(tiny_config(tiny_data, tmp_path_factory.mktemp("runs"), "tiny", backend="local",
                                         workers=1, epochs=1, model="tinycnn_8"), display=quiet_display())


def test_each_format_is_found_by_name_and_an_unknown_one_is_refused_in_one_line():
    assert list(FORMATS) == ["onnx", "torchscript", "pt2"]
    assert [export_formats.get(n).file for n in FORMATS] == ["model.onnx", "model.torchscript.pt", "model.pt2"]
    assert list(ENGINES) == ["torch", "onnxruntime"] and ENGINES["onnxruntime"] is FORMATS["onnx"]
    assert export_formats.quantizable() == ["onnx"]
    assert export_formats.help_text() == "onnx (ONNX Runtime, TensorRT, Triton), torchscript or pt2 (torch.export)"
    with pytest.raises(ImgtrainError) as refused:
        export_formats.get("tflite")
    assert str(refused.value) == "--format must be one of onnx, torchscript, pt2, got 'tflite'"
    with pytest.raises(ValueError, match="registered twice"):
        export_formats.register(FORMATS["pt2"])
    with pytest.raises(ValueError, match="engine 'onnxruntime' is taken"):
        export_formats.register(ExportFormat(name="onnx2", file="m.onnx", runtime="onnxruntime", write=write,
                                             load=load, engine="onnxruntime", open=GzModel))
    assert list(FORMATS) == ["onnx", "torchscript", "pt2"]


def test_a_format_registered_in_a_test_is_exported_verified_loaded_back_and_run(ts_gz, tiny_run, tiny_data,
                                                                                tmp_path, capsys):
    out = tmp_path / "gz"
    assert_one_line_error(cli_here(capsys, "export", str(tiny_run.path), "--format", "tflite", "--out", str(out)),
                          "--format must be one of onnx, torchscript, pt2, ts-gz, got 'tflite'")
    result = export(tiny_run.path, "ts-gz", out)
    assert result.verification.passed and result.verification.images == 100
    assert result.model_file == out / "model.ts.gz"
    record = json.loads((out / "imgtrain.json").read_text())
    assert record["format"] == "ts-gz" and record["sha256"] == {"model.ts.gz": sha256_file(out / "model.ts.gz")}
    assert "as **ts-gz** (`model.ts.gz`, loaded with torch and gzip)" in (out / "MODEL_CARD.md").read_text()

    # the file loads back with its own runtime and answers as the run's model does
    model, preprocess = imgtrain.load_model(tiny_run.path)
    images = np.random.default_rng(0).integers(0, 256, (5, 28, 28, 1), dtype=np.uint8)
    expected = model(preprocess(images)).softmax(1).detach().numpy()
    np.testing.assert_allclose(load(out / "model.ts.gz")(images.transpose(0, 3, 1, 2).copy()), expected, atol=1e-5)

    # predict runs it with the engine it declares, as it runs the checkpoint with torch
    frames = {}
    for engine, target in (("torch", tiny_run.path), ("ts-gz", out)):
        proc = cli_here(capsys, "predict", str(target), str(tiny_data), "--engine", engine, "--backend", "local",
                        "--out", str(tmp_path / f"{engine}.csv"))
        assert proc.returncode == 0, proc.stderr
        frames[engine] = __import__("pandas").read_csv(tmp_path / f"{engine}.csv")
    assert list(frames["ts-gz"]["pred_index"]) == list(frames["torch"]["pred_index"])
    np.testing.assert_allclose(frames["ts-gz"]["confidence"], frames["torch"]["confidence"], atol=1e-5)

    # and refuses, in one line, what it cannot do
    args = (str(tiny_data), "--backend", "local", "--out", str(tmp_path / "p.csv"))
    assert_one_line_error(cli_here(capsys, "predict", str(tiny_run.path), *args, "--engine", "ts-gz"),
                          "imgtrain export RUN --format ts-gz --out DIR")
    assert_one_line_error(cli_here(capsys, "predict", str(out), *args), "exported model",
                          "--engine onnxruntime or ts-gz")
    assert_one_line_error(cli_here(capsys, "export", str(tiny_run.path), "--format", "ts-gz", "--quantize", "int8",
                                   "--out", str(tmp_path / "int8")), "int8 with --format onnx; got 'int8' with ts-gz")
    (out / "model.ts.gz").write_bytes(gzip.compress(b"changed"))
    assert_one_line_error(cli_here(capsys, "predict", str(out), *args, "--engine", "ts-gz"),
                          "does not match the sha256")
