"""The command line: one function per verb, each a thin layer over the Python API.

Every option comes from a declaration (``settings.py``): the option dataclasses of the layer that
acts on it (``TrainConfig``, ``PrepareOptions``, ``InferenceOptions``, ``ServeOptions``...), or,
for the few only the command line has (``--json``, ``--yes``), an ``option(...)`` here.
``_declared`` turns them into typer's options; a command receives the dataclass filled in.

Every user error is printed as one line, ``error: ...``, with exit status 2; no traceback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import json
import os
import sys
import typing
import warnings
from pathlib import Path
from typing import Callable, Optional

import typer
from rich.table import Table

from imgtrain import kuberay
from imgtrain.config import LrFindOptions, TrainConfig, parse_workers, read_text, resolve, validate
from imgtrain.console import SafeConsole, err_console
from imgtrain.data.options import InspectOptions, PrepareOptions
from imgtrain.data.sources import registry as source_registry
from imgtrain.errors import ImgtrainError, ImgtrainWarning
from imgtrain.inference import export_formats
from imgtrain.inference.options import (
    CalibrateOptions,
    EvaluateOptions,
    ExportOptions,
    InferenceOptions,
    Limits,
    PredictOptions,
    ReportOptions,
    ServeOptions,
)
from imgtrain.settings import REQUIRED, RUNS, Setting, option, settings_of, storage_option, values
from imgtrain.sweep.request import SweepRequest

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Train image classifiers with data-parallel PyTorch on Ray.")
data_app = typer.Typer(no_args_is_help=True, help="Prepare and inspect data sets.")
runs_app = typer.Typer(no_args_is_help=True, help="Inspect runs.")
config_app = typer.Typer(no_args_is_help=True, help="Training settings: defaults and config files.")
clean_app = typer.Typer(no_args_is_help=True, help="Delete runs or prepared data sets (only what imgtrain made).")
for group, group_name in ((data_app, "data"), (runs_app, "runs"), (config_app, "config"), (clean_app, "clean")):
    app.add_typer(group, name=group_name)
# Messages hold paths and errors: never rich markup, never rich's colouring of numbers and paths.
console = SafeConsole(soft_wrap=True)  # as err_console: one line per line printed


# ---------------------------------------------------------------- options from declarations


@dataclasses.dataclass(frozen=True)
class _Fields:
    """How a command takes a dataclass's declared fields. skip: fields it has no option for;
    given: every option defaults to None (unset) and the command receives a dict of those given,
    to layer over a config file (``train``, ``tune``); prefix: the start of a field's help."""

    skip: frozenset = frozenset()
    given: bool = False
    prefix: Callable[[str], str] | None = None


def _declared(fn):
    """``fn``'s options from declarations: a parameter annotated with a dataclass of declared
    fields becomes one option per field and receives the dataclass filled in (or, with
    ``_Fields(given=True)``, a dict of the options given); a parameter whose default is a
    declared field (``option(...)``) becomes that option. Arguments and typer.Context stay as
    written. The declarations stay on the command (``declared_options``, ``declared_classes``) for
    tests/test_cli_declarations.py."""
    hints = typing.get_type_hints(fn)
    parameters, declared, groups = [], {}, {}
    for p in inspect.signature(fn).parameters.values():
        kind = hints.get(p.name, p.annotation)
        if dataclasses.is_dataclass(kind):
            how = p.default if isinstance(p.default, _Fields) else _Fields()
            groups[p.name] = (kind, how, [s for s in settings_of(kind) if s.cli and s.name not in how.skip])
            taken = [(s, how) for s in groups[p.name][2]]
        elif isinstance(p.default, dataclasses.Field):
            taken = [(Setting.of(p.name, kind, p.default), _Fields())]
        else:
            parameters.append(p.replace(kind=inspect.Parameter.KEYWORD_ONLY, annotation=kind))
            continue
        for s, how in taken:
            declared[s.name] = s
            parameters.append(_option(s, how))

    @functools.wraps(fn)
    def command(**values):
        for name, (kind, how, fields) in groups.items():
            taken = {s.name: _read(s, values.pop(s.name), how) for s in fields}
            values[name] = {k: v for k, v in taken.items() if v is not None} if how.given else kind(**taken)
        return fn(**{k: _read(declared[k], v, _Fields()) if k in declared else v for k, v in values.items()})

    command.__signature__ = inspect.Signature(parameters)
    command.__annotations__ = {p.name: p.annotation for p in parameters}
    command.declared_options = declared  # option name -> Setting
    command.declared_classes = [kind for kind, _, _ in groups.values()]
    return command


def _option(s: Setting, how: _Fields) -> inspect.Parameter:
    """The typer option of one declared field."""
    text = s.help
    if how.prefix and (start := how.prefix(s.name)):
        text = start + text[:1].lower() + text[1:]
    text = text.replace("[", "\\[")  # rich reads [...] as markup: 'imgtrain[timm]', '[search]'
    decls = [*s.flag.split("/"), *s.aliases]
    if how.given:  # None: not given; --help names the default the command falls back on
        default, annotation = None, Optional[str if s.parse else s.type]
        if s.type is bool:
            decls = [s.flag if "/" in s.flag else f"{s.flag}/--no-{s.flag[2:]}"]
            shown = decls[0].split("/")[0 if s.default else 1]
        else:
            shown = s.shown_default or ("unset" if s.default is None else "")
    else:
        default, shown = s.default, s.shown_default if s.shown is not None else ""
        annotation = Optional[str if s.parse else s.type] if s.optional else (str if s.parse else s.type)
    if shown:
        text += f" \\[default: {shown}]"
    option = typer.Option(default, *decls, help=text, metavar=s.metavar, show_default=how.given or not shown)
    return inspect.Parameter(s.name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation)


