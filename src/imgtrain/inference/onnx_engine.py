"""``--engine onnxruntime``: the ONNX Runtime session ``predict``, ``evaluate`` and ``serve`` run an
ONNX export in (``export_formats/onnx.py`` declares it; ``export_engine.py`` checks the folder
first). The images come as uint8 NHWC, converted exactly as for the PyTorch engine; the model
takes them as NCHW, so only the layout changes here. An export with a second output (the logits,
``export_record.LOGITS_NAME``) gives them too, for the out-of-distribution scores."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from imgtrain.errors import ImgtrainError


class OnnxModel:
    """An ONNX export in an ONNX Runtime session: uint8 images [B, H, W, C] -> probabilities."""

    def __init__(self, path: Path, threads: int = 0):
        try:
            import onnxruntime
        except ImportError:
            raise ImgtrainError("--engine onnxruntime needs ONNX Runtime: pip install 'imgtrain[export]'") from None
        options = onnxruntime.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        self.session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        self.input = self.session.get_inputs()[0].name

    def probabilities(self, images, tta: str = "none") -> np.ndarray:
        return self.outputs(images, tta)[0]

    def outputs(self, images, tta: str = "none") -> tuple[np.ndarray, np.ndarray | None]:
        """(float32 probabilities [B, K], float32 logits of the plain images [B, K], or None for an
        export without that output)."""
        x = np.ascontiguousarray(np.asarray(images).transpose(0, 3, 1, 2))  # NHWC -> NCHW
        found = self.session.run(None, {self.input: x})
        probs, logits = found[0], found[1] if len(found) > 1 else None
        if tta == "flip":  # the mirror image, W reversed, as the PyTorch engine does
            probs = (probs + self.session.run(None, {self.input: np.ascontiguousarray(x[..., ::-1])})[0]) / 2
        return probs.astype(np.float32, copy=False), None if logits is None else logits.astype(np.float32, copy=False)
