"""--decode gpu (data/device_photos.py), run on the CPU device: the same crops, flips and policy
operations as the CPU path from the same draws, pixels within one grey level of it on real
photos, the CPU path's exact pixels for the rows it falls back on, and what ``auto`` chooses.
On CUDA: tests/data/test_device_photos_cuda.py."""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pytest
import torch
from PIL import Image

from imgtrain.config import TrainConfig, validate
from imgtrain.config import changed_fields
from imgtrain.data import device_photos, images, photo_augment, stream
from imgtrain.data.format import load_manifest
from imgtrain.data.options import PrepareOptions
from imgtrain.data.photo_augment import PhotoAugment
from imgtrain.data.prepare import prepare
from imgtrain.errors import ImgtrainError
from imgtrain.training import ingest
from tests.integration.test_streamed import make_photos

EVERYTHING = PhotoAugment("randaugment", 9, 0.4, 0.5, (120, 110, 100))


def encoded(pixels: np.ndarray, fmt: str = "JPEG", **save) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt, **save)
    return out.getvalue()


@pytest.fixture(scope="module")
def real_jpegs() -> list[bytes]:
    """scikit-learn's two sample photos (427x640), as JPEGs at full, half and quarter size."""
    from sklearn.datasets import load_sample_images

    out = []
    for pixels in load_sample_images().images:
        for scale in (1, 2, 4):
            im = Image.fromarray(pixels)
            im = im.resize((im.width // scale, im.height // scale), Image.Resampling.BICUBIC)
            out.append(encoded(np.asarray(im), quality=90))
    return out


def rows_of(datas: list) -> np.ndarray:
    out = np.empty(len(datas), object)
    for k, data in enumerate(datas):
        out[k] = data
    return out


def reader_for(shape=(64, 64, 3), aug: PhotoAugment = PhotoAugment(), **fields) -> stream.Reader:
    return stream.Reader("unused", "encoded", "photos", shape, photo_augment=aug, decode="gpu", **fields)


def test_device_pixels_are_within_one_grey_level_of_the_cpu_paths_on_real_photos(real_jpegs):
    shape = (64, 64, 3)
    draws = np.random.default_rng(0).random((3 * len(real_jpegs), images.PHOTO_PARAMS))
    sources = rows_of([real_jpegs[k % len(real_jpegs)] for k in range(len(draws))])
    device = device_photos.batch_images({"source": sources, "draw": draws}, reader_for(shape), "cpu").numpy()
    cpu = np.stack([images.decode_for_training(s, shape, "photos", d) for s, d in zip(sources, draws)])
    difference = np.abs(device.astype(int) - cpu)
    # measured: mean 0.0002, max 1 (float32 sums against Pillow's fixed point, at a rounding edge)
    assert difference.max() <= 1 and difference.mean() < 0.002, (difference.mean(), difference.max())
    # evaluation's centre crop, on the JPEGs Pillow decodes at full scale (the others fall back)
    full = [data for data in real_jpegs if not images.eval_draft_shrinks(images.plain_jpeg_size(data, 3), shape[:2])]
    assert full
    device = device_photos.batch_images({"source": rows_of(full)}, reader_for(shape), "cpu").numpy()
    cpu = np.stack([images.decode_for_training(data, shape, "photos", None) for data in full])
    assert np.abs(device.astype(int) - cpu).max() <= 1


def test_the_resize_is_pillows_box_resize_to_a_grey_level():
    pixels = np.random.default_rng(1).integers(0, 256, (37, 53, 3), np.uint8)
    batch = torch.from_numpy(pixels).permute(2, 0, 1)[None]
    for draw in np.random.default_rng(2).random((40, images.PHOTO_PARAMS)):
        for shape in ((16, 16), (48, 80)):  # shrinking and enlarging
            pil = np.asarray(images.random_resized_crop(Image.fromarray(pixels), draw, shape))
            box = images.crop_box((53, 37), draw)
            ours = device_photos.resize_boxes(batch, [box], [images.flipped(draw)], shape)[0].permute(1, 2, 0).numpy()
            assert np.abs(ours.astype(int) - pil).max() <= 1


def table_of(datas: list[bytes]) -> pa.Table:
    return pa.table({"image": pa.array(datas, pa.binary())})


def test_rows_a_plain_decoder_would_get_wrong_fall_back_to_the_cpu_paths_exact_pixels(real_jpegs):
    pixels = np.asarray(Image.open(io.BytesIO(real_jpegs[2])).convert("RGB"))
    exif = Image.Exif()
    exif[0x0112] = 6  # stored rotated: Pillow turns it upright
    fallbacks = [encoded(pixels, "PNG"), encoded(pixels, quality=90, exif=exif.tobytes()), _cmyk(pixels)]
    datas = [real_jpegs[2], *fallbacks]
    reader = reader_for(global_batch=4, positions_end=4, aug=EVERYTHING)
    rows, positions = np.arange(4), np.arange(4)
    sent = stream._sources(table_of(datas), rows, positions, reader)
    assert isinstance(sent["source"][0], bytes) and all(isinstance(s, np.ndarray) for s in sent["source"][1:])
    device = device_photos.batch_images(sent, reader, "cpu").numpy()
    cpu = stream._pixels(table_of(datas), rows, positions, dataclass_replace(reader, decode="cpu"))
    np.testing.assert_array_equal(device[1:], cpu[1:])  # PNG, EXIF-rotated, CMYK: the same pixels
    assert np.abs(device[0].astype(int) - cpu[0]).mean() < 1  # the JPEG: decoded here


def _cmyk(pixels: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).convert("CMYK").save(out, format="JPEG", quality=90)
    return out.getvalue()


def dataclass_replace(reader, **fields):
    import dataclasses

    return dataclasses.replace(reader, **fields)


@pytest.mark.parametrize("policy", ["randaugment", "trivialaugment", "autoaugment"])
def test_the_policies_draw_the_cpu_paths_operations_for_the_same_image_seed(policy):
    pixels = np.random.default_rng(3).integers(0, 256, (8, 24, 24, 3), np.uint8)
    aug = PhotoAugment(policy, 9, 0.4, 0.5, (120, 110, 100))
    seeds = photo_augment.image_seeds(0, 5, 8)
    before = torch.get_rng_state()
    reader = reader_for((24, 24, 3), aug)
    device = device_photos.batch_images({"source": rows_of(list(pixels)), "draw": np.zeros((8, 5)), "seed": seeds},
                                        reader, "cpu").numpy()
    cpu = np.stack([photo_augment.apply(aug, p, s) for p, s in zip(pixels, seeds)])
    np.testing.assert_array_equal(device, cpu)
    assert sum(not np.array_equal(d, p) for d, p in zip(device, pixels)) >= 6  # they did transform
    assert torch.equal(torch.get_rng_state(), before)  # the process's generator is left alone


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    root = tmp_path_factory.mktemp("device-photos")
    make_photos(root / "src", per_class=6)
    prepare("folder", root / "data", root / "src", PrepareOptions(val_fraction=0.0))
    return root / "data"


def streamed(data, decode: str, world: int, rank: int) -> dict[int, tuple]:
    """Epoch 0's training rows of one rank as the worker gets them (in sequence, cut into
    batches, made on the device for --decode gpu): {id: (pixels, draw or None)}."""
    manifest = load_manifest(data)
    batch, n = 8, manifest["splits"]["train"]["num_samples"]
    reader = stream.Reader.for_data(data, manifest, seed=3, global_batch=batch, positions_end=(n // batch) * batch,
                                    world=world, rank=rank, decode=decode)
    windows = stream.epoch_windows(stream.blocks(data, manifest, "train"), 3, 0, stream.window_blocks(manifest))
    tasks = stream.train_tasks(windows, reader)
    out = {}
    draws = {}
    if decode == "gpu":  # the numbers the device path is handed, by row
        for part in stream.local_parts(tasks, reader):
            draws.update(zip(part["id"].tolist(), part["draw"]))
    for b in ingest._batches(tasks, reader, 4, "cpu", "local", 1, windows):
        out.update((i, (img.numpy(), draws.get(i))) for i, img in zip(b["id"].tolist(), b["image"]))
    return out


def test_the_same_crops_and_flips_at_any_world_size_through_the_streamed_path(photos):
    cpu = streamed(photos, "cpu", 1, 0)
    one = streamed(photos, "gpu", 1, 0)
    two = {**streamed(photos, "gpu", 2, 0), **streamed(photos, "gpu", 2, 1)}
    assert one.keys() == two.keys() == cpu.keys() and len(one) == 16
    for i in one:
        np.testing.assert_array_equal(one[i][1], two[i][1])  # the same draws whoever decodes
        np.testing.assert_array_equal(one[i][0], two[i][0])
        assert np.abs(one[i][0].astype(int) - cpu[i][0]).max() <= 1  # the same crop and flip as the CPU's
    # and the draws are the CPU path's own: row (position % B) of the step's images.photo_draw
    drawn = {tuple(d) for step in (0, 1) for d in images.photo_draw(3, step, 8)}
    assert {tuple(d) for _, d in one.values()} == drawn


@pytest.mark.parametrize("gpus, cpus, policy, chosen", [
    (1, 16, "none", "cpu"), (1, 16, "randaugment", "cpu"),  # 15 decoding CPUs: enough for either
    (8, 32, "none", "cpu"), (8, 32, "randaugment", "gpu"), (8, 32, "trivialaugment", "gpu"),  # 3 per GPU
    (4, 32, "autoaugment", "cpu"), (4, 32, "randaugment", "gpu"),  # 7 per GPU: 7 needed, 8 needed
    (0, 2, "randaugment", "cpu"),  # CPU-only workers
])
def test_auto_chooses_the_gpu_where_each_gpu_has_fewer_cpus_than_the_policy_needs(gpus, cpus, policy, chosen):
    assert device_photos.choose("auto", gpus, cpus, policy) == chosen
    assert device_photos.choose("cpu", gpus, cpus, policy) == "cpu"


def test_the_table_is_benchmarks_cpus_per_gpu():
    assert {p: device_photos.cpus_needed(p) for p in device_photos.DECODE_IMAGES_PER_CPU} == {
        "none": 2, "randaugment": 8, "trivialaugment": 7, "autoaugment": 7}


def test_only_encoded_photos_on_a_gpu_worker_decode_on_the_device():
    photos_manifest = {"storage": "encoded", "preset": "photos"}
    cfg = TrainConfig(name="x", decode="gpu", use_gpu=True)
    assert ingest.decode_path(cfg, photos_manifest, "cpu", 1) == "cpu"
    assert ingest.decode_path(cfg, {**photos_manifest, "storage": "tensor"}, "cuda", 1) == "cpu"
    assert ingest.decode_path(cfg, {**photos_manifest, "preset": "digits"}, "cuda", 1) == "cpu"
    assert ingest.decode_path(cfg, photos_manifest, "cuda", 1) == "gpu"


def test_decode_gpu_on_cpu_workers_is_refused_before_training():
    with pytest.raises(ImgtrainError, match="--decode gpu decodes photos on the workers' GPUs") as error:
        validate(TrainConfig(name="x", decode="gpu"))
    assert "\n" not in str(error.value)
    validate(TrainConfig(name="x", decode="gpu", use_gpu=True))
    validate(TrainConfig(name="x", decode="auto"))
    # the same crops, flips and operations either way: a run may be resumed with another --decode
    assert changed_fields({"decode": "cpu"}, {"decode": "gpu"}) == []


def test_a_batch_is_decoded_in_parts_of_bounded_size(real_jpegs, monkeypatch):
    """Twelve-megapixel photos in a batch of 256 are 9 GB decoded: nvJPEG gets them in parts."""
    sources = rows_of(real_jpegs[:3])  # 427x640, 213x320, 106x160
    monkeypatch.setattr(device_photos, "DECODE_BYTES", 427 * 640 * 3)
    assert device_photos._parts([0, 1, 2], sources, 3) == [[0], [1, 2]]
    draws = np.random.default_rng(4).random((3, images.PHOTO_PARAMS))
    parted = device_photos.batch_images({"source": sources, "draw": draws}, reader_for(), "cpu")
    monkeypatch.undo()
    whole = device_photos.batch_images({"source": sources, "draw": draws}, reader_for(), "cpu")
    assert torch.equal(parted, whole)
