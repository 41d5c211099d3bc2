"""Every command's options come from one declaration (``settings.py``): each option of each
command is a declared field, its --help shows the declared help and default, cli.py repeats no
help text declared elsewhere, the Python functions' defaults are the declared ones, and the lists
of setting names other modules need are read from the settings' own metadata."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from imgtrain import cli
from imgtrain.settings import REQUIRED, STORAGE_HELP, settings_of

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "imgtrain"
DEFAULT = re.compile(r"\[default: (.*?)\]\s*$")


def commands(command=None, path=()):
    """(path, click command) of every command and subcommand, groups with a callback included."""
    command = command or typer.main.get_command(cli.app)
    yield path, command
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        yield from commands(sub, (*path, name))


def options(command):
    """The click options of a command that are its own (not --help)."""
    return [p for p in command.params if p.param_type_name == "option" and p.name != "help"]


def test_every_option_of_every_command_comes_from_a_declaration():
    undeclared = []
    for path, command in commands():
        declared = getattr(command.callback, "declared_options", {})
        for param in options(command):
            if path == () and param.name == "version":  # the program's --version: an eager callback, not an option
                continue
            if param.name not in declared:
                undeclared.append(f"imgtrain {' '.join(path)} {param.opts[0]}")
    assert not undeclared, f"options made in cli.py instead of declared: {undeclared}"
    assert len([p for p, c in commands() if getattr(c.callback, "declared_options", None)]) == 19


def help_rows(path) -> dict[str, str]:
    """The rows of ``imgtrain PATH --help``'s option table as a user sees them, by flag; one line
    each (a terminal wide enough that rich wraps none)."""
    shown = CliRunner().invoke(cli.app, [*path, "--help"], env={"COLUMNS": "3000"})
    assert shown.exit_code == 0, shown.output
    rows = {}
    for line in shown.output.splitlines():
        cells = line.strip("│ *").split()  # * marks a required option
        if cells and cells[0].startswith("-"):
            rows[cells[0]] = " ".join(cells)
    return rows


def expected_default(s, row: str) -> set:
    """What --help may show as the default of the declared field ``s``: the declared text, the
    value itself, nothing for an unset value (or "unset"), a flag's state for a switch."""
    if s.shown is not None:
        return {s.shown_default}
    if s.default is REQUIRED:
        return {None}
    if s.type is bool:
        names = s.flag.split("/") if "/" in s.flag else [s.flag, f"--no-{s.flag[2:]}"]
        return {None, names[0 if s.default else 1]} if not s.default else {names[0]}
    if s.default in (None, ""):
        return {None, "unset"}
    return {str(s.default)}


@pytest.mark.parametrize("path", [path for path, command in commands()
                                  if getattr(command.callback, "declared_options", None)], ids=" ".join)
def test_every_commands_help_shows_its_declared_help_and_default(path):
    command = dict(commands())[path]
    rows = help_rows(path)
    wrong = []
    for param in options(command):
        s = command.callback.declared_options[param.name]
        row = rows.get(s.flag.split("/")[0])
        if row is None:
            wrong.append(f"{s.flag}: not in --help")
            continue
        found = DEFAULT.search(row)
        shown = found.group(1) if found else None
        if shown not in expected_default(s, row):
            wrong.append(f"{s.flag}: --help says the default is {shown!r}, its declaration {s.default!r}")
        help_text = " ".join(s.help.split())
        if help_text[1:60] not in row:  # the first letter may follow a prefix ("parquet, hf: the image column")
            wrong.append(f"{s.flag}: --help does not show its declared help {help_text[:60]!r}: {row!r}")
    assert not wrong, f"imgtrain {' '.join(path)}: " + "; ".join(wrong)


def test_cli_py_holds_no_help_declared_elsewhere_and_makes_no_option_itself():
    tree = ast.parse((PACKAGE / "cli.py").read_text())
    texts = [" ".join(node.value.split()) for node in ast.walk(tree)
             if isinstance(node, ast.Constant) and isinstance(node.value, str)]
    elsewhere = {cls for _, command in commands() for cls in getattr(command.callback, "declared_classes", [])}
    assert {cls.__module__ for cls in elsewhere} >= {"imgtrain.config", "imgtrain.data.options",
                                                      "imgtrain.inference.options", "imgtrain.sweep.request",
                                                      "imgtrain.kuberay"}
    helps = {" ".join(s.help.split()) for cls in elsewhere for s in settings_of(cls)} | {STORAGE_HELP}
    repeated = sorted({h for h in helps for text in texts if len(h) > 20 and (h in text or text and text in h
                                                                               and len(text) > 20)})
    assert not repeated, f"cli.py repeats help declared elsewhere: {repeated}"
    # every typer option is made by _option() from a declaration; only --version is written out
    made = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute) and node.func.attr == "Option"]
    assert len(made) == 2, f"typer.Option( at cli.py lines {made}: declare the option instead"


