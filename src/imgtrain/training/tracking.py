"""Experiment tracking: MLflow (``--mlflow URI``) and TensorBoard (``--tensorboard``).

Only rank 0's records (and each rank's own timing records) reach the trackers, through the
driver: the same records that go to ``metrics.jsonl`` and the progress display. Logging from
the driver means one MLflow run per imgtrain run however often the worker group is restarted,
and the workers never wait for a tracking server. The trackers are optional extras
(``pip install 'imgtrain[mlflow]'``, ``'imgtrain[tensorboard]'``); the base install stays lean.

Metric names, the same in both (x axis: the global optimizer step):
  step/loss, step/accuracy, step/images_per_s, step/data_wait_fraction, step/lr
  epoch/train_loss, epoch/train_accuracy, epoch/val_loss, epoch/val_accuracy,
  epoch/images_per_s, epoch/data_wait_fraction, epoch/epoch_time_s
  rank{R}/step_time_s, rank{R}/data_wait_s, rank{R}/data_wait_fraction
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from pathlib import Path

from imgtrain.config import TrainConfig
from imgtrain.errors import ImgtrainError
from imgtrain.ops import process

MLFLOW_RUN_FILE = "mlflow.json"  # {"tracking_uri", "experiment_id", "run_id"}: a resumed run continues it
TENSORBOARD_DIR = "tensorboard"
STEP_KEYS = ("loss", "accuracy", "images_per_s", "data_wait_fraction", "lr", "grad_norm", "loss_scale")
EPOCH_KEYS = ("train_loss", "train_accuracy", "val_loss", "val_accuracy", "val_f1_macro", "images_per_s",
              "data_wait_fraction", "epoch_time_s")
RANK_KEYS = ("step_time_s", "data_wait_s", "data_wait_fraction")
MODEL_FILES = ("model.pt", "meta.json")  # the final model; train_state.pt (optimizer) stays out


def metrics_of(record: dict) -> dict[str, float]:
    """The tracked metrics in one record, by their tracked names."""
    kind = record.get("kind")
    if kind == "step":
        keys, prefix = STEP_KEYS, "step"
    elif kind == "epoch":
        keys, prefix = EPOCH_KEYS, "epoch"
    elif kind == "rank":
        keys, prefix = RANK_KEYS, f"rank{record['rank']}"
    else:
        return {}
    return {f"{prefix}/{k}": float(record[k]) for k in keys if record.get(k) is not None}


def public_uri(uri: str | None) -> str | None:
    """A tracking URI without the user name and password it may carry (``http://u:p@host``):
    what is written to files (config.json, meta.json, report.html) and messages. MLflow reads
    credentials from MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD as well."""
    if not uri or "@" not in uri:
        return uri
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(uri)
    if not parts.netloc or "@" not in parts.netloc:
        return uri
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def scrub(text: str) -> str:
    """``text`` with the credentials of every URL in it removed (MLflow's errors quote the URI).
    Up to the authority's last ``@``, as ``public_uri`` and requests read it: a password may hold one."""
    return re.sub(r"(\w+://)[^/?#\s]*@", r"\1", text)


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


def public_config(cfg: TrainConfig) -> dict:
    """The config as it may be stored and shown: credentials removed from the MLflow URI."""
    return dict(cfg.to_dict(), mlflow=public_uri(cfg.mlflow))


def require(cfg: TrainConfig) -> None:
    """Fail in seconds, before Ray starts, when a tracker is asked for but not installed."""
    missing = []
    if cfg.mlflow:
        try:
            import mlflow  # noqa: F401
        except ImportError:
            missing.append("--mlflow needs MLflow: pip install 'imgtrain[mlflow]'")
    if cfg.tensorboard:
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except ImportError:
            missing.append("--tensorboard needs TensorBoard: pip install 'imgtrain[tensorboard]'")
    if missing:
        raise ImgtrainError("; ".join(missing))


def open_trackers(cfg: TrainConfig, run_dir: Path, manifest: dict, note) -> list:
    trackers = []
    if cfg.mlflow:
        trackers.append(MLflowTracker(cfg, run_dir, manifest))
    if cfg.tensorboard:
        trackers.append(TensorBoardTracker(cfg, run_dir))
    return [_Guarded(t, note) for t in trackers]


class _Guarded:
    """A tracker failing mid-run (a tracking server gone) warns once; training goes on."""

    def __init__(self, tracker, note):
        self.tracker, self.note, self.failed = tracker, note, False

    def log(self, record: dict) -> None:
        self._call(self.tracker.log, record)

    def finish(self, status: str, best_checkpoint: Path | None) -> None:
        try:
            self._call(self.tracker.finish, status, best_checkpoint)
        finally:
            self.tracker.close()  # even after a failure: what it changed in the process is put back

    def _call(self, method, *args) -> None:
        if self.failed:
            return
        try:
            method(*args)
        except Exception as e:  # never let tracking fail the training it tracks
            self.failed = True
            first = scrub((str(e).splitlines() or [""])[0])[:200]
            self.note(f"warning: {self.tracker.name} logging stopped: {type(e).__name__}: {first}")


class MLflowTracker:
    """One MLflow run per imgtrain run: params at the start, metrics as records arrive, the
    final (best) model's files as artifacts, and the run's outcome as its MLflow status."""

    name = "MLflow"

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
                f"cannot log to MLflow at {public_uri(cfg.mlflow)}: {type(e).__name__}: "
                f"{scrub(str(e).strip().splitlines()[0])[:200]}; "
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
                                     tags={"imgtrain.run_dir": str(run_dir), "imgtrain.data": cfg.data})
        run_id = run.info.run_id
        saved_path.write_text(json.dumps({"tracking_uri": public_uri(cfg.mlflow), "experiment_id": experiment_id,
                                          "run_id": run_id}, indent=2))
        self._log_params(run_id, cfg, manifest)
        return run_id

    def _log_params(self, run_id: str, cfg: TrainConfig, manifest: dict) -> None:
        """Config and data set summary as params. MLflow params cannot change: a resumed run
        with other operational settings (more epochs, other workers) records them as tags."""
        from mlflow.entities import Param, RunTag

        params = {k: "" if v is None else str(v) for k, v in public_config(cfg).items()}
        params.update({"data_name": manifest.get("name", ""), "data_train_samples": str(manifest["splits"]["train"]["num_samples"]),
                       "data_test_samples": str(manifest["splits"]["test"]["num_samples"])})
        logged = self.client.get_run(run_id).data.params
        new = [Param(k, v[:6000]) for k, v in params.items() if k not in logged]
        changed = [RunTag(f"imgtrain.resumed.{k}", v) for k, v in params.items() if k in logged and logged[k] != v[:6000]]
        for i in range(0, len(new), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(run_id, params=new[i:i + 100])
        if changed:
            self.client.log_batch(run_id, tags=changed)

    def log(self, record: dict) -> None:
        from mlflow.entities import Metric

        values = metrics_of(record)
        if values:
            stamp = int(record.get("time", 0) * 1000)
            self.client.log_batch(self.run_id, metrics=[Metric(k, v, stamp, record["step"]) for k, v in values.items()])

    def finish(self, status: str, best_checkpoint: Path | None) -> None:
        if status == "finished" and best_checkpoint is not None:
            for name in MODEL_FILES:
                self.client.log_artifact(self.run_id, str(best_checkpoint / name), artifact_path="model")
            self.client.set_tag(self.run_id, "imgtrain.best_checkpoint", str(best_checkpoint))
        mlflow_status = {"finished": "FINISHED", "interrupted": "KILLED"}.get(status, "FAILED")
        self.client.set_terminated(self.run_id, status=mlflow_status)

    def close(self) -> None:
        self.scoped.close()


class TensorBoardTracker:
    """Event files under ``{run}/tensorboard``: ``tensorboard --logdir runs/`` shows every run."""

    name = "TensorBoard"

    def __init__(self, cfg: TrainConfig, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.directory = run_dir / TENSORBOARD_DIR
        self.writer_class = SummaryWriter
        self.writer = SummaryWriter(str(self.directory))
        self.writer.add_text("config", "\n".join(f"    {k} = {v!r}" for k, v in public_config(cfg).items()))

    def log(self, record: dict) -> None:
        if record.get("kind") == "start" and record["step"] > 0:
            # Restarted from a checkpoint at this step: steps after it are trained again, and
            # TensorBoard hides what was logged for them before (as metrics.jsonl drops it).
            self.writer.close()
            self.writer = self.writer_class(str(self.directory), purge_step=record["step"] + 1)
        for name, value in metrics_of(record).items():
            self.writer.add_scalar(name, value, record["step"], walltime=record.get("time"))

    def finish(self, status: str, best_checkpoint: Path | None) -> None:
        self.writer.close()

    def close(self) -> None:
        self.writer.close()
