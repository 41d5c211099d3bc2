"""What a checkpoint's calibration holds (``Calibration``: the temperature of temperature scaling
and the ``--reject auto`` thresholds), read back from its ``calibrated.pt`` (storage/checkpoint.py)
or from an export's record, which copies the temperature and the thresholds of the scores the
export gives (max-softmax; energy and max-logit too with its logits output). Fitted by
``calibrate.py``; read by predict, serve, evaluate and export."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from imgtrain.errors import ImgtrainError
from imgtrain.inference import ood, temperature
from imgtrain.inference.preprocess import LoadedCheckpoint
from imgtrain.storage import checkpoint as ckpt

SPLIT = "val"  # the only split a calibration is fitted on
EXPORT_TEMPERATURE = "temperature"  # an export record's copy (export.py), read back by calibration_at
# {"method": "max-softmax", "threshold": its float | None, "keep": 0.95, "thresholds": {score: float}}
# ("thresholds": exports with the logits output, export_record.LOGITS_NAME: every score they give)
EXPORT_OOD = "ood"


@dataclass
class Calibration:
    temperature: float
    fitted_on: str | None = SPLIT
    images: int = 0
    nll: tuple = (None, None)  # on the split fitted on: before (T = 1), after
    ece: tuple = (None, None)
    ood_keep: float = ood.KEEP
    ood_thresholds: dict = field(default_factory=dict)  # score method -> the threshold keeping ood_keep
    mahalanobis: dict | None = None  # ood.fit_mahalanobis's whitening and whitened class means (numpy)

    def to_file(self) -> dict:
        import torch

        fitted = ({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in self.mahalanobis.items()}
                  if self.mahalanobis else None)
        return {"temperature": float(self.temperature), "fitted_on": self.fitted_on, "images": int(self.images),
                "nll": [float(v) for v in self.nll], "ece": [float(v) for v in self.ece],
                "ood_keep": float(self.ood_keep), "ood_thresholds": {k: float(v) for k, v in self.ood_thresholds.items()},
                "mahalanobis": fitted}

    @classmethod
    def from_file(cls, saved: dict) -> Calibration:
        """From ``checkpoint.load_calibration`` (its temperature and thresholds checked there)."""
        pair = lambda v: tuple(v) if isinstance(v, list) and len(v) == 2 else (None, None)  # noqa: E731
        keep = saved.get("ood_keep")
        return cls(temperature=float(saved["temperature"]),
                   fitted_on=SPLIT if saved.get("fitted_on") == SPLIT else None,
                   images=saved["images"] if isinstance(saved.get("images"), int) else 0,
                   nll=pair(saved.get("nll")), ece=pair(saved.get("ece")),
                   ood_keep=float(keep) if isinstance(keep, float) and 0 < keep <= 1 else ood.KEEP,
                   ood_thresholds={k: float(v) for k, v in saved["ood_thresholds"].items() if k in ood.METHODS},
                   mahalanobis={k: v.float().numpy() for k, v in saved["mahalanobis"].items()}
                   if saved.get("mahalanobis") is not None else None)

    def line(self) -> str:
        """One line: the temperature and what it did on the split it was fitted on."""
        (nll0, nll1), (ece0, ece1) = self.nll, self.ece
        figures = (f": NLL {nll0:.4f} -> {nll1:.4f}, ECE {ece0:.4f} -> {ece1:.4f}"
                   if None not in (nll0, nll1, ece0, ece1) else "")
        return f"temperature T = {self.temperature:.4f}, fitted on {self.images:,} {self.fitted_on} images{figures}"


def calibration_of(loaded: LoadedCheckpoint) -> Calibration | None:
    """The calibration a loaded checkpoint (or export folder) holds; None without one."""
    return calibration_at(loaded.path, loaded.meta)


def calibration_at(path: Path, meta: dict) -> Calibration | None:
    """The calibration of the checkpoint (or export folder) ``path`` whose meta.json (or record) is ``meta``."""
    from imgtrain.inference.export_record import is_export

    if is_export(path):
        return _export_calibration(meta, path)
    saved = ckpt.load_calibration(path)
    return Calibration.from_file(saved) if saved is not None else None


def _export_calibration(record: dict, folder) -> Calibration | None:
    """An export record's temperature and score thresholds, held to what they can be."""
    t = record.get(EXPORT_TEMPERATURE)
    if t is None:
        return None
    scores = record.get(EXPORT_OOD) if isinstance(record.get(EXPORT_OOD), dict) else {}
    thresholds = scores.get("thresholds") if isinstance(scores.get("thresholds"), dict) else {}
    thresholds = {m: v for m, v in thresholds.items() if m in ood.LOGIT_SCORES}
    if scores.get("threshold") is not None:  # an export made before "thresholds": max-softmax's alone
        thresholds.setdefault("max-softmax", scores["threshold"])
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)  # noqa: E731
    wrong = [v for v in thresholds.values() if not number(v)]
    if not number(t) or not temperature.MIN_TEMPERATURE <= t <= temperature.MAX_TEMPERATURE or wrong:
        raise ImgtrainError(f"export {folder}: imgtrain.json's temperature {t!r} or score threshold "
                            f"{(wrong or [None])[0]!r} is not a number it can be; export the model again")
    return Calibration(temperature=float(t), ood_thresholds={m: float(v) for m, v in thresholds.items()})