def _read(s: Setting, value, how: _Fields):
    """An option's value as its declaration takes it: text read by ``parse`` (``--size 64x64``),
    except where the command layers the text over a config file's (``--workers 1-4``)."""
    return s.parse(value) if s.parse and isinstance(value, str) and not how.given else value


JSON_OUT = option(False, "Print JSON.", flag="--json")
RUN_ARGUMENT = typer.Argument(..., help="Run name (in --storage), run directory or checkpoint directory.")


@contextlib.contextmanager
def _json_alone_on_stdout(json_out: bool):
    """With --json, stdout carries the JSON document alone (`| jq` must parse it): whatever else
    is printed while the command works goes to stderr. Ray's driver prints the raylet's warnings
    ("8 PYTHON worker processes have been started ...") on stdout from a thread of its own."""
    if not json_out:
        yield
        return
    with contextlib.redirect_stdout(sys.stderr):
        yield


def _print_version(asked: bool) -> None:
    if asked:
        from imgtrain import __version__

        console.print(f"imgtrain {__version__}")
        raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                          help="Print imgtrain's version and exit.")):
    """Train image classifiers with data-parallel PyTorch on Ray."""


def _prepare_help() -> str:
    """data prepare's help: what it does, then one line per registered source."""
    # \[: rich would read [val/] as markup and drop it
    return ("Convert a source into a prepared data set (manifest.json + train/ \\[val/] test/ Parquet), streamed."
            "\n\nSources:\n\n" + "\n".join(source_registry.help_lines()))


def _used_by(option: str) -> str:
    """The start of a source-specific option's help: the sources that use it ("parquet, list: ");
    "" for an option every source takes."""
    users = source_registry.using(option)
    return ", ".join(users) + ": " if users else ""


@data_app.command("prepare", help=_prepare_help())
@_declared
def data_prepare(
    source: str = typer.Argument(..., help=" | ".join(source_registry.SOURCES)),
    out_dir: Path = typer.Argument(..., help="Directory to write the prepared data set to."),
    source_path: Optional[str] = option(None, "What the source reads: a folder or a file (Sources, above); "
                                        "webdataset also s3://bucket/... (its shards are copied into "
                                        "IMGTRAIN_CACHE first).", flag="--source"),
    options: PrepareOptions = _Fields(prefix=_used_by),
):
    from imgtrain.data.format import describe
    from imgtrain.data.prepare import prepare
    from imgtrain.ops.remote import is_remote

    if source_path is not None and not is_remote(source_path):
        source_path = Path(source_path)  # s3://... stays text: a Path would make it s3:/...
    with _progress_bar("prepare") as progress:
        manifest = prepare(source, out_dir, source_path, options, progress=progress)
    skipped = manifest.get("skipped") or {}
    for name, why in skipped.get("files", []):
        err_console.print(f"skipped {name}: {why}")
    if skipped.get("count", 0) > len(skipped.get("files", [])):
        err_console.print(f"... and {skipped['count'] - len(skipped['files'])} more (not listed)")
    if manifest.get("dedupe"):
        d = manifest["dedupe"]
        err_console.print(f"dedupe {d['mode']}: dropped {d['dropped']:,} image(s) ({d['exact']:,} exact, {d['near']:,} "
                          f"near copies within {d['threshold']} bits), listed in {out_dir.resolve() / d['file']}")
    console.print(describe(manifest))
    console.print(f"prepared data set: {out_dir.resolve()}")


