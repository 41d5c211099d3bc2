"""mnist: the full 70,000 MNIST digits from the four standard IDX files (the format of
yann.lecun.com and torchvision's raw folder), optionally downloaded first. The official split;
images stay on disk until each row group is written."""

from __future__ import annotations

from pathlib import Path
from typing import Union

import numpy as np

from imgtrain.data.idx import DiskRows, IdxFile, read_idx
from imgtrain.data.limits import check_class_count
from imgtrain.data.raw import RawDataset, Split
from imgtrain.errors import ImgtrainError, one_line

MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}


def _find_idx(source_dir: Path, name: str) -> Path | None:
    """The first existing spelling of ``name`` in ``source_dir`` or torchvision's MNIST/raw."""
    for folder in (source_dir, source_dir / "MNIST" / "raw"):
        # Some mirrors (e.g. Kaggle) spell the files 'train-images.idx3-ubyte'.
        for stem in (name, name.replace("-idx", ".idx")):
            for candidate in (folder / stem, folder / f"{stem}.gz"):
                if candidate.is_file():
                    return candidate
    return None


def load_mnist_idx(source_dir: Union[str, Path], download: bool = False, seed: int = 0) -> RawDataset:
    """Full MNIST (60,000 train / 10,000 test, the official split) from the four IDX files.

    Files are looked up in ``source_dir`` and ``source_dir/MNIST/raw`` (torchvision's layout),
    plain or ``.gz``. ``download=True`` first fetches them with torchvision. Train ids are the
    row index in the train file; test ids are 60,000 + the row index in the test file.
    """
    source_dir = Path(source_dir)
    if download:
        _download_mnist(source_dir)
    found = {key: _find_idx(source_dir, name) for key, name in MNIST_FILES.items()}
    missing = [MNIST_FILES[k] for k, p in found.items() if p is None]
    if missing:
        raise ImgtrainError(
            f"MNIST IDX files not found in {source_dir} (missing {', '.join(missing)}); put "
            f"the four files {', '.join(MNIST_FILES.values())} (optionally .gz) in {source_dir} "
            f"or {source_dir / 'MNIST' / 'raw'}, or pass --download when online"
        )
    # Labels are read (a byte per image); images stay on disk until written, a row group at a time.
    labels = {split: read_idx(found[f"{split}_labels"], integers=True) for split in ("train", "test")}
    images = {split: IdxFile(found[f"{split}_images"]) for split in ("train", "test")}
    if images["train"].dtype != np.uint8 or images["test"].dtype != np.uint8:
        raise ImgtrainError(f"MNIST image files in {source_dir} do not hold uint8 pixels; download them again")
    for split in ("train", "test"):
        shape = images[split].shape
        if len(shape) != 3 or labels[split].ndim != 1 or shape[0] != len(labels[split]):
            raise ImgtrainError(
                f"{found[f'{split}_images']} holds shape {list(shape)} but "
                f"{found[f'{split}_labels']} holds {list(labels[split].shape)}; expected [N, H, W] "
                "images and N labels; download the files again"
            )
    labels_all = np.concatenate([labels["train"], labels["test"]]).astype(np.int64)
    if labels_all.min() < 0 or images["train"].shape[1:] != images["test"].shape[1:]:
        raise ImgtrainError(f"MNIST files in {source_dir} are inconsistent; download them again")
    check_class_count(int(labels_all.max()) + 1, f"the labels in {source_dir}")
    n_train = len(labels["train"])
    rng = np.random.default_rng(seed)
    splits = {}
    for split, offset in (("train", 0), ("test", n_train)):
        order = rng.permutation(len(labels[split]))  # shuffled within the split
        splits[split] = Split(DiskRows(images[split], order), labels[split][order].astype(np.int64), offset + order)
    classes = [str(i) for i in range(int(labels_all.max()) + 1)]
    return RawDataset(classes=classes, train=splits["train"], test=splits["test"])


def _download_mnist(source_dir: Path) -> None:
    """Fetch MNIST with torchvision into ``source_dir/MNIST/raw`` (needs the internet)."""
    try:
        from torchvision.datasets import MNIST

        MNIST(root=str(source_dir), download=True)
    except Exception as e:  # torchvision raises URLError, RuntimeError, ... when offline
        reason = one_line(e, 200)
        raise ImgtrainError(
            f"could not download MNIST into {source_dir} ({type(e).__name__}: {reason}); "
            "check the network, or copy the four IDX files there and drop --download"
        ) from None
