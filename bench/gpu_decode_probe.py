"""How fast nvJPEG decodes our photos on a lent GPU, against one CPU core (issue 51, item 2).

Before building `--decode gpu`: the rate of `torchvision.io.decode_jpeg(device="cuda")` on
batches of JPEG bytes, with and without a per-image random resized crop and flip done on the
device, against simplejpeg (the CPU path's decoder) on one core. JPEGs are generated like
bench/data_pipeline.py's (smooth content, quality 90), at two sizes: the 96 px of the photo
benchmarks and 384x288, closer to a phone photo scaled for training.

    python bench/gpu_decode_probe.py [--images 2048] [--batch 256]
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import environment, write_result  # noqa: E402


def jpeg_bytes(count: int, width: int, height: int, seed: int = 0) -> list[bytes]:
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        base = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
        pixels = Image.fromarray(base).resize((width, height), Image.Resampling.BICUBIC)
        buffer = io.BytesIO()
        pixels.save(buffer, format="JPEG", quality=90)
        out.append(buffer.getvalue())
    return out


def rate(fn, images: int, repeats: int = 3) -> float:
    fn()  # warm-up: CUDA context, nvJPEG handles, allocator
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return images / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--out-size", type=int, default=96)
    parser.add_argument("--device", default="cuda", help="cpu: check the script itself without a GPU")
    args = parser.parse_args()

    import simplejpeg
    import torch
    from torchvision.io import decode_jpeg
    from torchvision.transforms.v2 import functional as F

    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    generator = torch.Generator().manual_seed(0)
    rows = {}
    for width, height in ((96, 96), (384, 288)):
        data = jpeg_bytes(args.images, width, height)
        tensors = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in data]

        def cpu_decode():
            for b in data:
                simplejpeg.decode_jpeg(b, colorspace="RGB")

        def gpu_decode():
            for i in range(0, len(tensors), args.batch):
                decode_jpeg(tensors[i : i + args.batch], device=device)
            sync()

        def gpu_decode_crop():
            for i in range(0, len(tensors), args.batch):
                images = decode_jpeg(tensors[i : i + args.batch], device=device)
                crops = []
                for image in images:
                    h, w = image.shape[-2:]
                    scale = float(torch.empty(1).uniform_(0.25, 1.0, generator=generator))
                    side_h, side_w = max(1, int(h * scale**0.5)), max(1, int(w * scale**0.5))
                    top = int(torch.randint(0, h - side_h + 1, (1,), generator=generator))
                    left = int(torch.randint(0, w - side_w + 1, (1,), generator=generator))
                    crop = F.resized_crop(image, top, left, side_h, side_w, [args.out_size] * 2, antialias=True)
                    crops.append(F.horizontal_flip(crop) if torch.rand(1, generator=generator) < 0.5 else crop)
                torch.stack(crops)
            sync()

        def device_photos_batch():  # imgtrain's --decode gpu: nvJPEG + Pillow's box resize as batched matrices
            from imgtrain.data import device_photos, images, stream

            reader = stream.Reader("unused", "encoded", "photos", (args.out_size, args.out_size, 3), decode="gpu")
            draws = np.random.default_rng(0).random((len(data), images.PHOTO_PARAMS))
            for i in range(0, len(data), args.batch):
                sources = np.empty(len(data[i : i + args.batch]), object)
                sources[:] = data[i : i + args.batch]
                device_photos.batch_images({"source": sources, "draw": draws[i : i + args.batch]}, reader, device)
            sync()

        key = f"{width}x{height}"
        rows[key] = {
            "cpu_simplejpeg_one_core": rate(cpu_decode, len(data)),
            "gpu_nvjpeg_batched": rate(gpu_decode, len(data)),
            "gpu_nvjpeg_crop_flip": rate(gpu_decode_crop, len(data)),
            "imgtrain_decode_gpu_crop_flip": rate(device_photos_batch, len(data)),
            "mean_jpeg_bytes": float(np.mean([len(b) for b in data])),
        }
        print(key, {k: round(v) for k, v in rows[key].items()}, flush=True)
    write_result("gpu_decode_probe", {"environment": environment(), "batch": args.batch, "rows": rows})


if __name__ == "__main__":
    main()
