"""What runs inside one Ray Tune trial: an ordinary imgtrain run (``driver.train``), headless.

The trial's run is named after the trial, so a trial that Tune starts again (a restored sweep,
a retried trial) finds its run and resumes it from its latest checkpoint. Metrics reach Tune
from Ray Train's controller (``EpochsToTune``), one result per epoch, which is what ASHA needs.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from imgtrain.training import faults

# The metric a result carries for the scheduler's clock: epochs trained by the run, which a
# resumed run continues (Tune's own training_iteration restarts at 1 when a trial restarts
# without a Tune checkpoint).
EPOCHS_DONE = "epochs_done"


def run_trial(params: dict, sweep: dict) -> None:
    """The Tune function trainable. ``params``: this trial's sampled settings; ``sweep``: the
    base settings and the sweep's absolute folders (trials chdir to a folder of their own)."""
    from ray import tune
    from imgtrain.config import TrainConfig
    from imgtrain.console import SafeConsole
    from imgtrain.storage.runs import epoch_history
    from imgtrain.training import driver
    from imgtrain.training.progress import TrainingDisplay

    if sweep.get("fault"):
        os.environ[faults.ENV_VAR] = sweep["fault"]  # this trial's process only (Tune reuses none)
    name = tune.get_context().get_trial_name()
    cfg = TrainConfig(**{**sweep["base"], **params, "name": name, "storage": sweep["trials_dir"]})
    started = time.time()
    # The run's progress lines (as `imgtrain train` prints them when not on a terminal) go to
    # the sweep's logs; the sweep's own terminal shows one line per trial state change.
    with open(Path(sweep["logs_dir"]) / f"{name}.log", "a") as out:
        console = SafeConsole(file=out, force_terminal=False, width=160)
        # Tune learns of each epoch from Ray Train's reports: the sweep hands training the callback
        driver.train(cfg, display=TrainingDisplay(console), ray_callbacks=callbacks())
    history = epoch_history(Path(sweep["trials_dir"]) / name)
    if history and history[-1].get("time", 0) < started:
        # The run had trained every epoch before (the sweep was interrupted after the run
        # finished, before Tune recorded it): nothing was reported this time, so Tune learns
        # the run's last epoch here.
        tune.report(to_tune(history[-1]))


def to_tune(metrics: dict) -> dict:
    """An epoch's metrics as a Tune result: numbers only (the scheduler and the state file
    need nothing else), and the epochs done so far."""
    kept = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return {**kept, EPOCHS_DONE: metrics["epoch"] + 1}


def callbacks() -> list:
    """Ray Train callbacks for a run: inside a Tune trial, the one that sends its epoch
    metrics to Tune; none otherwise."""
    from ray.tune.trainable.trainable_fn_utils import _in_tune_session

    if not _in_tune_session():
        return []
    from ray.tune.integration.ray_train import TuneReportCallback

    class EpochsToTune(TuneReportCallback):
        """Rank 0's epoch results to Tune. Step checkpoints (``checkpoint_every_steps``) are
        reports too, with no evaluation (the selection metric's stand-in), and so is the
        average checkpoint (``--average-last``, no training figures): the scheduler must not
        see them."""

        def after_report(self, run_context, metrics, checkpoint):
            if "train_loss" in metrics[0]:
                super().after_report(run_context, [to_tune(metrics[0])], checkpoint)

    return [EpochsToTune()]
