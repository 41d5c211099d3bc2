"""The sweep's terminal: one line per trial state change, in place of Tune's status tables,
and sweep.json kept up to date with each change. Runs in the ``imgtrain tune`` process."""

from __future__ import annotations

import re
import time
from pathlib import Path

from ray import tune

from imgtrain.storage import runs
from imgtrain.sweep import state as st
from imgtrain.sweep.trial import EPOCHS_DONE

_say = print  # where the lines go: set by the sweep's driver (Tune pickles the callback, not this)


def set_output(say) -> None:
    global _say
    _say = say


def format_params(params: dict) -> str:
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


class Reporter(tune.Callback):
    def __init__(self, sweep_dir: str, epochs: int, metric: str):
        self.sweep_dir, self.epochs, self.metric = Path(sweep_dir), epochs, metric

    def _line(self, trial, text: str) -> None:
        _say(f"{time.strftime('%H:%M:%S')} {trial!s}: {text}")

    def _update(self, trial, **fields) -> None:
        st.update_trial(self.sweep_dir, str(trial), params=dict(trial.config), **fields)

    def on_step_end(self, iteration, trials, **info):
        if len(trials) == getattr(self, "_listed", 0):  # Tune steps often: read the file only for new trials
            return
        known = st.read(self.sweep_dir)["trials"]
        for trial in trials:  # trials created and waiting for room: listed by `tune show`
            if str(trial) not in known:
                self._update(trial, status="pending")
        self._listed = len(trials)

    def on_trial_start(self, iteration, trials, trial, **info):
        self._update(trial, status="running", error=None, started=time.time())
        self._line(trial, f"started  {format_params(trial.config)}")

    def on_trial_result(self, iteration, trials, trial, result, **info):
        value = result.get(self.metric)
        self._update(trial, epochs_done=result.get(EPOCHS_DONE), last_metric=value)
        shown = f"{value:.4f}" if isinstance(value, float) else value
        self._line(trial, f"epoch {result.get(EPOCHS_DONE)}/{self.epochs}  {self.metric} {shown}")

    def on_trial_complete(self, iteration, trials, trial, **info):
        done = (trial.last_result or {}).get(EPOCHS_DONE) or 0
        value = (trial.last_result or {}).get(self.metric)
        shown = f"{self.metric} {value:.4f}" if isinstance(value, float) else "no result"
        if done < self.epochs:
            self._update(trial, status="stopped", epochs_done=done, ended=time.time())
            self._line(trial, f"stopped early by the scheduler after epoch {done}/{self.epochs}  ({shown})")
        else:
            self._update(trial, status="finished", epochs_done=done, ended=time.time())
            self._line(trial, f"finished {done} epochs  ({shown})")

    def on_trial_recover(self, iteration, trials, trial, **info):
        self._line(trial, "failed; Tune starts it again (its run resumes from its latest checkpoint)")

    def on_trial_error(self, iteration, trials, trial, **info):
        error = self._error(trial)
        self._update(trial, status="failed", error=error, ended=time.time())
        self._line(trial, f"failed: {error}")

    def _error(self, trial) -> str:
        """The run's own one-line error when it wrote one, else the last line of Tune's."""
        status = runs.read_status(self.sweep_dir / st.TRIALS_DIR / str(trial))
        if status.get("error"):
            return status["error"]
        try:
            lines = [line for line in Path(trial.error_file).read_text().splitlines() if line.strip()]
            # "imgtrain.errors.ImgtrainError: --model x: ..." -> the message itself
            return re.sub(r"^[\w.]*ImgtrainError: ", "", lines[-1].strip()) if lines else "unknown error"
        except (OSError, TypeError):
            return f"see {self.sweep_dir / st.LOGS_DIR}"
