"""The formats of ``imgtrain export`` and the engines that run them: what each one is (its
``ExportFormat``, ``registry.py``) and, one module per format, how it is written, loaded back,
quantized and run, registered by its module. Importing the package registers every format below,
in the order ``--format``'s messages list them: a new format is one new module and its name in
this import line (a format of one's own registers where it likes; a test registers one). No
format imports torch or its exporter before it is used."""

# registered by being imported, in this order: the order messages list them
from imgtrain.inference.export_formats import onnx, torchscript, pt2
from imgtrain.inference.export_formats.registry import (ENGINES, FORMATS, ExportFormat, get, help_text, quantizable,
                                                     register, require)

__all__ = ["ENGINES", "FORMATS", "ExportFormat", "get", "help_text", "quantizable", "register", "require"]
