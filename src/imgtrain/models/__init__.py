"""Models: the families imgtrain builds by name (``registry.py``, one module each), building,
checking and describing a model from its ``model_args`` (``zoo.py``), the parts of a model
imgtrain adapts (``parts.py``) and its own ResNet-18 (``resnet18.py``).

Importing the package registers every family below, in the order of the docs' list of models;
a new family is one new module and one line here. None of them imports torch before a model is
built: the driver asks for the stem without it.
"""

from imgtrain.models import torchvision_cnns
from imgtrain.models import torchvision_transformers
from imgtrain.models import timm_models

__all__ = ["torchvision_cnns", "torchvision_transformers", "timm_models"]  # registered by being imported
