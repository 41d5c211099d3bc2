"""``--format onnx``: ``model.onnx`` (opset ``ONNX_OPSET``), for ONNX Runtime, TensorRT and Triton;
``--quantize int8`` (``quantize.py``) and ``--engine onnxruntime`` (``onnx_engine.py``) run it.

One file, as Triton and most tools expect, unless protobuf's 2 GB limit forbids it: the weights of
a model over ``ONNX_ONE_FILE_MAX`` go beside it (ONNX's external data, ``model.onnx.data``), and the
files its tensors name are hashed with it and held inside the export folder at every load
(``export_files.external_data``)."""

from __future__ import annotations

from pathlib import Path

from imgtrain.inference.export_formats.registry import ExportFormat, register
from imgtrain.inference.export_record import INPUT_NAME, LOGITS_NAME, OUTPUT_NAME

ONNX_FILE = "model.onnx"
ONNX_OPSET = 18
ONNX_ONE_FILE_MAX = 1_500_000_000  # bytes of weights; above, they go beside model.onnx (model.onnx.data)


def write(model, path: Path, example: tuple, dynamic_shapes: dict) -> None:
    import torch

    large = sum(t.numel() * t.element_size() for t in model.state_dict().values()) > ONNX_ONE_FILE_MAX
    torch.onnx.export(model, example, str(path), dynamo=True, opset_version=ONNX_OPSET,
                      input_names=[INPUT_NAME], output_names=[OUTPUT_NAME, LOGITS_NAME][:len(model.outputs)],
                      external_data=large,
                      dynamic_shapes=dynamic_shapes, verbose=False)


def load(path: Path):
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return lambda x: session.run([OUTPUT_NAME], {INPUT_NAME: x})[0]


def external_data(path: Path) -> dict[str, str]:
    from imgtrain.data.format import short_repr
    from imgtrain.inference.export_files import external_data as tensors_by_file

    return {name: f"tensor {short_repr(tensor)}" for name, tensor in tensors_by_file(path).items()}


def quantize(*args) -> dict:
    from imgtrain.inference.quantize import quantize_int8

    return quantize_int8(*args)


def open_session(path: Path, threads: int):
    from imgtrain.inference.onnx_engine import OnnxModel

    return OnnxModel(path, threads)


ONNX = register(ExportFormat(
    name="onnx", file=ONNX_FILE, runtime="onnxruntime", write=write, load=load,
    summary="ONNX Runtime, TensorRT, Triton", needs=("onnx", "onnxscript", "onnxruntime"), extra="export",
    side_files=external_data, quantize=quantize, engine="onnxruntime", open=open_session, logits=True,
))
