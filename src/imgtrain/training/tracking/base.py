"""What every tracker shares: the ``Tracker`` interface, the tracked metric names and params,
and the config as it may leave the machine (tracking credentials removed; for trackers, paths of
this machine too)."""

from __future__ import annotations

import abc
import contextlib
import importlib
import json
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

from imgtrain.config import TrainConfig, by_name, settings
from imgtrain.ops import remote

STEP_KEYS = ("loss", "accuracy", "images_per_s", "data_wait_fraction", "lr", "grad_norm", "loss_scale")
EPOCH_KEYS = ("train_loss", "train_accuracy", "val_loss", "val_accuracy", "val_f1_macro", "images_per_s",
              "data_wait_fraction", "epoch_time_s", "val_map")  # val_map: multi-label runs only
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


# The settings that may hold a credential (``setting(secret=True)``: the MLflow URI's user:password@).
SECRET_SETTINGS = tuple(s.name for s in settings() if s.secret)


def public_config(cfg: TrainConfig) -> dict:
    """The config as it may be stored and shown: credentials removed from the settings that may hold one."""
    config = cfg.to_dict()
    return {**config, **{k: public_uri(config[k]) for k in SECRET_SETTINGS}}


# The settings that name a place (``setting(place=True)``): on this machine, a folder of the user's
# that no tracker is told (a tracking server is often shared, and W&B's is another company's).
PLACE_SETTINGS = tuple(s.name for s in settings() if s.place)


def public_place(place: str | None) -> str | None:
    """Where something is, as a tracker may be told it: an object store's URI as it is
    (credentials removed), a folder or file of this machine by its last name alone."""
    if not place or remote.is_remote(place):
        return public_uri(place)
    return Path(place).name or place


def tracked_config(config: dict) -> dict:
    """A config (``TrainConfig.to_dict()`` or a checkpoint's) as trackers get it: no credential,
    no path of this machine."""
    return {**config, **{k: public_uri(config.get(k)) for k in SECRET_SETTINGS},
            **{k: public_place(config[k]) for k in PLACE_SETTINGS if k in config}}


def params_of(cfg: TrainConfig, manifest: dict) -> dict:
    """A run's params, the same in every tracker: each config field (``tracked_config``) and the
    data set's name and sizes."""
    return {**tracked_config(cfg.to_dict()), "data_name": manifest.get("name", ""),
            "data_train_samples": manifest["splits"]["train"]["num_samples"],
            "data_test_samples": manifest["splits"]["test"]["num_samples"]}


@contextlib.contextmanager
def model_files(checkpoint: Path) -> Iterator[dict[str, Path]]:
    """The final model's files as trackers store them ({name: file}): ``model.pt`` as it is, and
    ``meta.json`` with its config as ``tracked_config`` says (a temporary copy, for the block)."""
    meta = json.loads((checkpoint / "meta.json").read_text())
    meta["config"] = tracked_config(meta.get("config") or {})
    with tempfile.TemporaryDirectory(prefix="imgtrain-tracked-") as folder:
        tracked_meta = Path(folder) / "meta.json"
        tracked_meta.write_text(json.dumps(meta, indent=2))
        yield {"model.pt": checkpoint / "model.pt", "meta.json": tracked_meta}


def first_line(error: BaseException) -> str:
    """``Type: first line of the message``, credentials scrubbed, short enough for one line."""
    return f"{type(error).__name__}: {scrub((str(error).strip().splitlines() or [''])[0])[:200]}"


class Tracker(abc.ABC):
    """One experiment tracker. Opening it (the constructor, ``cls(cfg, run_dir, manifest)``)
    starts its run, or continues the one a resumed imgtrain run logged to, and logs the params;
    it raises ImgtrainError when the tracker cannot be used. The driver then sends it every
    record (``log``), calls ``finish`` once with the run's outcome, and ``close`` whatever happened.
    A subclass declares what it is (the attributes below) and says how metrics, a restart, the final
    model and the outcome reach its backend; ``registry.register`` makes it one of the trackers."""

    key: str  # its name in the registry (``registry.py``): "mlflow"
    name: str  # in messages: "MLflow"
    settings: tuple[str, ...] = ()
    """The TrainConfig fields it reads, the one that turns it on first (their ``setting(...)``
    lines stay in config.py: TrainConfig is built, and crosses to the workers, without importing
    any tracker). A tracker with none is on for every run while it is registered."""
    secrets: tuple[str, ...] = ()
    """Those of its settings that may hold a credential (a password in a URI), from their own
    declaration (``setting(secret=True)``, ``__init_subclass__``): never written, shown or tracked
    as given (``public_config``, ``tracked_config``)."""
    extra: str = ""  # pip install 'imgtrain[EXTRA]'
    module: str = ""  # what the extra installs, imported to check it is there
    packages: tuple[str, ...] = ()  # its distributions, for `imgtrain doctor`
    flag: str | None = None  # the option that turns it on: its first setting's (``__init_subclass__``)
    opened: str | None = None  # once open: a line for the terminal, where to look at the run

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # "--mlflow", as config.py spells it; an unknown setting is refused by ``registry.register``
        declared = by_name()
        known = declared.get(cls.settings[0]) if cls.settings else None
        cls.flag = known.flag.split("/")[0] if known else None
        cls.secrets = tuple(name for name in cls.settings if name in declared and declared[name].secret)

    @classmethod
    def wanted(cls, cfg: TrainConfig) -> bool:
        return bool(getattr(cfg, cls.settings[0])) if cls.settings else True

    @classmethod
    def problem(cls, cfg: TrainConfig) -> str | None:
        """Why the tracker cannot be used, found in seconds, before Ray or the run start; None if it can."""
        if not cls.module:
            return None
        try:
            importlib.import_module(cls.module)
        except ImportError:
            return f"{cls.flag or 'tracking'} needs {cls.name}: pip install 'imgtrain[{cls.extra}]'"
        return None

    def log(self, record: dict) -> None:
        """One record of the run (metrics.jsonl's kinds): its metrics at its global step."""
        if record.get("kind") == "start" and record["step"] > 0:
            self.restarted(record["step"])
        values = metrics_of(record)
        if values:
            self.log_metrics(values, record["step"], record.get("time"))

    def finish(self, status: str, best_checkpoint: Path | None) -> None:
        """The run ended ``status`` (finished, failed, interrupted); a finished run's best checkpoint
        is its model."""
        if status == "finished" and best_checkpoint is not None:
            self.log_model(best_checkpoint)
        self.end(status)

    @abc.abstractmethod
    def log_metrics(self, values: dict[str, float], step: int, time: float | None) -> None:
        """``values`` (tracked names) at the global optimizer ``step``, measured at ``time`` (epoch seconds)."""

    def restarted(self, step: int) -> None:
        """A worker group restarted from a checkpoint at ``step``: the steps after it are trained again."""

    def log_model(self, checkpoint: Path) -> None:
        """The final model: ``model_files(checkpoint)``; the checkpoint named by its name alone."""

    def end(self, status: str) -> None:
        """The tracker's run ends with the imgtrain run's status."""

    def close(self) -> None:
        """Release what the tracker holds and put back what it changed in the process; called
        after ``finish``, and also when ``finish`` failed or never ran."""