@contextlib.contextmanager
def _progress_bar(label: str):
    """A progress bar on stderr (none when stderr is not a terminal); yields progress(done, total)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                   console=err_console, transient=True, disable=not err_console.is_terminal)
    with bar:
        task = bar.add_task(label, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


@data_app.command("inspect")
@_declared
def data_inspect(
    data: str = typer.Argument(..., help="A prepared data set: a folder, or s3://... (copied to this machine first)."),
    options: InspectOptions = _Fields(),
    json_out: bool = option(False, "Print the findings as JSON on stdout (the page is written too).", flag="--json"),
):
    """A look at a prepared data set before training: classes and their balance, sizes, colour
    modes, samples per class, skipped files, and exact and near duplicates, across splits first.
    Writes a self-contained HTML page."""
    from imgtrain.data.inspection import inspect_dataset
    from imgtrain.data import staging

    with _json_alone_on_stdout(json_out), _progress_bar("inspect") as progress:
        result = inspect_dataset(staging.local_data(data), **values(options), progress=progress)
    if json_out:
        print(json.dumps(result, indent=2))
        return
    d = result["duplicates"]
    cross, within = d["counts"]["cross_split"], d["counts"]["within_split"]
    imb = result["imbalance"]
    ratio = "a class without training images" if imb["ratio"] is None else f"{imb['ratio']:.1f}x"
    console.print(f"{result['images']:,} images in {len(result['classes'])} classes; largest / smallest training "
                  f"class {ratio}{' (imbalanced)' if imb['flagged'] else ''}; duplicate pairs across splits "
                  f"{cross['exact']:,} exact, {cross['near']:,} near; within a split {within['exact']:,} exact, "
                  f"{within['near']:,} near")
    if result.get("multi_label"):
        ml = result["multi_label"]
        pairs = ", ".join(f"{p['a']}+{p['b']} {p['images']:,}" for p in ml["co_occurrence"][:5])
        console.print(f"multi-label: {ml['labels_per_image']} labels per image; images with 0, 1, 2, ... labels "
                      f"(train) {ml['label_set_sizes']['train']}; labels seen together most: {pairs or 'none'}")
    console.print(f"page: {result['page']}")


@app.command("train")
@_declared
def train_cmd(
    config: Optional[Path] = option(None, "TOML (or JSON) file of settings; flags given here override it. "
                                    "`imgtrain config show --toml` prints a template.", flag="--config"),
    overwrite: bool = option(False, "Replace an existing run NAME and start afresh (the old run is deleted once the "
                             "new one has a checkpoint).", flag="--overwrite"),
    quiet: bool = option(False, "No progress display.", flag="--quiet"),
    json_out: bool = option(False, "Print the finished run as JSON.", flag="--json"),
    given: TrainConfig = _Fields(given=True),
):
    """Train a model on a prepared data set with Ray Train, or resume the run NAME.

    Settings come from the defaults, then the stored config of the run being resumed, then --config FILE, then the
    flags given here.
    """
    import signal

    import imgtrain
    from imgtrain.configfile import read_config_file
    from imgtrain.ops import process
    from imgtrain.storage import location, ownership, runs
    from imgtrain.training.progress import TrainingDisplay

    overrides = dict(given)
    if "workers" in overrides:
        overrides["min_workers"], overrides["workers"] = parse_workers(overrides["workers"])
    overrides = read_text(overrides)  # --lr auto, --batch-size auto
    from_file, problems = read_config_file(config) if config else ({}, [])
    requested = {**from_file, **overrides}
    # A resumed run keeps its stored settings; an overwritten one starts from the defaults.
    run_name, run_storage = requested.get("name"), requested.get("storage", TrainConfig.storage)
    run_dir = location.fetch(run_storage, run_name, checkpoints=False) if run_name else None  # its config
    stored = runs.read_config(run_dir) if run_dir and not overwrite and ownership.is_run(run_dir) else None
    cfg = resolve(requested, stored)
    if problems:  # the file's problems and the resolved config's, in one message
        validate(cfg, [f"{config}: {p}" for p in problems])
    stop = process.Stop()  # a Ctrl-C before the block's handlers are in place is a plain SIGINT
    try:
        with process.stops_interrupt() as stop, _json_alone_on_stdout(json_out):
            result = imgtrain.train(cfg, display=TrainingDisplay(console, quiet=quiet or json_out), overwrite=overwrite)
    except KeyboardInterrupt:  # said here, with the run's own resume command; sys.exit: main() would say it again
        _train_interrupted(cfg, stop.signum or signal.SIGINT)
    if json_out:
        print(json.dumps(result.to_json(), indent=2))
        return
    console.print(_finished_line(result))
    console.print(f"run directory: {result.location or result.path}")
    for line in _selection_lines(result):
        console.print(line)
    if result.best_checkpoint:
        where = f"{result.location}/{result.best_checkpoint.name}" if result.location else result.best_checkpoint
        console.print(f"best checkpoint: {where}")


def _train_interrupted(cfg, signum: int) -> None:
    """Ctrl-C, a hangup or SIGTERM stopped `train` (the run is marked interrupted): one line saying
    how to resume it, then exit status 128 + the signal's number, as a shell reports a process the
    signal ended (130 for SIGINT, 129 for SIGHUP, 143 for SIGTERM). After a hangup the terminal may be gone:
    the line is then written where stderr still goes, or nowhere."""
    import shlex

    from imgtrain.storage import location, runs

    if runs.read_config(location.run_path(cfg.storage, cfg.name)) is not None:  # written as training starts
        where = "" if cfg.storage == TrainConfig.storage else f" --storage {shlex.quote(cfg.storage)}"
        line = f"interrupted: resume with imgtrain train --name {shlex.quote(cfg.name)}{where}"
    else:
        line = "interrupted before the run started; run the same command again to start it"
    with contextlib.suppress(OSError):
        err_console.print(line)
    sys.exit(128 + signum)


# the settings of a run's place and trackers: lr-find makes no run (--address stays: a --gpu test joins
# the cluster to run on a worker's GPU, training/on_worker.py)
_NOT_A_RUN = frozenset({"name", "storage", "dashboard", "mlflow", "mlflow_experiment", "tensorboard",
                        "wandb", "wandb_entity", "max_failures", "stall_timeout_s", "num_to_keep",
                        "checkpoint_every_steps", "ledger"})


@app.command("lr-find")
@_declared
def lr_find_cmd(
    config: Optional[Path] = option(None, "TOML (or JSON) file of training settings; flags given here override it.",
                                    flag="--config"),
    options: LrFindOptions = _Fields(),
    json_out: bool = option(False, "Print the curve's summary as JSON.", flag="--json"),
    given: TrainConfig = _Fields(given=True, skip=_NOT_A_RUN),
):
    """The learning-rate range test: train a copy of the model on the training split while the LR grows
    exponentially, plot the smoothed loss against it (OUT.png) and suggest the LR of its steepest descent
    before it diverges (`train --lr auto` runs it first)."""
    from imgtrain.configfile import read_config_file
    from imgtrain.training import lr_find

    overrides = dict(given)
    if "workers" in overrides:
        overrides["min_workers"], overrides["workers"] = parse_workers(overrides["workers"])
    overrides = read_text(overrides)
    from_file, problems = read_config_file(config) if config else ({}, [])
    cfg = resolve({**from_file, **overrides, "name": "lr-find"})
    if problems:
        validate(cfg, [f"{config}: {p}" for p in problems])
    with _json_alone_on_stdout(json_out):
        curve, tested, plot = lr_find.find(cfg, options)
    if json_out:
        print(json.dumps({**curve.to_json(), "batch_size": tested.batch_size, "plot": str(plot)}, indent=2))
        return
    console.print(f"suggested --lr {curve.suggestion:.2g} (steepest descent of the smoothed loss; "
                  f"{len(curve.lrs)} steps, {curve.stopped}; batch {tested.batch_size}, {tested.optimizer}; plot {plot})")


@runs_app.command("list")
@_declared
def runs_list(storage: str = storage_option(), json_out: bool = JSON_OUT):
    """List the runs in STORAGE."""
    from imgtrain.storage.runs import list_runs

    with _json_alone_on_stdout(json_out):
        found = list_runs(storage)
    if json_out:
        print(json.dumps([r.to_json() for r in found], indent=2))
        return
    if not found:
        console.print(f"no runs in {storage}")
        return
    table = Table("name", "status", "epochs", "best val acc", "last val acc", "path")
    for r in found:
        best = r.to_json()["best_val_accuracy"]
        table.add_row(
            r.name, r.status, f"{len(r.history)}/{r.config.get('epochs')}",
            f"{best:.2%}" if best is not None else "-",
            f"{r.final_accuracy:.2%}" if r.final_accuracy is not None else "-", r.location or str(r.path),
        )
    console.print(table)


@runs_app.command("show")
@_declared
def runs_show(name: str, storage: str = storage_option(), json_out: bool = JSON_OUT):
    """Show one run: status, per-epoch metrics, checkpoints."""
    from imgtrain.storage.runs import is_number, load_run
    from imgtrain.training.progress import epoch_line

    with _json_alone_on_stdout(json_out):
        r = load_run(storage, name)
    if json_out:
        print(json.dumps(r.to_json(), indent=2))
        return
    console.print(f"{r.name}  status: {r.status}  ({r.location or r.path})")
    if r.error:
        console.print(f"error: {r.error}")
    cfg = r.config
    console.print(
        f"data {cfg.get('data')}  backend {cfg.get('backend')}  ingest {cfg.get('ingest')}  "
        f"workers {cfg.get('workers')}  batch {cfg.get('batch_size')}  lr {cfg.get('lr')}")
    for rec in r.history:
        console.print(epoch_line(rec, cfg.get("epochs", 0)))
    last = r.history[-1] if r.history else {}
    steps, waits = last.get("rank_step_time_s"), last.get("rank_data_wait_s")
    if isinstance(steps, list) and isinstance(waits, list) and all(map(is_number, steps + waits)) and steps:
        per_rank = "; ".join(  # is any rank starved by data?
            f"rank {rank}: {step:.3f} s/step, {wait * 1000:.1f} ms waiting for data ({wait / max(step, 1e-9):.0%})"
            for rank, (step, wait) in enumerate(zip(steps, waits)))
        console.print(f"last epoch per rank: {per_rank}")
    for line in _selection_lines(r):
        console.print(line)
    console.print(f"best checkpoint:   {r.best_checkpoint}")
    console.print(f"latest checkpoint: {r.latest_checkpoint}")


def _finished_line(r) -> str:
    """train's last figure, named: the best checkpoint's epoch and accuracy, on the split it was chosen on."""
    from imgtrain.storage import runs

    best = r.best_record
    if not best or not runs.is_number(best.get("val_accuracy")) or not isinstance(best.get("epoch"), int):
        return f"finished {r.name}"
    which = "average checkpoint" if best.get("kind") == "average" else "best checkpoint"
    head = f"finished {r.name}: {which} epoch {best['epoch'] + 1}"
    # a multi-label run's figure is its mAP (its accuracy is the exact-match ratio, rarely the point)
    figure = f"mAP {best['val_map']:.4f}" if runs.is_number(best.get("val_map")) else \
        f"accuracy {best['val_accuracy']:.2%}"
    if best.get("val_split", "test") == "val":
        storage = r.config.get("storage")
        evaluate = f"imgtrain evaluate {r.name}" + (f" --storage {storage}" if storage not in (None, RUNS) else "")
        return f"{head}, validation {figure}; run `{evaluate}` for the test split"
    return f"{head}, {figure} on the test split that chose it (no val split): optimistic, not a test result"


def _selection_lines(r) -> list[str]:
    """What --early-stop and --average-last did, for `runs show` and `train`."""
    lines = []
    if stop := r.stopped_early:
        best = (f"best epoch {stop.best_epoch + 1} ({stop.metric} {stop.best:.4f})" if stop.best_epoch is not None
                else f"no epoch gave a {stop.metric}")
        lines.append(f"stopped early after epoch {stop.epoch + 1}: {stop.metric} did not improve for {stop.patience} "
                     f"epoch{'s' * (stop.patience > 1)}; {best}")
    if r.average:
        a = r.average
        listed = a.get("epochs") if isinstance(a.get("epochs"), list) else []  # metrics.jsonl is input like any file
        epochs = ", ".join(str(e + 1) for e in listed if isinstance(e, int))
        figures = "  ".join(f"{k} {a[k]:.4f}" for k in ("val_loss", "val_accuracy", "val_f1_macro") if k in a)
        lines.append(f"average of epochs {epochs}: {figures}  ({a.get('checkpoint')})")
    return lines


tune_app = typer.Typer(invoke_without_command=True, help="Hyperparameter sweeps with Ray Tune: every trial an "
                       "imgtrain run.")
app.add_typer(tune_app, name="tune")


@tune_app.callback()
@_declared
def tune_cmd(
    ctx: typer.Context,
    config: Optional[Path] = option(None, "TOML file: training settings at the top level, [search] NAME = "
                                    "\"FUNC(ARGS)\", [sweep] trials, scheduler, metric, mode, max_concurrent.",
                                    flag="--config"),
    search: Optional[list[str]] = option(None, "NAME=FUNC(ARGS), repeatable: uniform(a,b), loguniform(a,b), "
                                         "randint(a,b) (both included), choice(v1,v2,...), grid(v1,v2,...).",
                                         metavar="NAME=FUNC(ARGS)"),
    sweep: SweepRequest = _Fields(given=True),
    json_out: bool = option(False, "No progress lines; print the finished sweep as JSON.", flag="--json"),
    given: TrainConfig = _Fields(given=True),
):
    """Search training settings with Ray Tune; the same command again resumes an interrupted sweep.

    --name is the sweep's name: its trials are runs in STORAGE/NAME/trials/. `imgtrain tune show NAME` lists them.
    """
    if ctx.invoked_subcommand is not None:
        return
    from imgtrain.sweep.driver import request_from, tune

    overrides = dict(given)
    if "workers" in overrides:
        overrides["min_workers"], overrides["workers"] = parse_workers(overrides["workers"])
    overrides = read_text(overrides)  # --lr auto, --batch-size auto
    req = request_from(config, overrides, search or [], sweep)
    terminal = SafeConsole(file=sys.stdout)  # held: Ray's output goes to the logs
    try:
        with _json_alone_on_stdout(json_out):
            summary = tune(req, say=lambda line: None if json_out else terminal.print(line, soft_wrap=True))
    except KeyboardInterrupt:  # said here, with the sweep's own hint; sys.exit: main() would say it again
        err_console.print(f"interrupted; run the same command again to resume the sweep (`imgtrain tune show "
                          f"{req.base.name}` lists its trials)")
        sys.exit(130)
    if json_out:
        print(json.dumps(summary, indent=2))
    else:
        _print_sweep(summary)
    if all(t["status"] == "failed" for t in summary["trials"]):
        err_console.print(f"error: every trial of sweep {req.base.name!r} failed (errors in `imgtrain tune show "
                          f"{req.base.name}` and {summary['path']}/logs)")
        raise typer.Exit(1)


@tune_app.command("show")
@_declared
def tune_show(name: str, storage: str = storage_option(), json_out: bool = JSON_OUT):
    """A sweep's trials (searched values, status, epochs, best metric) and its best trial."""
    from imgtrain.sweep.state import summary

    with _json_alone_on_stdout(json_out):
        found = summary(storage, name)
    if json_out:
        print(json.dumps(found, indent=2))
        return
    _print_sweep(found)


