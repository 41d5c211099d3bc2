"""MLflow (``--mlflow URI``): one MLflow run per imgtrain run, through ``MlflowClient``. A
resumed run continues its MLflow run (``mlflow.json``); credentials in the URI are never
written, printed or logged."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path

from imgtrain.config import TrainConfig
from imgtrain.errors import ImgtrainError
from imgtrain.ops import process
from imgtrain.training.tracking.base import Tracker, first_line, model_files, params_of, public_place, public_uri, scrub
from imgtrain.training.tracking.registry import register

MLFLOW_RUN_FILE = "mlflow.json"  # {"tracking_uri", "experiment_id", "run_id"}: a resumed run continues it


class _Scrubbed(logging.Filter):
    """MLflow's log lines (logs/tracking.log, mirrored with the run) without the credentials of
    the URLs they quote: its warnings carry the exception, and that names the URI."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = scrub(record.getMessage()), ()
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:  # a handler formats exc_text as it is, when set
            record.exc_text = scrub(record.exc_text)
        if record.stack_info:
            record.stack_info = scrub(record.stack_info)
        return True


@contextlib.contextmanager
def _environment_forced(**values: str):
    """Set environment variables for the block whatever the user set; theirs come back after.
    (``process.environment`` leaves a user's own setting alone: right for a default, not for
    what the docs promise.)"""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@register
class MLflowTracker(Tracker):
    """One MLflow run per imgtrain run: params at the start, metrics as records arrive, the
    final (best) model's files as artifacts, and the run's outcome as its MLflow status."""

    key, name = "mlflow", "MLflow"
    settings = ("mlflow", "mlflow_experiment")
    extra, module, packages = "mlflow", "mlflow", ("mlflow-skinny", "mlflow")

    def __init__(self, cfg: TrainConfig, run_dir: Path, manifest: dict):
        # For the tracker's life only (the library may run in a notebook): no telemetry leaves
        # the machine unasked, and MLflow's (and alembic's) INFO lines go to the run's log,
        # credentials scrubbed.
        self.scoped = contextlib.ExitStack()
        self.scoped.enter_context(process.environment(MLFLOW_DISABLE_TELEMETRY="true"))
        if public_uri(cfg.mlflow) != cfg.mlflow:
            # set_terminated prints "View run ... at: {URI}/#/..." to stdout for an http(s) URI,
            # password included: off, whatever the user set. Without credentials the link stays.
            self.scoped.enter_context(_environment_forced(MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT="true"))
        self.scoped.enter_context(process.loggers_to(Path(run_dir) / "logs" / "tracking.log", ("mlflow", "alembic")))
        scrubbed = _Scrubbed()
        for handler in logging.getLogger("mlflow").handlers:  # the file handler loggers_to put there
            handler.addFilter(scrubbed)
            self.scoped.callback(handler.removeFilter, scrubbed)
        try:
            from mlflow.tracking import MlflowClient

            self.client = MlflowClient(tracking_uri=cfg.mlflow)
            self.run_id = self._open_run(cfg, run_dir, manifest)
        except Exception as e:
            self.close()
            raise ImgtrainError(
                f"cannot log to MLflow at {public_uri(cfg.mlflow)}: {first_line(e)}; "
                "check the --mlflow URI (e.g. sqlite:///mlflow.db or http://host:5000)"
            ) from None

    def _open_run(self, cfg: TrainConfig, run_dir: Path, manifest: dict) -> str:
        saved_path = run_dir / MLFLOW_RUN_FILE
        try:
            saved = json.loads(saved_path.read_text()) if saved_path.is_file() else {}
        except (OSError, ValueError):  # damaged: a new MLflow run rather than no run at all
            saved = {}
        if saved.get("tracking_uri") == public_uri(cfg.mlflow) and saved.get("run_id"):
            run_id = saved["run_id"]  # a resumed run continues its MLflow run
            self.client.update_run(run_id, status="RUNNING")
            self._log_params(run_id, cfg, manifest)
            return run_id
        experiment = self.client.get_experiment_by_name(cfg.mlflow_experiment)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(cfg.mlflow_experiment)
        run = self.client.create_run(experiment_id, run_name=cfg.name,
                                     tags={"imgtrain.storage": public_place(cfg.storage),
                                           "imgtrain.data": public_place(cfg.data)})
        run_id = run.info.run_id
        saved_path.write_text(json.dumps({"tracking_uri": public_uri(cfg.mlflow), "experiment_id": experiment_id,
                                          "run_id": run_id}, indent=2))
        self._log_params(run_id, cfg, manifest)
        return run_id

    def _log_params(self, run_id: str, cfg: TrainConfig, manifest: dict) -> None:
        """Config and data set summary as params. MLflow params cannot change: a resumed run
        with other operational settings (more epochs, other workers) records them as tags."""
        from mlflow.entities import Param, RunTag

        params = {k: "" if v is None else str(v) for k, v in params_of(cfg, manifest).items()}
        logged = self.client.get_run(run_id).data.params
        new = [Param(k, v[:6000]) for k, v in params.items() if k not in logged]
        changed = [RunTag(f"imgtrain.resumed.{k}", v) for k, v in params.items() if k in logged and logged[k] != v[:6000]]
        for i in range(0, len(new), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(run_id, params=new[i:i + 100])
        if changed:
            self.client.log_batch(run_id, tags=changed)

    def log_metrics(self, values: dict[str, float], step: int, time: float | None) -> None:
        from mlflow.entities import Metric

        stamp = int((time or 0) * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, stamp, step) for k, v in values.items()])

    def log_model(self, checkpoint: Path) -> None:
        with model_files(checkpoint) as files:
            for file in files.values():
                self.client.log_artifact(self.run_id, str(file), artifact_path="model")
        self.client.set_tag(self.run_id, "imgtrain.best_checkpoint", checkpoint.name)

    def end(self, status: str) -> None:
        mlflow_status = {"finished": "FINISHED", "interrupted": "KILLED"}.get(status, "FAILED")
        self.client.set_terminated(self.run_id, status=mlflow_status)

    def close(self) -> None:
        self.scoped.close()
