"""Knowledge distillation (``--teacher``, docs/training.md "Distillation"): the teacher, its
identity, the loss, and where each step's teacher logits come from.

The student's loss per row is ``(1 - w) * CE(labels) + w * T^2 * KL(softmax(t / T) || softmax(s / T))``
(Hinton et al. 2015): ``w`` is ``--distill-weight``, ``T`` ``--distill-temperature``; the T^2
keeps the soft term's gradients the size of the hard one's whatever T.

The teacher's logits come from one of two places (``--distill-mode``):

* **cached**: computed once over the training split (``teacher_cache.py``) and looked up by each
  row's id, the id every batch carries from the data set through Ray Data or the torch ingest;
* **online**: the teacher itself, in eval mode and without gradients, run in each worker on
  the step's own images (augmented, mixed) before they are cut into --accumulate pieces.

Either way a step's teacher logits are a function of the step's rows and images alone, so a
resumed run and an uninterrupted one see the same ones, at any world size.

An export folder may teach: its engine returns calibrated probabilities, whose logarithms are
its logits up to a constant per row (which a softmax ignores) and its own temperature.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from imgtrain.config import TrainConfig
from imgtrain.errors import ImgtrainError, one_line

MODES = ("cached", "online")


@dataclass
class Teacher:
    """A loaded teacher: ``loaded`` (``preprocess.LoadedCheckpoint``), where it is and its sha256."""

    loaded: object
    location: str
    sha256: str

    @property
    def exported(self) -> bool:  # an export's engine: probabilities out, uint8 images in
        return hasattr(self.loaded.model, "probabilities")

    @torch.no_grad()
    def logits_of_images(self, images: np.ndarray, device="cpu") -> np.ndarray:
        """uint8 images [B, H, W, C] of the teacher's shape -> float32 logits [B, K] (the cache's)."""
        if self.exported:
            probs = self.loaded.model.probabilities(self.loaded.preprocess.checked(images), "none")
            return np.log(np.maximum(probs, 1e-30)).astype(np.float32)
        with torch.inference_mode():
            return self.loaded.model(self.loaded.preprocess(images, device)).float().cpu().numpy()

    @torch.no_grad()
    def logits_of_inputs(self, x: torch.Tensor, mean, std) -> torch.Tensor:
        """The student's normalised input [B, C, H, W] -> the teacher's logits [B, K] on its device:
        the pixels put back to [0, 1], normalised as the teacher was, resized to its input size."""
        p = self.loaded.preprocess
        h, w, _ = p.image_shape
        pixels = x.float() * _column(std, x) + _column(mean, x)  # [0, 1]
        if pixels.shape[-2:] != (h, w):
            pixels = F.interpolate(pixels, size=(h, w), mode="bilinear", antialias=True, align_corners=False)
        if self.exported:
            images = (pixels.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
            probs = self.loaded.model.probabilities(images, "none")
            return torch.from_numpy(np.log(np.maximum(probs, 1e-30))).to(x.device)
        inputs = (pixels - _column(p.mean, x)) / _column(p.std, x)
        if p.channels_last:
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        return self.loaded.model(inputs).float()


def _column(values, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.float32, device=like.device).view(1, -1, 1, 1)


def load(cfg: TrainConfig, device="cpu") -> Teacher:
    """The teacher ``cfg.teacher`` names (a run in --storage, a run, checkpoint or export folder),
    its checksums verified as ``predict`` verifies them; anything unreadable refused in one line."""
    from imgtrain.inference.export_engine import load_export
    from imgtrain.inference.export_formats import ENGINES
    from imgtrain.inference.export_record import EXPORT_META, is_export
    from imgtrain.inference.predictor import load_checkpoint
    from imgtrain.ops.files import sha256_file
    from imgtrain.storage import checkpoint as ckpt

    target = cfg.teacher
    try:
        if is_export(target):
            engine = next((name for name, spec in ENGINES.items() if spec and (Path(target) / spec.file).is_file()), None)
            if engine is None:
                raise ImgtrainError(f"{target}/{EXPORT_META} names no model file an engine here runs")
            loaded = load_export(target, engine)
            sha = loaded.meta["sha256"][ENGINES[engine].file]  # checked against the file by load_export
        else:
            loaded = load_checkpoint(target, "best", cfg.storage, device)
            sha = sha256_file(loaded.path / ckpt.MODEL_FILE)
    except ImgtrainError as e:
        raise ImgtrainError(f"--teacher {target}: {e}") from None
    except Exception as e:  # noqa: BLE001 - any unreadable teacher gets the same one-line answer
        raise ImgtrainError(f"--teacher {target}: cannot be loaded ({type(e).__name__}: {one_line(e, 160)})") from None
    return Teacher(loaded, str(target), sha)


def check_fits(teacher: Teacher, manifest: dict) -> None:
    """Refuse, in one line, a teacher that cannot teach this data set."""
    from imgtrain.data.format import is_multi_label

    if is_multi_label(manifest):
        raise ImgtrainError("--teacher: distillation is for data sets with one label per image; this one has "
                            "label sets: drop --teacher")
    ours, theirs = list(manifest["classes"]), list(teacher.loaded.preprocess.classes)
    if ours != theirs:
        differ = "another order" if sorted(ours) == sorted(theirs) else \
            f"{len(theirs)} classes ({_few(theirs)}) against the data set's {len(ours)} ({_few(ours)})"
        raise ImgtrainError(f"--teacher {teacher.location} knows {differ}: a teacher must have the data set's "
                            "classes in its order (train it on this data set)")


def _few(names: list) -> str:
    return ", ".join(map(str, names[:4])) + (", ..." if len(names) > 4 else "")


def mode_for(cfg: TrainConfig) -> str:
    """``auto``: online when every step's images are new (--augment, --mixup, --cutmix), else cached."""
    if cfg.distill_mode != "auto":
        return cfg.distill_mode
    return "online" if cfg.augment or cfg.mixup > 0 or cfg.cutmix > 0 else "cached"