def _print_sweep(s: dict) -> None:
    from imgtrain.sweep.reporter import format_params

    console.print(f"sweep {s['name']}  status: {s['status']}  ({s['path']})")
    names = list(s["search"])
    table = Table("trial", *names, "status", "epochs", f"best {s['metric']}")
    for t in s["trials"]:
        value = t["best_metric"]
        table.add_row(t["name"], *[format_params({n: t["params"].get(n, "-")}).split("=", 1)[1] for n in names],
                      t["status"], f"{t['epochs_done']}/{t['epochs']}", f"{value:.4f}" if value is not None else "-")
    console.print(table)
    for t in s["trials"]:
        if t["error"] and t["status"] == "failed":
            console.print(f"{t['name']} failed: {t['error']}")
    best = s["best"]
    if best:
        console.print(f"best trial: {best['name']}  {s['metric']} {best['best_metric']:.4f} at epoch "
                      f"{best['best_epoch']}  {format_params(best['params'])}")
        console.print(f"best checkpoint: {best['checkpoint']}")
        console.print(f"its run: imgtrain runs show {best['name']} --storage {s['trials_storage']}")


@config_app.command("show")
@_declared
def config_show(
    run: Optional[str] = option(None, "Show this run's resolved config instead of the defaults.", flag="--run"),
    storage: str = storage_option(),
    toml: bool = option(False, "Print a commented TOML file, ready for --config.", flag="--toml"),
):
    """Every training setting with its default (or a run's value) and a one-line description."""
    from imgtrain.configfile import as_toml, describe_fields
    from imgtrain.storage.runs import load_run

    values = load_run(storage, run).config if run else None
    if toml:
        print(as_toml(values))
        return
    rows = [("field", "value" if run else "default", "description"), *describe_fields(values)]
    width = max(len(value) for _, value, _ in rows)
    for field, value, description in rows:  # one line each: easy to grep, wrapped by the terminal
        console.print(f"{field:<22} {value:<{width}}  {description}")


