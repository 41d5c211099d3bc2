"""Preparing and inspecting at scale (issue 37): files/s per core, peak memory, output sizes and
the time to the first training step, at N and 4N small JPEGs, for each source that reads encoded
images (a folder, WebDataset tar shards, a Hugging Face Parquet file with the image struct).

The same generated JPEGs (``--px`` square, RGB, 10 classes) feed every source: a folder of
files, plain tar shards of 10,000 samples (``key.jpg`` + ``key.cls``) and Parquet files whose
``image`` column is the ``{bytes, path}`` struct the ``datasets`` library writes. Per source and
size: ``data prepare`` (wall, files/s, files/s per core, peak RSS of the command and of each pool
process), the prepared Parquet and the manifest's bytes; for the folder also ``data inspect``
(wall, peak RSS, page and JSON bytes) and ``train --workers 1`` on a running Ray cluster: seconds
from the command's start to its first step. Nothing but the outputs may grow from N to 4N.

Decoding cost grows with the pixels: ``--sample-px`` adds the prepare rate of a few thousand
JPEGs at ImageNet's typical size (500x375), the per-file cost used to extrapolate to ImageNet
in BENCHMARKS.md.

    python bench/data_scale.py [--sizes 50000,200000] [--px 32] [--sources folder,webdataset,hf]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

from common import environment, ray_head, write_result
from imgtrain.data import pool
from data_pipeline import run_measured

SHARD_SAMPLES = 10_000


def _jpegs(args: tuple[int, int, int, int]) -> list[bytes]:
    """JPEG bytes of images ``first`` to ``first + count``: smooth random content; at sizes a
    photo (scikit-learn's two sample photos) holds, crops of a photo, whose detail costs
    decoding what a real photo's does (smooth content decodes faster)."""
    from PIL import Image

    first, count, width, height = args
    photos = _photos() if height <= 427 and width <= 640 and width > 64 else []
    out = []
    for i in range(first, first + count):
        rng = np.random.default_rng(i)
        if photos:
            photo = photos[i % len(photos)]
            top, left = rng.integers(0, photo.shape[0] - height + 1), rng.integers(0, photo.shape[1] - width + 1)
            pixels = Image.fromarray(photo[top:top + height, left:left + width])
        else:
            base = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
            pixels = Image.fromarray(base).resize((width, height), Image.Resampling.BICUBIC)
        buf = io.BytesIO()
        pixels.save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def _photos() -> list[np.ndarray]:
    from sklearn.datasets import load_sample_images  # two 427x640 photos, shipped with scikit-learn

    return list(load_sample_images().images)


def generate(count: int, width: int, height: int):
    """(index, class, JPEG bytes) for ``count`` images, made in a process per core."""
    chunk = 2_000
    jobs = [(a, min(chunk, count - a), width, height) for a in range(0, count, chunk)]
    for (first, _, _, _), images in pool.ordered_map(_jpegs, jobs, workers=0):  # a few chunks in memory at a time
        for k, data in enumerate(images):
            yield first + k, (first + k) % 10, data


def write_sources(root: Path, count: int, width: int, height: int, sources: list[str]) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = {"folder": root / "folder", "webdataset": root / "shards", "hf": root / "hf"}
    for p in paths.values():
        p.mkdir(parents=True)
    tar, rows, table_rows = None, 0, {"image": [], "label": []}
    schema = pa.schema([("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())])), ("label", pa.string())])
    parquet = pq.ParquetWriter(paths["hf"] / "train-00000.parquet", schema) if "hf" in sources else None
    for i, c, data in generate(count, width, height):
        name = f"{i:07d}.jpg"
        if "folder" in sources:
            (paths["folder"] / f"class{c}").mkdir(exist_ok=True)
            (paths["folder"] / f"class{c}" / name).write_bytes(data)
        if "webdataset" in sources:
            if rows % SHARD_SAMPLES == 0:
                if tar:
                    tar.close()
                tar = tarfile.open(paths["webdataset"] / f"train-{rows // SHARD_SAMPLES:06d}.tar", "w")
            for member, payload in ((name, data), (f"{i:07d}.cls", str(c).encode())):
                info = tarfile.TarInfo(member)
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
        if parquet:
            table_rows["image"].append({"bytes": data, "path": name})
            table_rows["label"].append(f"class{c}")
            if len(table_rows["label"]) == 1_000:
                parquet.write_table(pa.table(table_rows, schema=schema))
                table_rows = {"image": [], "label": []}
        rows += 1
    if tar:
        tar.close()
    if parquet:
        if table_rows["label"]:
            parquet.write_table(pa.table(table_rows, schema=schema))
        parquet.close()
    return {s: paths[s] for s in sources}


def prepare_row(source: str, src: Path, out: Path, count: int, work: Path) -> dict:
    wall, peaks = run_measured(["data", "prepare", source, str(out), "--source", str(src)], work)
    manifest = out / "manifest.json"
    return {"files": count, "wall_s": wall, "files_per_s": count / wall,
            "files_per_s_per_core": count / wall / os.cpu_count(), "peak_rss_mb": peaks,
            "parquet_mb": sum(p.stat().st_size for p in out.rglob("*.parquet")) / 2**20,
            "manifest_kb": manifest.stat().st_size / 1024}


def inspect_row(data: Path, work: Path) -> dict:
    page = work / f"{data.name}-page.html"
    wall, peaks = run_measured(["data", "inspect", str(data), "--out", str(page)], work)
    json_bytes = subprocess.run([sys.executable, "-m", "imgtrain.cli", "data", "inspect", str(data), "--json",
                                 "--out", str(work / "again.html")], capture_output=True, cwd=work, check=True).stdout
    return {"wall_s": wall, "peak_rss_mb": peaks, "page_kb": page.stat().st_size / 1024,
            "json_kb": len(json_bytes) / 1024}


def first_step(data: Path, work: Path, name: str) -> float:
    """Seconds from ``train``'s start to the end of its first step, Ray already running."""
    from imgtrain.storage import runs

    start = time.time()
    run_measured(["train", "--data", str(data), "--name", name, "--storage", str(work / "runs"), "--workers", "1",
                  "--epochs", "1", "--limit-train-batches", "2", "--log-every-steps", "1", "--address", "auto",
                  "--quiet"], work)
    steps = [r for r in runs.read_metrics(work / "runs" / name) if r["kind"] == "step"]
    return steps[0]["time"] - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="50000,200000")
    parser.add_argument("--px", type=int, default=32)
    parser.add_argument("--sources", default="folder,webdataset,hf")
    parser.add_argument("--sample-px", default="500x375", help="the large sample's size ('' to skip)")
    parser.add_argument("--sample-files", type=int, default=3000)
    parser.add_argument("--work", type=Path, default=None, help="a folder for the files (default: a temporary one)")
    args = parser.parse_args()
    sources = args.sources.split(",")
    result = {"environment": environment(), "inputs": {k: str(v) for k, v in vars(args).items()}, "rows": []}
    with tempfile.TemporaryDirectory(prefix="imgtrain-scale-", dir=args.work) as tmp:
        work = Path(tmp)
        for count in [int(size) for size in args.sizes.split(",") if size]:
            began = time.time()
            made = write_sources(work / f"src-{count}", count, args.px, args.px, sources)
            print(f"{count} images written in {time.time() - began:.0f} s", flush=True)
            for source, src in made.items():
                out = work / f"data-{source}-{count}"
                row = {"source": source, "count": count, "prepare": prepare_row(source, src, out, count, work)}
                if source == "folder":
                    row["inspect"] = inspect_row(out, work)
                    with ray_head(4):
                        row["first_step_s"] = first_step(out, work, f"first-{count}")
                print(json.dumps(row), flush=True)
                result["rows"].append(row)
            for path in (work / f"src-{count}", *work.glob(f"data-*-{count}")):
                subprocess.run(["rm", "-rf", str(path)], check=True)
        if args.sample_px:
            width, height = map(int, args.sample_px.split("x"))
            made = write_sources(work / "sample", args.sample_files, width, height, ["folder"])
            result["sample"] = prepare_row("folder", made["folder"], work / "data-sample", args.sample_files, work)
            result["sample"]["inspect"] = inspect_row(work / "data-sample", work)
            print("sample", json.dumps(result["sample"]), flush=True)
    print(f"results: {write_result('data-scale', result)}")


if __name__ == "__main__":
    main()