def resolved(cfg: TrainConfig, manifest: dict, stored: dict | None, note) -> TrainConfig:
    """The config with the teacher decided (driver, before the run starts): loaded and checked,
    its mode chosen, its identity recorded; on a resumed run (``stored``: its config) a teacher
    changed since is refused."""
    if not cfg.teacher:
        return cfg
    teacher = load(cfg)
    check_fits(teacher, manifest)
    mode = mode_for(cfg)
    channels = teacher.loaded.preprocess.image_shape[2]
    if mode == "online" and channels != manifest["image_shape"][2]:
        raise ImgtrainError(f"--teacher {cfg.teacher} takes {channels}-channel images and this data set's have "
                            f"{manifest['image_shape'][2]}: online it sees the student's own images; use "
                            "--distill-mode cached (the teacher's logits of the stored images, converted as predict does)")
    if mode == "cached" and mode_for(dataclasses.replace(cfg, distill_mode="auto")) == "online":
        note("note: --distill-mode cached with augmentation or mixing: the teacher's logits are of the stored "
             "images, not of each step's augmented ones")
    if stored and stored.get("teacher_sha256") and stored["teacher_sha256"] != teacher.sha256:
        raise ImgtrainError(f"--teacher {cfg.teacher} has changed since run {cfg.name!r} began (sha256 "
                            f"{stored['teacher_sha256'][:12]}... then, {teacher.sha256[:12]}... now): resuming would not "
                            "continue the same distillation; restore the teacher or pass --overwrite")
    # its folder's own name: the card and trackers carry it, and a path names this machine's folders
    identity = (f"{Path(cfg.teacher).name} (sha256 {teacher.sha256[:16]}), {mode}, T {cfg.distill_temperature:g}, "
                f"weight {cfg.distill_weight:g}")
    note(f"distilling from {cfg.teacher}: {identity}")
    return dataclasses.replace(cfg, distill_mode=mode, teacher_sha256=teacher.sha256, distillation=identity)


# ---------------------------------------------------------------- in the training step


class Signal:
    """Where a worker's teacher logits come from: the cache's table or the teacher itself."""

    def __init__(self, cfg: TrainConfig, manifest: dict, device, table=None):
        self.temperature, self.weight = cfg.distill_temperature, cfg.distill_weight
        self.mean, self.std = manifest["normalize"]["mean"], manifest["normalize"]["std"]
        self.teacher = None
        if cfg.distill_mode == "online":
            teacher = load(cfg, str(device))
            if not teacher.exported:
                teacher.loaded.model.eval().requires_grad_(False)
            self.teacher = teacher
        else:
            if table is None:
                raise RuntimeError("--distill-mode cached: the backend was handed no teacher logits")
            self.table = _opened(table)  # its path: each step reads its own rows
            self.device = device

    def logits(self, batch: dict, x: torch.Tensor) -> torch.Tensor:
        """The teacher's logits [B, K] of the step's rows (``batch["id"]``) or images (``x``)."""
        if self.teacher is not None:
            return self.teacher.logits_of_inputs(x, self.mean, self.std)
        # looked up by id: the same rows whatever the world size, the rank or the resume
        return torch.from_numpy(self.table.rows_of(batch["id"].cpu().numpy())).to(self.device, non_blocking=True)

    def loss(self, student: torch.Tensor, teacher: torch.Tensor, hard: torch.Tensor) -> torch.Tensor:
        """The rows' summed distillation loss, from the summed cross-entropy ``hard``."""
        t = self.temperature
        soft = F.kl_div(F.log_softmax(student.float() / t, 1), F.log_softmax(teacher.float() / t, 1),
                        reduction="sum", log_target=True)
        return (1.0 - self.weight) * hard + self.weight * t * t * soft


def _opened(found: dict):
    """The cache's table (``found``: its ``logits_table.Ref`` as a dict), refused in one line where
    this node cannot read it whole."""
    from imgtrain.training import logits_table

    ref = logits_table.Ref(**found)
    table = logits_table.fetch(ref) if ref.uri else logits_table.read(ref)
    if table is None:
        raise ImgtrainError(f"--distill-mode cached: the teacher's logits {ref.logits} cannot be read on this node "
                            "(absent, or not whole); on a cluster they are kept beside the data set, which every "
                            "node must read at the same path, or use --distill-mode online")
    return table
