"""Real photos at two scales: memory and throughput of the streamed data path (issue 17).

Memory: a generated folder of N and 4N RGB JPEGs (96x96 by default) is prepared
(`imgtrain data prepare folder`) and trained on (`train --workers 2 --epochs 1
--limit-train-batches 2`); peak RSS (VmHWM, sampled from /proc) of the prepare process and
its pool, of the training driver, of each Ray Train worker and of each Ray Data task process,
and the Parquet size against the JPEG bytes. The 4N figures should be within 1.25x of N's.

Throughput: images/s through decode + augmentation (random resized crop + flip) to batches
in the consumer, against what a user would otherwise write, torchvision's ImageFolder +
DataLoader(num_workers=k) with the same transforms, on the same CPUs; rows interleaved and
repeated (n runs each, after one cold run of each that is reported apart), ratios taken within
one run of this script. Training figures: a real two-epoch run on the N photos.

    python bench/data_pipeline.py [--images 3000] [--size 96] [--repeats 3] [--workers-k 2]
    python bench/data_pipeline.py --gpu --images 12000   # a lent GPU: the training figures only, one GPU worker
    python bench/data_pipeline.py --gpu --images 12000 --policies randaugment,trivialaugment,autoaugment
    python bench/data_pipeline.py --gpu --images 12000 --policies randaugment --decode cpu,gpu   # issue 51
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, fmt, ray_head, summarize, write_result  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def make_folder(root: Path, count: int, size: int, classes: int = 10, seed: int = 0) -> int:
    """``count`` RGB JPEGs of ``size`` px in ``classes`` folders; returns their bytes."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    total = 0
    for i in range(count):
        c = i % classes
        base = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)  # smooth-ish content, like a photo
        pixels = np.asarray(Image.fromarray(base).resize((size, size), Image.Resampling.BICUBIC))
        path = root / f"class{c:02d}" / f"{i:06d}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(path, quality=90)
        total += path.stat().st_size
    return total


class Peaks:
    """Peak RSS (MB) by kind of process, sampled from /proc while a command runs: the command
    ("main"), its preparation pool ("pool") and every busy Ray worker process, named by the
    title Ray gives it (RayTrainWorker, MapBatches(read_task_batch), ...)."""

    def __init__(self, root_pid: int):
        self.root, self.peaks, self.stop = root_pid, {}, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _kind(self, pid: int) -> str | None:
        # Judged at every sample: a Ray worker takes its title only once it runs something.
        if pid == self.root:
            return "main"
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        if cmd.startswith("ray::"):
            title = cmd[5:].split(" ")[0].split(".")[0]
            return None if title.startswith("IDLE") else title
        if "multiprocessing" in cmd and self.root in _ancestors(pid):
            return "pool"
        return None

    def _run(self):
        while not self.stop.is_set():
            for entry in os.scandir("/proc"):
                if entry.name.isdigit():
                    try:
                        kind = self._kind(int(entry.name))
                        if kind:
                            for line in Path(f"/proc/{entry.name}/status").read_text().splitlines():
                                if line.startswith("VmHWM:"):
                                    self.peaks[int(entry.name)] = (kind, int(line.split()[1]) / 1024)
                    except (OSError, ValueError):
                        pass
            self.stop.wait(0.3)

    def finish(self) -> dict:
        self.stop.set()
        self.thread.join()
        out = {}
        for kind, mb in self.peaks.values():
            out[kind] = round(max(out.get(kind, 0.0), mb))
        return out


def _ancestors(pid: int) -> list[int]:
    chain = []
    while pid > 1:
        stat = Path(f"/proc/{pid}/stat").read_text()
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the (command) is the state, then ppid
        chain.append(pid)
    return chain


def run_measured(args: list[str], cwd: Path) -> tuple[float, dict]:
    start = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "imgtrain.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=cwd)
    peaks = Peaks(proc.pid)
    out, err = proc.communicate()
    result = peaks.finish()
    if proc.returncode != 0:
        raise RuntimeError(f"{args[:3]} failed: {err[-2000:]}")
    return time.time() - start, result


