"""The files of an export folder that imgtrain reads, held to that folder: an export is untrusted
input, as a checkpoint is, and may sit in a folder that others can write to.

Every file read (``imgtrain.json``, ``model.onnx`` and the files its tensors keep their weights
in, ONNX's "external data") must lie inside the export folder once every link is followed: no
absolute path, no ``..``, no symlink that leads out. An ONNX model names its external data
files itself, and a tensor read from ``/home/someone/.ssh/id_rsa`` would come back through the
predictions; ONNX Runtime refuses such paths only in its recent versions (and not on every code
path before 1.27), so imgtrain looks at every tensor of the model before ONNX Runtime opens it.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath, PureWindowsPath

from imgtrain.data.format import short_repr
from imgtrain.errors import ImgtrainError

REMEDY = "export the model again, or copy the export's files into one folder"


def location_problem(name: str) -> str | None:
    """Why the relative file name ``name`` (from an untrusted file) cannot name a file inside a
    folder, read as a POSIX and as a Windows path; None when it can."""
    if not name or "\x00" in name:
        return "not a file name"
    for path in (PurePosixPath(name), PureWindowsPath(name)):
        if path.anchor:
            return "an absolute path"
        if ".." in path.parts:
            return "a path with '..'"
    return None


def inside(folder: Path, name: str, named_by: str | None = None) -> Path:
    """``folder / name`` once checked to be a regular file inside ``folder`` after every link is
    followed; one line otherwise, naming the file and ``named_by`` (what names it, when not
    imgtrain: then ``name`` is untrusted, and shown quoted)."""
    shown = f"{folder / name}" if named_by is None else f"{short_repr(name)} (named by {named_by}) in {folder}"
    problem = location_problem(name)
    if problem:
        raise ImgtrainError(f"{shown} is {problem}: an export reads only files inside its folder; {REMEDY}")
    path = folder / name
    try:
        real = path.resolve(strict=True)
    except (OSError, RuntimeError):  # missing, or links in a loop
        raise ImgtrainError(f"{shown} is missing; {REMEDY}") from None
    if not real.is_relative_to(folder.resolve()):
        raise ImgtrainError(f"{shown} is a link that leads out of the export folder, to {short_repr(str(real), 200)}; "
                            f"{REMEDY}")
    if not real.is_file():
        raise ImgtrainError(f"{shown} is not a regular file; {REMEDY}")
    return path


def read_at_most(path: Path, limit: int) -> bytes | None:
    """The bytes of ``path``, or None when it holds more than ``limit``: refused from its size
    before it is read, and never read past ``limit`` (a file that grows, or one of /proc's that
    says it has 0 bytes)."""
    if path.stat().st_size > limit:
        return None
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    return None if len(data) > limit else data


def external_data(model_file: Path) -> dict[str, str]:
    """{file name: the first tensor whose data it holds} for every tensor of the ONNX model that
    keeps its data in another file: initializers, sparse ones, constants, subgraphs', functions'.
    The model is parsed without its external data (memory: the model file, twice, for a moment)."""
    try:
        import onnx
        from google.protobuf.message import DecodeError
    except ImportError:
        raise ImgtrainError("--engine onnxruntime needs onnx too: pip install 'imgtrain[export]'") from None
    model = onnx.ModelProto()
    try:
        model.ParseFromString(model_file.read_bytes())
    except (DecodeError, RecursionError) as e:
        raise ImgtrainError(f"{model_file} is not an ONNX model ({e}); {REMEDY}") from None
    found: dict[str, str] = {}
    for tensor in _tensors(model, onnx.TensorProto):
        entries = {entry.key: entry.value for entry in tensor.external_data}
        if tensor.data_location == onnx.TensorProto.EXTERNAL or entries:
            found.setdefault(entries.get("location", ""), tensor.name or "(unnamed)")
    return found


def _tensors(message, tensor_type):
    """Every ``tensor_type`` message under ``message``, found by walking every message field (so
    none is missed where the ONNX format keeps tensors: attributes, sparse tensors, subgraphs,
    functions, training info)."""
    stack = [message]
    while stack:
        current = stack.pop()
        if isinstance(current, tensor_type):
            yield current
            continue
        for field, value in current.ListFields():
            if field.type == field.TYPE_MESSAGE:
                stack.extend([value] if hasattr(value, "ListFields") else value)  # one message, or repeated