@app.command("evaluate")
@_declared
def evaluate_cmd(run: str = RUN_ARGUMENT, *, options: EvaluateOptions,
                 inference: InferenceOptions = _Fields(skip=frozenset({"top_k"})), json_out: bool = JSON_OUT):
    """Accuracy, top-5 accuracy, per-class and averaged precision/recall/F1, calibration (ECE) and
    confusion matrix of a checkpoint."""
    from imgtrain.inference.batch import evaluate

    with _json_alone_on_stdout(json_out):
        result = evaluate(run, **values(options), options=inference)
    if json_out:
        print(json.dumps(result.to_json(), indent=2))
        return
    console.print(f"checkpoint {result.checkpoint}")
    if getattr(result, "multi_label", False):
        from imgtrain.inference.multilabel_eval import summary_lines

        for line in summary_lines(result):
            console.print(line)
        return
    recorded = result.recorded_val_accuracy
    on = "" if result.recorded_split == result.split else f" on the {result.recorded_split} split"
    console.print(
        f"{result.split} accuracy {result.accuracy:.2%} on {result.num_samples} samples"
        + (f" (recorded in training{on}: {recorded:.2%})" if recorded is not None else "")
        + (" with --tta flip" if result.tta == "flip" else ""),
    )
    top5 = result.top5_accuracy
    console.print(f"top-5 accuracy {top5:.2%}" if top5 is not None else
                  f"top-5 accuracy n/a ({len(result.classes)} classes: it needs 6 or more)")
    console.print(f"expected calibration error {result.ece:.4f} (15 equal-width confidence bins)")
    console.print(result.calibration_line())
    if result.ood is not None:
        console.print(result.ood_line())
    table = Table("class", "precision", "recall", "f1", "support")
    for name, s in result.per_class.items():
        table.add_row(name, f"{s['precision']:.3f}", f"{s['recall']:.3f}", f"{s['f1']:.3f}", str(s["support"]))
    table.add_section()
    for name, s in (("macro avg", result.macro_avg), ("weighted avg", result.weighted_avg)):
        table.add_row(name, f"{s['precision']:.3f}", f"{s['recall']:.3f}", f"{s['f1']:.3f}", str(result.num_samples))
    console.print(table)
    console.print(_confusion_table(result))
    if result.label_issues is not None:
        console.print(_label_issues_table(result))


