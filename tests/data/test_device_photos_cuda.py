"""--decode gpu on CUDA: nvJPEG's pixels against the CPU path's, the policies' operations on CUDA
tensors, and a training process's CUDA generator left alone. Runs only where CUDA is available
(a lent GPU session: ``bench/gpu_session.sh`` runs it); the same code on the CPU device is
tests/data/test_device_photos.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from imgtrain.data import device_photos, images, photo_augment, stream
from imgtrain.data.photo_augment import PhotoAugment

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="decodes on CUDA: needs a GPU (run `pytest tests/data/test_device_photos_cuda.py` on a lent GPU machine, "
           "or bench/gpu_session.sh)")


def reader_for(shape, aug: PhotoAugment = PhotoAugment()) -> stream.Reader:
    return stream.Reader("unused", "encoded", "photos", shape, photo_augment=aug, decode="gpu")


def rows_of(datas: list) -> np.ndarray:
    out = np.empty(len(datas), object)
    for k, data in enumerate(datas):  # one by one: a list of arrays would become a 4-d array
        out[k] = data
    return out


@pytest.fixture(scope="module")
def real_jpegs() -> list[bytes]:
    """scikit-learn's two sample photos (427x640) as JPEGs at full, half and quarter size; where
    scikit-learn is not installed (a lent GPU machine may lack it), generated smooth photos."""
    import io

    from PIL import Image

    try:
        from sklearn.datasets import load_sample_images

        photos = load_sample_images().images
    except ImportError:
        rng = np.random.default_rng(0)
        photos = [np.asarray(Image.fromarray(rng.integers(0, 256, (12, 16, 3), np.uint8)).resize(
            (640, 427), Image.Resampling.BICUBIC)) for _ in range(2)]
    out = []
    for pixels in photos:
        for scale in (1, 2, 4):
            im = Image.fromarray(pixels)
            buffer = io.BytesIO()
            im.resize((im.width // scale, im.height // scale), Image.Resampling.BICUBIC).save(buffer, "JPEG", quality=90)
            out.append(buffer.getvalue())
    return out


def test_nvjpeg_crops_are_within_tolerance_of_the_cpu_paths(real_jpegs):
    shape = (96, 96, 3)
    draws = np.random.default_rng(0).random((8 * len(real_jpegs), images.PHOTO_PARAMS))
    sources = rows_of([real_jpegs[k % len(real_jpegs)] for k in range(len(draws))])
    device = device_photos.batch_images({"source": sources, "draw": draws}, reader_for(shape), "cuda")
    assert device.device.type == "cuda" and device.shape == (len(draws), *shape)
    cpu = np.stack([images.decode_for_training(s, shape, "photos", d) for s, d in zip(sources, draws)])
    difference = np.abs(device.cpu().numpy().astype(int) - cpu)
    print(f"nvJPEG + device crop against the CPU path: mean {difference.mean():.3f}, "
          f"99.9th percentile {np.percentile(difference, 99.9):.0f}, max {difference.max()} grey levels")
    # nvJPEG's IDCT and chroma upsampling are not libjpeg-turbo's: a grey level or two on average
    assert difference.mean() < 1.5 and np.percentile(difference, 99.9) <= 12


def test_the_policies_on_cuda_draw_the_cpus_operations_and_leave_the_cuda_generator_alone():
    pixels = np.random.default_rng(3).integers(0, 256, (8, 32, 32, 3), np.uint8)
    aug = PhotoAugment("randaugment", 9, 0.4, 0.5, (120, 110, 100))
    seeds = photo_augment.image_seeds(0, 5, 8)
    cuda_state = torch.cuda.get_rng_state()
    device = device_photos.batch_images({"source": rows_of(list(pixels)), "draw": np.zeros((8, 5)), "seed": seeds},
                                        reader_for((32, 32, 3), aug), "cuda").cpu().numpy()
    cpu = np.stack([photo_augment.apply(aug, p, s) for p, s in zip(pixels, seeds)])
    # the same operations and magnitudes; CUDA's arithmetic may round a level differently
    assert np.abs(device.astype(int) - cpu).mean() < 0.5
    assert torch.equal(torch.cuda.get_rng_state(), cuda_state)
