"""TensorBoard (``--tensorboard``): event files under ``{run}/tensorboard``, written by torch's
``SummaryWriter``; ``tensorboard --logdir runs/`` shows every run."""

from __future__ import annotations

from pathlib import Path

from imgtrain.config import TrainConfig
from imgtrain.training.tracking.base import Tracker, tracked_config
from imgtrain.training.tracking.registry import register

TENSORBOARD_DIR = "tensorboard"


@register
class TensorBoardTracker(Tracker):
    """The metrics as scalars and the config as text; no model (TensorBoard keeps none)."""

    key, name = "tensorboard", "TensorBoard"
    settings = ("tensorboard",)
    extra, module, packages = "tensorboard", "torch.utils.tensorboard", ("tensorboard",)

    def __init__(self, cfg: TrainConfig, run_dir: Path, manifest: dict | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.directory = run_dir / TENSORBOARD_DIR
        self.writer_class = SummaryWriter
        self.writer = SummaryWriter(str(self.directory))
        self.writer.add_text("config", "\n".join(f"    {k} = {v!r}" for k, v in tracked_config(cfg.to_dict()).items()))

    def restarted(self, step: int) -> None:
        # Steps after the checkpoint are trained again, and TensorBoard hides what was logged
        # for them before (as metrics.jsonl drops it).
        self.writer.close()
        self.writer = self.writer_class(str(self.directory), purge_step=step + 1)

    def log_metrics(self, values: dict[str, float], step: int, time: float | None) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step, walltime=time)

    def end(self, status: str) -> None:
        self.writer.close()

    def close(self) -> None:
        self.writer.close()