def memory(work: Path, images: int, size: int) -> dict:
    rows = {}
    for n in (images, 4 * images):
        with ray_head():  # fresh worker processes: no peak carried over from the smaller run
            src, data = work / f"jpeg-{n}", work / f"data-{n}"
            jpeg_bytes = make_folder(src, n, size)
            prep_s, prep = run_measured(["data", "prepare", "folder", str(data), "--source", str(src)], work)
            parquet_bytes = sum(p.stat().st_size for p in data.rglob("*.parquet"))
            train_s, train = run_measured(
                ["train", "--data", str(data), "--name", f"mem-{n}", "--storage", str(work / "runs"), "--workers", "2",
                 "--epochs", "1", "--limit-train-batches", "2", "--batch-size", "64", "--address", "auto",
                 "--quiet"], work)
            rows[n] = {"jpeg_mb": jpeg_bytes / 2**20, "parquet_mb": parquet_bytes / 2**20,
                       "parquet_over_jpeg": parquet_bytes / jpeg_bytes, "prepare_s": prep_s, "prepare": prep,
                       "train_s": train_s, "train": train}
            print(f"{n:>6} images: JPEG {jpeg_bytes / 2**20:.1f} MB, Parquet {parquet_bytes / 2**20:.1f} MB "
                  f"({parquet_bytes / jpeg_bytes:.2f}x); prepare {prep_s:.0f} s peak RSS {prep}; "
                  f"train peak RSS {train}", flush=True)
    return rows


def training(work: Path, images: int, gpu: bool = False, variants: dict[str, list[str]] | None = None) -> dict:
    """Real runs on the prepared photos (two epochs each, ResNet-18 at the photos' size; 2 CPU
    workers, or one GPU worker in bf16 with every other CPU decoding): images/s and the share of
    step time spent waiting for data (the worse rank's) per epoch. The first epoch includes
    starting the decoding processes; the second is the steady state. ``variants``: more train
    flags per named run (an augmentation policy, fewer decoding CPUs), on the same cluster."""
    data = work / f"data-{images}"
    device = ["--gpu", "--workers", "1", "--precision", "bf16"] if gpu else ["--workers", "2"]
    from imgtrain.storage import runs

    results = {}
    with ray_head(os.cpu_count() if gpu else 4):
        for name, flags in (variants or {"speed": []}).items():
            try:
                run_measured(["train", "--data", str(data), "--name", name, "--storage", str(work / "runs"), *device,
                              *flags, "--epochs", "2", "--address", "auto", "--quiet"], work)
            except RuntimeError as e:  # one failed variant must not lose the others' figures
                print(f"{name}: {e}", flush=True)
                continue
            epochs = [{"images_per_s": e["images_per_s"], "data_wait_fraction": e["data_wait_fraction"]}
                      for e in runs.epoch_history(work / "runs" / name)]
            for k, e in enumerate(epochs):
                print(f"{name} ({' '.join(flags) or 'defaults'}) on {images} photos, epoch {k + 1}: "
                      f"{e['images_per_s']:.0f} images/s, data wait {e['data_wait_fraction']:.1%} of step time",
                      flush=True)
            results[name] = {"flags": flags, "epochs": epochs}
    return results if variants else results["speed"]


# ---------------------------------------------------------------- throughput


def ours(data: Path, batch: int, cpus: int, how: str, policy: str = "none") -> float:
    """Images/s of the streamed pipeline (one rank of one) over one epoch, its start included;
    ``policy``: the photos' automatic augmentation after the crop and flip."""
    from imgtrain.data import format as fmt
    from imgtrain.data import stream
    from imgtrain.data.photo_augment import PhotoAugment
    from imgtrain.training.ingest import _batches

    manifest = fmt.load_manifest(data)
    steps = manifest["splits"]["train"]["num_samples"] // batch
    reader = stream.Reader.for_data(data, manifest, seed=0, epoch=0, global_batch=batch, positions_end=steps * batch,
                                    photo_augment=PhotoAugment(policy=policy))
    windows = stream.epoch_windows(stream.blocks(data, manifest, "train"), 0, 0, stream.window_blocks(manifest))
    start, seen = time.perf_counter(), 0
    for b in _batches(stream.train_tasks(windows, reader), reader, batch, "cpu", how, cpus, windows):
        int(b["image"][0, 0, 0, 0])  # touch it, as the training step would
        seen += len(b["id"])
    assert seen == steps * batch, seen
    return seen / (time.perf_counter() - start)


def torchvision_loader(src: Path, batch: int, workers: int, size: int) -> float:
    """What a user would write: ImageFolder + DataLoader with the same augmentation."""
    import torch
    from torchvision import datasets, transforms

    tf = transforms.Compose([transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip(),
                             transforms.PILToTensor()])
    loader = torch.utils.data.DataLoader(datasets.ImageFolder(str(src), transform=tf), batch_size=batch,
                                         shuffle=True, num_workers=workers, drop_last=True)
    start, seen = time.perf_counter(), 0  # its worker processes' start included, as ours
    for images, _ in loader:
        int(images[0, 0, 0, 0])
        seen += len(images)
    return seen / (time.perf_counter() - start)