def _label_issues_table(result) -> Table:
    found = result.label_issues
    table = Table("id", "labelled", "model says", "p(label)", "p(model's class)",
                  title=f"labels worth a second look ({found['scanned']:,} of {found['of']:,} training images scanned)")
    for x in found["issues"]:
        table.add_row(str(x["id"]), result.classes[x["label"]], result.classes[x["predicted"]],
                      f"{x['label_prob']:.3f}", f"{x['predicted_prob']:.3f}")
    return table


CONFUSION_TABLE_MAX_CLASSES = 20  # wider, a terminal's matrix is unreadable: the most confused pairs instead


def _confusion_table(result) -> Table:
    """The confusion matrix for a few classes; for more, the 20 commonest mistakes."""
    if len(result.classes) <= CONFUSION_TABLE_MAX_CLASSES:
        from imgtrain.inference.batch import dense_confusion

        cm = Table("true \\ pred", *result.classes, title="confusion matrix")
        for name, row in zip(result.classes, dense_confusion(result.confusion, len(result.classes))):
            cm.add_row(name, *(str(v) for v in row))
        return cm
    mistakes = sorted((row for row in result.confusion.tolist() if row[0] != row[1]), key=lambda r: -r[2])[:20]
    table = Table("true", "predicted", "count", title=f"most confused pairs (of {len(result.classes)} classes)")
    for true, predicted, count in mistakes:
        table.add_row(result.classes[true], result.classes[predicted], str(count))
    return table


@app.command("predict")
@_declared
def predict_cmd(
    run: str = RUN_ARGUMENT,
    input: str = typer.Argument(..., help="Prepared data set, Parquet file, image folder, glob or one image."),
    out: Path = option(REQUIRED, "Output file: .parquet or .csv.", flag="--out"),
    *, options: PredictOptions, inference: InferenceOptions,
):
    """Predict classes for images; images of another size or colour mode are converted."""
    from imgtrain.inference.batch import predict

    result = predict(run, input, out, **values(options), options=inference)
    err = err_console
    for name, why in result.skipped:
        err.print(f"skipped {name}: {why}")
    summary = f"wrote {result.num_predictions} predictions to {result.out}"
    if result.converted:
        summary += f" ({result.converted} image(s) converted to {result.image_shape_text})"
    if result.skipped:
        summary += f"; skipped {len(result.skipped)} unreadable file(s)"
    if result.threshold is not None:
        summary += (f"; {result.rejected} answered unknown (their {result.ood_score} score under "
                    f"{result.threshold:.4g})")
    if options.explain is not None:
        summary += f"; where the model looked (overlay .png and map .npy per image) in {options.explain}"
    console.print(summary)


