"""Weights & Biases (``--wandb PROJECT``): one W&B run per imgtrain run. A resumed run continues
its W&B run (its id is in ``wandb.json``); W&B's files go to ``{run}/wandb`` unless WANDB_DIR says
elsewhere, and WANDB_MODE=offline keeps everything there until ``wandb sync``."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

from imgtrain.config import TrainConfig
from imgtrain.errors import ImgtrainError
from imgtrain.ops import process
from imgtrain.training.tracking.base import Tracker, first_line, model_files, params_of
from imgtrain.training.tracking.registry import register

WANDB_RUN_FILE = "wandb.json"  # {"project", "entity", "run_id"}: a resumed run continues it
STEP_METRIC = "global_step"  # every metric's x axis: W&B's own _step only ever grows, ours restarts
EXIT_CODES = {"finished": 0, "interrupted": 255}  # W&B marks a run failed on any other; 255: Ctrl-C, as W&B's own
LOCAL_MODES = ("offline", "dryrun", "disabled")
# What W&B would collect about this machine besides what imgtrain gives it, off whatever the user's
# environment says: its metadata holds the driver's command line (an --mlflow password with it),
# the program's and Python's paths, the host and user names and the git remote; and the code and
# the git state. W&B's files go up to its server and, in the run folder, into the run's bucket.
PRIVATE = {"x_disable_meta": True, "x_disable_machine_info": True, "disable_git": True, "disable_code": True,
           "save_code": False}


@register
class WandbTracker(Tracker):
    """Params as the W&B run's config, metrics against ``global_step``, the final model as a
    ``model`` artifact, and the run's outcome as its exit code."""

    key, name = "wandb", "W&B"
    settings = ("wandb", "wandb_entity")  # the API key: W&B's own (WANDB_API_KEY, `wandb login`), never a setting
    extra, module, packages = "wandb", "wandb", ("wandb",)

    @classmethod
    def problem(cls, cfg: TrainConfig) -> str | None:
        """Missing, or logging to a server with no API key: without one, wandb.init would
        prompt on the terminal (under the progress display) or fail after Ray has started."""
        missing = super().problem(cfg)
        if missing:
            return missing
        try:
            if not _has_credentials():
                return ("--wandb logs to the W&B server and no API key was found: run `wandb login` or set "
                        "WANDB_API_KEY, or log offline with WANDB_MODE=offline and upload with `wandb sync` later")
        except Exception as e:  # a malformed key, a broken netrc
            return f"--wandb: {first_line(e)}"
        return None

    def __init__(self, cfg: TrainConfig, run_dir: Path, manifest: dict):
        import wandb

        self.run, self.ended = None, False
        # wandb.init hooks sys.exit and sys.excepthook for its runs' exit codes; this run's comes
        # from finish, and the process (a notebook's) gets its own hooks back at close. A service
        # process that this run started is stopped at close.
        self.scoped = contextlib.ExitStack()
        for name in ("exit", "excepthook"):
            self.scoped.enter_context(process.attribute(sys, name, getattr(sys, name)))
        if wandb.env.SERVICE not in os.environ:
            self.scoped.callback(_quietly, wandb.teardown)
        try:
            self.run = self._open_run(wandb, cfg, run_dir, manifest)
            self.run.define_metric(STEP_METRIC)
            self.run.define_metric("*", step_metric=STEP_METRIC)
        except Exception as e:
            self.close()
            raise ImgtrainError(f"cannot log to W&B project {cfg.wandb}: {first_line(e)}; check --wandb, "
                                "--wandb-entity and `wandb login` (or set WANDB_MODE=offline)") from None
        mode = self.run.settings.mode
        if mode == "offline":
            self.opened = f"W&B: logging offline to {self.run.settings.sync_dir} (`wandb sync` uploads it)"
        elif mode not in LOCAL_MODES:
            self.opened = f"W&B run: {self.run.url}"

    def _open_run(self, wandb, cfg: TrainConfig, run_dir: Path, manifest: dict):
        saved_path = run_dir / WANDB_RUN_FILE
        try:
            saved = json.loads(saved_path.read_text()) if saved_path.is_file() else {}
        except (OSError, ValueError):  # damaged: a new W&B run rather than no run at all
            saved = {}
        same = (saved.get("project"), saved.get("entity")) == (cfg.wandb, cfg.wandb_entity)
        # The console stays the progress display's and W&B prints nothing (`opened` says where
        # the run is), unless the user's WANDB_CONSOLE / WANDB_SILENT say otherwise.
        settings = {k: v for k, v, env in (("console", "off", "WANDB_CONSOLE"), ("silent", True, "WANDB_SILENT"))
                    if env not in os.environ}
        settings.update(PRIVATE)
        run = wandb.init(project=cfg.wandb, entity=cfg.wandb_entity, name=cfg.name, job_type="train",
                         id=saved.get("run_id") if same else None, resume="allow",
                         dir=None if "WANDB_DIR" in os.environ else str(run_dir),
                         config=params_of(cfg, manifest), settings=wandb.Settings(**settings), reinit="create_new")
        if not same or saved.get("run_id") != run.id:
            saved_path.write_text(json.dumps({"project": cfg.wandb, "entity": cfg.wandb_entity, "run_id": run.id},
                                              indent=2))
        return run

    def log_metrics(self, values: dict[str, float], step: int, time: float | None) -> None:
        # when it was measured: a record recovered from a checkpoint is logged long after
        self.run.log({**values, STEP_METRIC: step, **({"_timestamp": time} if time else {})})

    def log_model(self, checkpoint: Path) -> None:
        import wandb

        model = wandb.Artifact(f"model-{self.run.id}", type="model",
                               metadata={"imgtrain_run": self.run.name, "checkpoint": checkpoint.name})
        with model_files(checkpoint) as files:
            for name, file in files.items():
                model.add_file(str(file), name=name)  # copied into W&B's staging here
        self.run.log_artifact(model, aliases=["best", "latest"])
        self.run.summary["best_checkpoint"] = checkpoint.name

    def end(self, status: str) -> None:
        self.run.finish(exit_code=EXIT_CODES.get(status, 1))
        self.ended = True

    def close(self) -> None:
        try:
            if self.run is not None and not self.ended:  # finish failed or never ran
                with contextlib.suppress(Exception):
                    self.run.finish(exit_code=1)
        finally:
            self.scoped.close()


def _has_credentials() -> bool:
    """Whether W&B would log in without asking: offline, or a key (or identity token) where
    wandb.init looks for one. Read only: no server asked, nothing printed or saved (wandb.login
    asks the server who is logged in, and without a network its process then hangs at exit).
    Through W&B's internals: with another version's, no answer, and wandb.init says what is wrong."""
    try:
        from wandb.sdk.lib import wbauth
        from wandb.sdk.wandb_setup import singleton  # settings from the environment and settings files

        settings = singleton().settings
        if settings.mode in LOCAL_MODES:
            return True
        host = wbauth.HostUrl(settings.base_url, app_url=settings.app_url)
        found = wbauth.authenticate_session(host=host, source="imgtrain", prompt=False, update_session=False)
    except (ImportError, AttributeError, TypeError):
        return True
    return found is not None


def _quietly(action) -> None:
    # closing must not fail the run: the run's data is already written
    with contextlib.suppress(Exception):
        action()
