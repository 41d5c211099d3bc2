"""What a sweep asks for: ``SweepRequest``, its own options (``--trials``, ``--scheduler``,
``--metric``, ``--mode``, ``--max-concurrent``, also a config file's ``[sweep]`` keys) declared
once, and what identifies it in sweep.json. Imports no Ray: ``imgtrain tune --help`` reads it."""

from __future__ import annotations

import dataclasses
import math

from imgtrain.config import TrainConfig, settings
from imgtrain.settings import option, settings_of
from imgtrain.sweep.space import METRICS, SCHEDULERS, Dimension

# Settings that may differ on a re-run without changing the experiment (where, how fast, logs).
RUN_ONLY = tuple(s.name for s in settings() if s.run_only)


@dataclasses.dataclass
class SweepRequest:
    base: TrainConfig  # every trial's settings before the searched ones; base.name is the sweep's
    search: dict[str, Dimension]
    trials: int = option(1, "Trials to sample (each grid point this many times)")  # Tune's num_samples
    scheduler: str = option("asha", f"{' or '.join(SCHEDULERS)}: ASHA stops weak trials early, at epoch 1, 4, "
                            "16, ...", choices=SCHEDULERS)
    metric: str = option("val_accuracy", f"Per-epoch metric to optimise: {', '.join(METRICS)}",
                         choices=tuple(METRICS))
    mode: str | None = option(None, "max or min", choices=("max", "min"), shown="the metric's own")
    max_concurrent: int = option(0, "Trials at once, at most", shown="as many as the cluster's CPUs and GPUs hold")

    def total_trials(self) -> int:
        return self.trials * math.prod(len(d.args) for d in self.search.values() if d.func == "grid")

    def stored(self) -> dict:
        """What identifies the experiment in sweep.json (a re-run must ask for the same)."""
        base = {k: v for k, v in self.base.to_dict().items() if k not in RUN_ONLY}
        return {"base": base, "search": {k: d.text() for k, d in self.search.items()}, "trials": self.trials,
                "scheduler": self.scheduler, "metric": self.metric, "mode": self.mode}


# A config file's [sweep] table: the request's own options, by name, with their types.
SWEEP_KEYS = {s.name: s.type for s in settings_of(SweepRequest)}