@app.command("calibrate")
@_declared
def calibrate_cmd(run: str = RUN_ARGUMENT, *, options: CalibrateOptions, json_out: bool = JSON_OUT):
    """Fit a checkpoint's temperature scaling and its out-of-distribution thresholds (--reject auto) on
    the validation split, and store them with it. Training does this at its end; this is for older runs."""
    from imgtrain.inference.calibrate import calibrate

    with _json_alone_on_stdout(json_out):
        result = calibrate(run, **values(options))
    if json_out:
        print(json.dumps(result.to_json(), indent=2))
        return
    console.print(f"checkpoint {result.checkpoint}: {result.calibration.line()}")


@app.command("export")
@_declared
def export_cmd(
    run: str = RUN_ARGUMENT,
    out: Path = option(REQUIRED, "Folder to write the model, labels, preprocessing and model card into.", flag="--out"),
    format: str = option("onnx", export_formats.help_text() + ".", flag="--format"),
    *, options: ExportOptions, json_out: bool = JSON_OUT,
):
    """Export a checkpoint's model (preprocessing and softmax inside, dynamic batch) with a model
    card, verified against PyTorch on the test split before it is written."""
    from imgtrain.inference.export import export

    with _json_alone_on_stdout(json_out):
        result = export(run, format, out, **values(options))
    if json_out:
        print(json.dumps(result.to_json(), indent=2))
        return
    console.print(result.verification.line())
    int8 = result.test_metrics.get("int8")
    if int8:
        console.print(f"int8: {result.verification.split} accuracy {int8['accuracy']:.2%} against "
                      f"{int8['fp32_accuracy']:.2%} in float32 (drop {int8['accuracy_drop']:.2%}, at most "
                      f"{int8['max_accuracy_drop']:.2%} allowed)")
    multi = result.test_metrics.get("multi_label")
    figure = f"mAP {result.test_metrics['map']:.4f}" if multi else f"accuracy {result.test_metrics.get('accuracy', 0):.2%}"
    accuracy = "" if int8 else f"{result.verification.split} {figure}; "
    console.print(f"{accuracy}wrote {'the int8 model ' if int8 else ''}{result.model_file} with labels.json, "
                  f"{'thresholds.json, ' if multi else ''}preprocessing.json and MODEL_CARD.md")


@app.command("report")
@_declared
def report_cmd(run: str = typer.Argument(..., help="Run name (in --storage) or run directory."), *,
               options: ReportOptions):
    """Write the run's plots and one self-contained HTML page into its report/ folder."""
    from imgtrain.inference.report import EVAL_FILE, write_report

    page = write_report(run, **values(options))
    figures = json.loads((page.parent / EVAL_FILE).read_text())  # what the page shows: the split's own figure
    figure = f"mAP {figures['map']:.4f}" if figures.get("multi_label") else f"accuracy {figures['accuracy']:.2%}"
    console.print(f"{figures['split']} {figure} on {figures['num_samples']:,} images, "
                  f"{Path(figures['checkpoint']).name}")
    console.print(f"report: {page}")


@app.command("serve")
@_declared
def serve_cmd(run: str = RUN_ARGUMENT, *, options: ServeOptions, limits: Limits):
    """Serve the model over HTTP with Ray Serve: POST /predict, POST /explain, GET /healthz. Ctrl-C stops it."""
    from imgtrain.inference.serve import run_server

    run_server(run, **values(options), limits=limits, announce=lambda line: console.print(line))


YES = option(False, "Delete without asking.", flag="--yes", aliases=("-y",))
DRY_RUN = option(False, "Only list what would be deleted.", flag="--dry-run")


@clean_app.command("runs")
@_declared
def clean_runs(
    names: Optional[list[str]] = typer.Argument(None, help="Runs to delete."),
    all_runs: bool = option(False, "Every run in --storage.", flag="--all"),
    storage: str = storage_option(),
    yes: bool = YES, dry_run: bool = DRY_RUN,
    force: bool = option(False, "Also delete runs recorded as being trained on another host whose driver is gone (a "
                         "run locked on this machine is never deleted).", flag="--force"),
):
    """Delete runs: their checkpoints, metrics, logs and reports. Never a run being trained."""
    from imgtrain.commands.clean import plan_runs

    _clean(plan_runs(storage, names or [], everything=all_runs, force=force), yes, dry_run)


@clean_app.command("data")
@_declared
def clean_data(
    data_dirs: list[Path] = typer.Argument(..., help="Prepared data set directories."),
    yes: bool = YES, dry_run: bool = DRY_RUN,
):
    """Delete prepared data sets: the manifest and the Parquet files it lists, nothing else."""
    from imgtrain.commands.clean import plan_dataset

    _clean([plan_dataset(d) for d in data_dirs], yes, dry_run)


def _clean(plan, yes: bool, dry_run: bool) -> None:
    from imgtrain.commands.clean import remove

    if not plan:
        console.print("nothing to delete")
        return
    for removal in plan:
        console.print(("would delete " if dry_run else "") + removal.describe())
    if dry_run:
        return
    total = sum(r.size for r in plan) / 2**20
    if not yes:
        try:
            agreed = typer.confirm(f"delete these {len(plan)} item(s), {total:,.1f} MiB?", default=False)
        except typer.Abort:  # end of input (a script, CI): never a yes
            raise ImgtrainError("no answer to the confirmation; nothing deleted (pass --yes to delete without asking)") from None
        if not agreed:
            console.print("nothing deleted")
            raise typer.Exit(1)
    for removal in plan:
        remove(removal)
        console.print(f"deleted {removal.path}")
        for kept in removal.kept:
            console.print(f"  kept {kept} (not written by imgtrain)")


