"""The photo recipe's optional augmentations, after its random resized crop and flip:
``--augment-policy`` (RandAugment, TrivialAugment or AutoAugment), ``--color-jitter`` and
``--random-erasing``, torchvision's ``transforms.v2`` on each uint8 image, in the decoding tasks.

Every image's transformation is a pure function of (seed, global step, its place in the global
batch): torch's generator is seeded from that for each image (``image_seeds``), inside
``fork_rng`` so nothing else's random numbers move. A sample therefore gets the same
transformation at the same step whoever decodes it, at any world size and after any resume.
Torch is imported only when one of them is on: the decoding tasks of the default recipe stay
free of it (seconds and hundreds of MB per task process).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

# Each policy's transform, by its --augment-policy name (config.AUGMENT_POLICIES, which the check
# uses, lists the same names): a new policy is its name there and its line here.
POLICIES = {
    "randaugment": lambda v2, aug, fill: v2.RandAugment(num_ops=2, magnitude=aug.magnitude, fill=fill),
    "trivialaugment": lambda v2, aug, fill: v2.TrivialAugmentWide(fill=fill),
    "autoaugment": lambda v2, aug, fill: v2.AutoAugment(fill=fill),
}


@dataclass(frozen=True)
class PhotoAugment:
    """What to apply (plain fields: it travels to the decoding tasks inside the reader)."""

    policy: str = "none"
    magnitude: int = 9  # RandAugment's, of 31 levels (0-30), as torchvision's and timm's "m9"
    color_jitter: float = 0.0  # brightness, contrast and saturation each by up to this factor
    erasing: float = 0.0  # the probability of erasing a random rectangle
    fill: tuple[int, ...] = (0,)  # the erased rectangle's colour: the data set's mean, per channel

    @property
    def active(self) -> bool:
        return self.policy != "none" or self.color_jitter > 0 or self.erasing > 0


def from_config(cfg, manifest: dict) -> PhotoAugment:
    """The run's settings; erasing fills with the data set's mean colour, which normalisation
    turns into zeros (timm's default "const" mode: nothing the model sees as an edge colour)."""
    mean = manifest["normalize"]["mean"]
    return PhotoAugment(cfg.augment_policy, cfg.augment_magnitude, cfg.color_jitter, cfg.random_erasing,
                        tuple(int(round(m * 255)) for m in mean))


def image_seeds(seed: int, global_step: int, global_batch: int) -> np.ndarray:
    """One seed per place in a global step's batch (the crop's draws come from another stream,
    ``images.photo_draw``, which stays as it was with these off)."""
    return np.random.default_rng([seed, global_step, 0xA097]).integers(0, 2**62, global_batch)


@functools.lru_cache(maxsize=8)
def _transform(aug: PhotoAugment):
    from torchvision.transforms import v2

    steps = []
    fill = list(aug.fill)
    if aug.policy != "none":
        steps.append(POLICIES[aug.policy](v2, aug, fill))
    if aug.color_jitter > 0:
        j = aug.color_jitter
        steps.append(v2.ColorJitter(brightness=j, contrast=j, saturation=j))
    if aug.erasing > 0:
        steps.append(v2.RandomErasing(p=aug.erasing, value=fill))
    return v2.Compose(steps)


def apply(aug: PhotoAugment, pixels: np.ndarray, seed: int) -> np.ndarray:
    """uint8 [H, W, C] -> uint8 [H, W, C], transformed as ``seed`` decides."""
    import torch

    image = torch.from_numpy(np.ascontiguousarray(pixels)).permute(2, 0, 1)
    return apply_tensor(aug, image, seed).permute(1, 2, 0).contiguous().numpy()


def apply_tensor(aug: PhotoAugment, image, seed: int):
    """uint8 [C, H, W] on any device -> the same, transformed as ``seed`` decides. torchvision
    draws each operation and magnitude from torch's CPU generator whatever the image's device,
    so a CUDA image gets the operations a CPU one gets. Only that generator is seeded (not
    ``torch.manual_seed``, which would reseed a training process's CUDA generator too), inside
    ``fork_rng`` so that its state is put back."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(int(seed))
        return _transform(aug)(image)
