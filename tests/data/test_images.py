"""Training's decode of photos: the libjpeg-turbo fast path gives Pillow's pixels, and hands
Pillow what it cannot do the same way (EXIF orientation, a colour JPEG for a gray model)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from imgtrain.data import images


def jpeg(pixels: np.ndarray, orientation: int | None = None) -> bytes:
    out, im = io.BytesIO(), Image.fromarray(pixels)
    if orientation is None:
        im.save(out, format="JPEG", quality=90)
    else:
        exif = Image.Exif()
        exif[0x0112] = orientation
        im.save(out, format="JPEG", quality=90, exif=exif)
    return out.getvalue()


def by_pillow(data: bytes, shape, draw) -> np.ndarray:
    h, w, c = shape
    with images.open_image(data) as im:
        out = images.random_resized_crop(images.to_mode(im, c), draw, (h, w))
        return np.asarray(out, dtype=np.uint8).reshape(h, w, c)


@pytest.mark.parametrize("gray_file", [False, True])
@pytest.mark.parametrize("channels", [1, 3])
def test_training_decode_gives_pillows_pixels(gray_file, channels):
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (37, 53) if gray_file else (37, 53, 3), dtype=np.uint8)
    data, shape = jpeg(pixels), (24, 24, channels)
    assert (images._decode_plain_jpeg(data, channels) is None) == (channels == 1 and not gray_file)
    for _ in range(5):
        draw = rng.random(images.PHOTO_PARAMS)
        np.testing.assert_array_equal(images.decode_for_training(data, shape, "photos", draw),
                                      by_pillow(data, shape, draw))


def test_a_rotated_phone_photo_is_turned_upright_in_training():
    pixels = np.zeros((20, 60, 3), np.uint8)
    pixels[:, :30] = 255  # left half white; orientation 6: shown rotated 90 degrees clockwise
    data = jpeg(pixels, orientation=6)
    assert images._decode_plain_jpeg(data, 3) is None
    top_left = np.array([0.99, 0.0, 0.0, 0.0, 0.9])  # upright: a 20x40 crop from the top, no flip
    out = images.decode_for_training(data, (60, 20, 3), "photos", top_left)
    np.testing.assert_array_equal(out, by_pillow(data, (60, 20, 3), top_left))
    assert out[:40].mean() > 200 and out[-10:].mean() < 50  # white on top, black below


def test_the_pixel_limit_holds_before_decoding(monkeypatch):
    data = jpeg(np.zeros((40, 40, 3), np.uint8))
    monkeypatch.setattr(images, "MAX_DECODE_PIXELS", 1000)
    with pytest.raises(images.ImageTooLarge, match="40x40 pixels"):
        images.decode_for_training(data, (8, 8, 3), "photos", np.full(images.PHOTO_PARAMS, 0.5))


def test_the_smallest_random_crop_keeps_crop_min_area_of_the_photo():
    pixels = np.zeros((100, 100, 3), np.uint8)
    pixels[:50, :50] = 255  # the top-left quarter white
    smallest = np.array([0.0, 0.5, 0.0, 0.0, 0.9])  # the smallest area, square, top left, no flip
    data = jpeg(pixels)
    quarter = images.decode_for_training(data, (20, 20, 3), "photos", smallest, min_area=0.25)
    whole = images.decode_for_training(data, (20, 20, 3), "photos", smallest, min_area=1.0)
    assert quarter.mean() > 240  # exactly the white quarter
    assert 50 < whole.mean() < 80  # the whole photo: a quarter of it white


def test_the_streamed_reader_and_the_training_setting_share_one_default_crop_range():
    from imgtrain.config import TrainConfig

    assert TrainConfig().crop_min_area == images.CROP_MIN_AREA