@app.command("doctor")
@_declared
def doctor_cmd(
    storage: str = storage_option(),
    address: Optional[str] = option(None, "Check this Ray cluster (default: RAY_ADDRESS, or one running here)."),
    data: Optional[str] = option(None, "Also check this prepared data set (a folder or s3://...), and that every "
                                 "node reads it."),
    json_out: bool = JSON_OUT,
):
    """Versions, CUDA, the Ray cluster's resources, whether storage is writable and shared: a verdict.

    Exits 0 when ready to train, 1 when something needs fixing first.
    """
    from imgtrain.commands.doctor import diagnose

    with _json_alone_on_stdout(json_out):
        found = diagnose(storage=storage, address=address, data=data)
    if json_out:
        print(json.dumps(found.to_json(), indent=2))
    else:
        for check in found.checks:
            console.print(f"{check.status:<5} {check.name}: {check.detail}")
            for line in check.lines:
                console.print(f"        {line}")
        console.print(f"verdict: {found.verdict}")
    if not found.ready:
        raise typer.Exit(1)


cluster_app = typer.Typer(no_args_is_help=True, help="Run imgtrain on Kubernetes: manifests for KubeRay.")
app.add_typer(cluster_app, name="cluster")


@cluster_app.command("manifest")
@_declared
def cluster_manifest(
    command: Optional[list[str]] = typer.Argument(None, metavar="-- COMMAND", help=(
        "The imgtrain command the cluster runs, after --, e.g. -- train --data s3://b/data --storage s3://b/runs "
        "--name big --workers 4 (`--address auto` is added). Required for a RayJob.")),
    spec: kuberay.Spec = _Fields(),
    out: Optional[Path] = option(None, "Write the manifest to this file", shown="stdout"),
):
    """Write a KubeRay manifest (YAML) that runs an imgtrain command on Kubernetes.

    --kind rayjob (the default): `kubectl apply -f` it and the command runs on a cluster made for it.

    --kind raycluster: a cluster alone; submit commands to it with `ray job submit` (the manifest's comments say how).

    The command is checked first: it must parse, keep its runs where every pod sees them, and fit the pods.
    """
    parsed = kuberay.parse_command(typer.main.get_command(app), command) if command else None
    spec = spec.completed(parsed)
    kuberay.check(spec, parsed)
    text = kuberay.to_yaml(spec, parsed)
    if out is None:
        sys.stdout.write(text)  # the YAML alone: rich would wrap it and read [..] as markup
        return
    from imgtrain.ops.files import atomic_write_text

    if out.is_dir() or not out.parent.is_dir():
        raise ImgtrainError(f"--out {out}: name a file in a folder that exists")
    atomic_write_text(out, text)
    err_console.print(f"wrote {out}: kubectl apply -f {out}")


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """imgtrain's own warnings as one line each; any other as Python shows it."""
    if issubclass(category, ImgtrainWarning):
        err_console.print(f"warning: {message}")
    else:
        _python_show_warning(message, category, filename, lineno, file, line)


_python_show_warning = warnings.showwarning


def _usage_error(e) -> Optional[str]:
    """click's usage error as one line (its usage lines said nothing the message does not), with
    the closest option for a typo; None for the help a group named alone shows. By attribute:
    typer's copy of click is private (typer._click)."""
    if type(e).__name__ == "NoArgsIsHelpError":
        return None
    offered = getattr(e, "possibilities", None)  # an unknown option: difflib's closest match first
    message = getattr(e, "message", "") if offered else getattr(e, "format_message", lambda: str(e))()
    message = " ".join(str(message).split()).rstrip(".")
    message = message[:1].lower() + message[1:]  # "No such option: --epoch" -> "no such option: ..."
    if offered:
        message += f"; did you mean {offered[0]}?"
    ctx = getattr(e, "ctx", None)
    return message + (f" (see {ctx.command_path} --help)" if ctx is not None else "")


def main() -> None:
    warnings.showwarning = _show_warning  # the CLI's process only: the library leaves it alone
    warnings.simplefilter("always", ImgtrainWarning)
    try:
        code = app(standalone_mode=False)  # a command's typer.Exit(N) comes back as N
        if code == 130:  # typer turns Ctrl-C (KeyboardInterrupt) into a silent Exit(130)
            raise KeyboardInterrupt
        if isinstance(code, int) and code:
            sys.exit(code)
    except ImgtrainError as e:
        err_console.print(f"error: {e}")
        sys.exit(2)
    except (KeyboardInterrupt, typer.Abort):
        err_console.print("interrupted; run the same command again to resume")
        sys.exit(130)
    except typer.TyperException as e:  # unknown options, missing arguments: one line, as any user error
        line = _usage_error(e)
        if line is None:  # a group named alone: its help, as no_args_is_help means
            e.show()
        else:
            err_console.print(f"error: {line}")
        sys.exit(getattr(e, "exit_code", 2))
    except Exception as e:  # a bug or an environment failure: one line, the traceback on request
        if os.environ.get("IMGTRAIN_DEBUG"):
            raise
        first = (str(e).strip().splitlines() or [""])[0][:300]
        err_console.print(
            f"error: unexpected {type(e).__name__}: {first} "
            "(run logs are in the run's logs/ folder; IMGTRAIN_DEBUG=1 shows the traceback)")
        sys.exit(1)


if __name__ == "__main__":
    main()
