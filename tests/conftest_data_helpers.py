"""Builders of small real input files for the data tests (IDX, PNG/JPEG folders, Parquet).

Plain functions, imported by tests/test_data_*.py; kept out of conftest.py on purpose.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import numpy as np

from imgtrain.data.raw import RawDataset, Split

IDX_TYPE_CODES = {np.dtype("u1"): 0x08, np.dtype(">i4"): 0x0C}


def write_idx(path: Path, array: np.ndarray, gz: bool = False) -> Path:
    """Write ``array`` (uint8 or int32) in IDX format: magic, big-endian dims, raw data."""
    dtype = np.dtype("u1") if array.dtype == np.uint8 else np.dtype(">i4")
    header = bytes([0, 0, IDX_TYPE_CODES[dtype], array.ndim])
    header += np.asarray(array.shape, dtype=">u4").tobytes()
    data = header + np.ascontiguousarray(array, dtype=dtype).tobytes()
    path = Path(str(path) + ".gz") if gz else Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def synthetic_mnist(n_train: int = 30, n_test: int = 10, seed: int = 0):
    """(train_images [n,6,5] uint8, train_labels, test_images, test_labels) with labels 0..9."""
    rng = np.random.default_rng(seed)
    return (
        rng.integers(0, 256, (n_train, 6, 5), dtype=np.uint8),
        (np.arange(n_train) % 10).astype(np.uint8),
        rng.integers(0, 256, (n_test, 6, 5), dtype=np.uint8),
        (np.arange(n_test) % 10).astype(np.uint8),
    )


def save_image(path: Path, value: int, size=(8, 8), mode: str = "L", fmt: str | None = None) -> Path:
    """A constant-colour image of ``size`` (H, W); gray value or (value, 255 - value, 7) in RGB."""
    from PIL import Image

    h, w = size
    colour = value if mode == "L" else (value, 255 - value, 7)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, (w, h), colour).save(path, format=fmt)
    return path


def png_bytes(array: np.ndarray) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def tiny_raw(n_train: int = 40, n_test: int = 20, shape=(8, 8, 1), k: int = 4, seed: int = 0) -> RawDataset:
    """A small valid RawDataset: random pixels, labels cycling 0..k-1, ids 0..N-1."""
    rng = np.random.default_rng(seed)

    def split(n, offset):
        return Split(
            images=rng.integers(0, 256, (n, *shape), dtype=np.uint8),
            labels=(np.arange(n) % k).astype(np.int64),
            ids=np.arange(offset, offset + n, dtype=np.int64),
        )

    return RawDataset([f"c{i}" for i in range(k)], split(n_train, 0), split(n_test, n_train))


def rehash(data_dir: Path) -> None:
    """Recompute the manifest's sha256 entries after a test edits a file on purpose."""
    path = Path(data_dir) / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["sha256"] = {rel: hashlib.sha256((Path(data_dir) / rel).read_bytes()).hexdigest()
                          for rel in manifest["sha256"]}
    path.write_text(json.dumps(manifest))


def rewrite_columns(path: Path, **columns) -> None:
    """Replace (or, given None, drop) columns of one written Parquet file and write it back."""
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    for name, values in columns.items():
        if values is None:
            table = table.drop_columns([name])
        else:
            table = table.set_column(table.schema.get_field_index(name), name, values)
    pq.write_table(table, path)


def read_back(data_dir: Path) -> dict:
    """{split: (ids, labels, images uint8 [N, H, W, C])} of a prepared data set; encoded images
    are decoded at their stored size (to the manifest's channels), as written."""
    import pyarrow.parquet as pq

    from imgtrain.data import format as fmt
    from imgtrain.data.images import open_image, to_mode

    manifest = fmt.load_manifest(data_dir)
    out = {}
    for split in manifest["splits"]:
        if manifest["storage"] == "tensor":
            ids, images, labels = fmt.read_split(data_dir, split)
            out[split] = (ids, labels, images)
            continue
        ids, labels, images = [], [], []
        for path in fmt.split_files(Path(data_dir), manifest, split):
            table = pq.read_table(path)
            ids += table.column("id").to_pylist()
            labels += table.column("label").to_pylist()
            for data in table.column("image").to_pylist():
                with open_image(data) as im:
                    c = manifest["channels"]
                    images.append(np.asarray(to_mode(im, c)).reshape(im.size[1], im.size[0], c))
        out[split] = (np.array(ids), np.array(labels), np.stack(images) if len({i.shape for i in images}) == 1 else images)
    return out


def read_inputs_whole(spec: str, shape, preset: str = "digits", **options) -> dict:
    """Every row predict would read from ``spec``, in one dict of arrays (small test inputs only)."""
    import json

    from imgtrain.inference.inputs import list_inputs, read_task

    parts = [read_task({"task": [json.dumps(t)]}, shape, preset) for t in list_inputs(spec, **options).tasks]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
