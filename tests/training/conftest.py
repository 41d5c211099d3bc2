"""Fixtures of the training tests."""

from __future__ import annotations

import pytest

from imgtrain.models import registry
from tests.test_model_registry import TINY_CNNS


@pytest.fixture(scope="module")
def tiny_cnn():
    """The tests' tiny CNN family (``tinycnn_N``: one BatchNorm layer), registered while the module runs."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(registry, "_FAMILIES", list(registry._FAMILIES))
        registry.register(TINY_CNNS)
        yield