# The Python functions behind the commands, and the declaration whose fields are their keywords.
API = [
    ("inference/batch.py", "evaluate", "EvaluateOptions"),
    ("inference/batch.py", "predict", "PredictOptions"),
    ("inference/export.py", "export", "ExportOptions"),
    ("inference/report.py", "write_report", "ReportOptions"),
    ("inference/serve.py", "run_server", "ServeOptions"),
    ("inference/calibrate.py", "calibrate", "CalibrateOptions"),
    ("data/inspection.py", "inspect_dataset", "InspectOptions"),
]


@pytest.mark.parametrize("module, function, declaration", API, ids=[f for _, f, _ in API])
def test_the_python_functions_take_each_declared_option_with_its_declared_default(module, function, declaration):
    """Read from the source (serve imports Ray Serve): every field is a parameter whose default
    is the field itself (``split: str = EvaluateOptions.split``), never a literal again."""
    from imgtrain.data import options as data_options
    from imgtrain.inference import options as inference_options

    cls = getattr(inference_options, declaration, None) or getattr(data_options, declaration)
    tree = ast.parse((PACKAGE / module).read_text())
    fn = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == function)
    args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
    defaults = dict(zip([a.arg for a in fn.args.posonlyargs + fn.args.args][-len(fn.args.defaults):],
                        fn.args.defaults)) if fn.args.defaults else {}
    defaults.update({a.arg: d for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults) if d is not None})
    for s in settings_of(cls):
        assert s.name in {a.arg for a in args}, f"{function}() takes no {s.name}, an option of its command"
        assert ast.unparse(defaults[s.name]) == f"{declaration}.{s.name}", (
            f"{function}({s.name}=...) defaults to {ast.unparse(defaults[s.name])}, not its declaration")


def test_prepare_takes_every_declared_option_by_its_name():
    import imgtrain
    from imgtrain.data.options import PrepareOptions

    with pytest.raises(imgtrain.ImgtrainError) as refused:
        imgtrain.prepare("mnist-sample", "unused", no_such_option=1)
    assert all(s.name in str(refused.value) for s in settings_of(PrepareOptions))


def test_the_lists_of_setting_names_come_from_each_settings_metadata():
    from imgtrain.config import TrainConfig, settings
    from imgtrain.inference.model_card import RECIPE_KEYS
    from imgtrain.sweep.request import RUN_ONLY, SWEEP_KEYS
    from imgtrain.training.tracking import base

    # as listed by hand before they were declared: the same names, the model card's rows in the same order
    assert RUN_ONLY == ("address", "dashboard", "stall_timeout_s", "mlflow", "mlflow_experiment", "tensorboard",
                        "wandb", "wandb_entity")
    assert RECIPE_KEYS == ("model", "pretrained", "epochs", "batch_size", "lr", "optimizer", "schedule",
                           "weight_decay", "label_smoothing", "preset", "augment_policy", "mixup", "cutmix", "ema_decay",
                           "average_last", "precision", "workers", "seed", "lr_source", "batch_source",
                           "distillation")
    assert base.PLACE_SETTINGS == ("data", "storage", "init_from", "teacher") and base.SECRET_SETTINGS == ("mlflow",)
    assert SWEEP_KEYS == {"trials": int, "scheduler": str, "metric": str, "mode": str, "max_concurrent": int}
    assert all(s.resumable for s in settings() if s.run_only)  # what a sweep may change, a run may too
    assert len({s.recipe for s in settings() if s.recipe}) == len(RECIPE_KEYS)  # one row each

    cfg = TrainConfig(name="n", data="/home/me/data/d", mlflow="http://me:PW@host:5000", init_from="/home/me/w.pt")
    tracked = base.tracked_config(base.public_config(cfg))
    assert tracked["mlflow"] == "http://host:5000" and "PW" not in str(tracked)
    assert (tracked["data"], tracked["init_from"]) == ("d", "w.pt")