def throughput(work: Path, images: int, size: int, repeats: int, k: int, batch: int) -> dict:
    src, data = work / f"jpeg-{images}", work / f"data-{images}"
    if not (data / "manifest.json").is_file():
        make_folder(src, images, size)
        subprocess.run([sys.executable, "-m", "imgtrain.cli", "data", "prepare", "folder", str(data), "--source",
                        str(src)], check=True, capture_output=True, cwd=work)
    import ray

    ray.init(address="local", num_cpus=k + 1, include_dashboard=False, log_to_driver=False)
    try:
        rates = {"torchvision": [], "ray-data": [], "torch": []}
        first = {"torchvision": torchvision_loader(src, batch, k, size), "ray-data": ours(data, batch, k, "ray-data"),
                 "torch": ours(data, batch, k, "torch")}  # cold: files read from disk, Ray's processes started
        print("first (not counted):", {name: f"{v:.0f}" for name, v in first.items()}, flush=True)
        for _ in range(repeats):  # interleaved: the machine's speed drifts
            rates["torchvision"].append(torchvision_loader(src, batch, k, size))
            rates["ray-data"].append(ours(data, batch, k, "ray-data"))
            rates["torch"].append(ours(data, batch, k, "torch"))
            print({name: f"{values[-1]:.0f}" for name, values in rates.items()}, flush=True)
    finally:
        ray.shutdown()
    ratios = {name: [v / t for v, t in zip(values, rates["torchvision"])] for name, values in rates.items()}
    return {"first_run_images_per_s": first, "images_per_s": {k2: summarize(v) for k2, v in rates.items()},
            "ratio_to_torchvision": {k2: summarize(v) for k2, v in ratios.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=3000)
    parser.add_argument("--size", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers-k", type=int, default=2, help="CPUs for decoding, both sides")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--gpu", action="store_true", help="only the training figures, on one GPU worker")
    parser.add_argument("--policies", default="", help="with --gpu: also train with each of these comma-separated "
                        "--augment-policy values, and the last of them with --few-cpus decoding CPUs")
    parser.add_argument("--few-cpus", type=int, default=4, help="with --policies: decoding CPUs of the last run")
    parser.add_argument("--decode", default="cpu", help="with --gpu: train each policy with each of these "
                        "comma-separated --decode values (cpu, gpu, auto), interleaved policy by policy")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="imgtrain-bench-") as tmp:
        work = Path(tmp)
        result = {"environment": environment(), "inputs": vars(args)}
        if args.gpu:
            make_folder(work / f"jpeg-{args.images}", args.images, args.size)
            subprocess.run([sys.executable, "-m", "imgtrain.cli", "data", "prepare", "folder",
                            str(work / f"data-{args.images}"), "--source", str(work / f"jpeg-{args.images}")],
                           check=True, capture_output=True, cwd=work)
            variants, decodes = {}, args.decode.split(",")
            for policy in ["none", *filter(None, args.policies.split(","))]:
                for decode in decodes:  # interleaved: each policy's decodings one after the other
                    name = "speed" if policy == "none" else f"policy-{policy}"
                    flags = [] if policy == "none" else ["--augment-policy", policy]
                    if decode != "cpu":
                        name, flags = f"{name}-decode-{decode}", [*flags, "--decode", decode]
                    variants[name] = flags
            if args.policies and "cpu" in decodes:  # the decoding rate per CPU, where the data (not the GPU) sets the pace
                variants[f"{policy}-{args.few_cpus}-cpus"] = ["--augment-policy", policy,
                                                              "--preprocess-cpus", str(args.few_cpus)]
            result["training"] = training(work, args.images, gpu=True, variants=variants)
            print(f"results: {write_result('data-pipeline-gpu', result)}")
            return
        if not args.skip_memory:
            result["memory"] = memory(work, args.images, args.size)
            result["training"] = training(work, args.images)
        # the larger set: the pipelines' start (worker processes, tasks) weighs less
        result["throughput"] = throughput(work, 4 * args.images, args.size, args.repeats, args.workers_k, args.batch)
        for name, stat in result["throughput"]["ratio_to_torchvision"].items():
            print(f"{name:>12}: {fmt(result['throughput']['images_per_s'][name])} images/s, "
                  f"{fmt(stat, 2)}x torchvision's DataLoader")
        print(f"results: {write_result('data-pipeline', result)}")


if __name__ == "__main__":
    main()
