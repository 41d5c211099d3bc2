"""The Predictor in the caller's own process (a notebook, another program): its torch threads
are its forward passes' only, and the caller's setting is what the caller finds afterwards."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

import imgtrain
from imgtrain.inference.preprocess import LoadedCheckpoint, Preprocess


class ThreadsSeen(torch.nn.Module):
    """Two-class logits [B, 2] from [B, 1, 4, 4] input; notes the torch threads of each pass."""

    def __init__(self):
        super().__init__()
        self.threads = []

    def forward(self, x):
        self.threads.append(torch.get_num_threads())
        return torch.zeros(len(x), 2)


def test_a_predictor_with_threads_gives_them_back_to_the_caller():
    before = torch.get_num_threads()
    theirs, ours = 1, 2  # the caller's choice, and the predictor's
    model = ThreadsSeen()
    loaded = LoadedCheckpoint(model, Preprocess(image_shape=(4, 4, 1), mean=(0.5,), std=(0.5,), classes=("a", "b")),
                              Path("unused"), meta={})
    try:
        torch.set_num_threads(theirs)
        predictor = imgtrain.Predictor(loaded, threads=ours)
        assert torch.get_num_threads() == theirs
        out = predictor({"image": np.zeros((3, 4, 4, 1), np.uint8), "id": np.arange(3)})
        assert out["pred_class"].tolist() == ["a"] * 3
        assert model.threads == [ours]  # the forward pass had the predictor's threads
        assert torch.get_num_threads() == theirs
        imgtrain.Predictor(loaded)({"image": np.zeros((1, 4, 4, 1), np.uint8)})  # threads=0: the caller's, untouched
        assert model.threads == [ours, theirs] and torch.get_num_threads() == theirs
    finally:
        torch.set_num_threads(before)
