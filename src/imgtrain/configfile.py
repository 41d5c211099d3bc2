"""Config files for ``imgtrain train --config run.toml``, and ``imgtrain config show``.

A config file is a flat TOML (or JSON) table of ``TrainConfig`` fields::

    data = "data/mnist-sample"
    name = "demo"
    workers = 2          # or "1-4" for an elastic run
    epochs = 12
    lr = 3e-3

Flags given on the command line override the file. ``IMGTRAIN_CONFIG=FILE`` in the environment
names one more, beneath everything a run sets (``environment_settings``). Every problem in a file
(TOML syntax, an unknown field, a value of the wrong type) is collected, so one run of the command
names them all.
A run's own ``config.json`` is a valid config file too: it reproduces that run.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import textwrap
import tomllib
from pathlib import Path

from imgtrain.config import AUTO_PARSERS, Setting, TrainConfig, parse_workers, read_text, settings
from imgtrain.errors import ImgtrainError
from imgtrain.storage.runs import VERSION_KEYS

ENV_VAR = "IMGTRAIN_CONFIG"  # a config file every train of this process takes its unset settings from
_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def read_config_file(path: str | Path) -> tuple[dict, list[str]]:
    """(the valid values of the file, one message per problem). Raises only when the file
    cannot be read or parsed at all."""
    return check_values(read_table(path))


def environment_settings(cfg: TrainConfig) -> tuple[TrainConfig, list[str]]:
    """``cfg`` with the settings of the file ``IMGTRAIN_CONFIG`` names in the fields it leaves at
    their defaults (a flag, a ``--config`` file or Python code that sets a field keeps it), and
    the names of the fields taken; ``cfg`` itself without the variable. Every ``train`` reads
    it, the CLI's and Python's: a script or notebook runs as written with other settings (a
    smoke run: ``epochs = 1``), and a machine's defaults (``storage``, ``address``) live in one file."""
    path = os.environ.get(ENV_VAR)
    if not path:
        return cfg, []
    values, problems = read_config_file(path)
    if problems:
        raise ImgtrainError(f"{ENV_VAR}={path}: {'; '.join(problems)}")
    defaults = TrainConfig()
    taken = {k: v for k, v in values.items() if getattr(cfg, k) == getattr(defaults, k) != v}
    return dataclasses.replace(cfg, **taken), sorted(taken)


def read_table(path: str | Path) -> dict:
    """The file's table as parsed, unchecked (a sweep file has tables of its own too)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ImgtrainError(f"cannot read config file {path}: {e.strerror or e}") from None
    try:
        raw = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ImgtrainError(f"config file {path} is not valid {'JSON' if path.suffix == '.json' else 'TOML'}: {e}") from None
    if not isinstance(raw, dict):
        raise ImgtrainError(f"config file {path} must hold a table of fields, e.g. epochs = 12")
    return raw


def check_values(raw: dict) -> tuple[dict, list[str]]:
    """Normalise keys (``batch-size`` and flag names such as ``gpu`` are accepted) and check
    each value against its field's type."""
    known = {s.name: s for s in settings()}
    spelled = {alias: s for s in known.values() for alias in s.flag_names}
    values, problems = {}, []
    for key, value in raw.items():
        if key in VERSION_KEYS:  # a run's config.json records what wrote it: not a setting
            continue
        name = key.replace("-", "_")
        found = known.get(name) or spelled.get(name)
        if found is None:
            close = difflib.get_close_matches(name, [*known, *spelled], n=1)
            problems.append(f"unknown field {key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            continue
        try:
            values.update(_value(found, value))
        except (TypeError, ImgtrainError):
            elastic = found.name == "workers" and isinstance(value, str)
            problems.append(f"{found.name} must be {_TYPE_NAMES[found.type]}"
                            + (' or a range such as "1-4"' if elastic else "") + f", got {value!r}")
    return values, problems


def _value(s: Setting, value) -> dict:
    """{field: value} for one entry of a file; TypeError when the value has the wrong type."""
    if s.name == "workers" and isinstance(value, str):  # "MIN-MAX": an elastic run
        low, high = parse_workers(value)
        return {"min_workers": low, "workers": high}
    if s.name in AUTO_PARSERS and isinstance(value, str):  # "auto"
        return read_text({s.name: value})
    if value is None and s.optional:  # JSON null: the field's "not set"
        return {s.name: None}
    accepted = (int, float) if s.type is float else (s.type,)
    if isinstance(value, bool) and s.type is not bool or not isinstance(value, accepted):
        raise TypeError(s.name)
    return {s.name: float(value) if s.type is float else value}


# ---------------------------------------------------------------- imgtrain config show


def describe_fields(values: dict | None = None) -> list[tuple[str, str, str]]:
    """(field, value as TOML writes it, one-line description) for every field; ``values``
    replaces the defaults (a run's resolved config)."""
    return [(s.name, toml_value((values or {}).get(s.name, s.default)), s.summary) for s in settings()]


def as_toml(values: dict | None = None) -> str:
    """Every field as a commented TOML file, ready to edit and pass to ``--config``. Fields
    that are unset (None) are written commented out: TOML has no null."""
    lines = ["# imgtrain train --config FILE; flags given on the command line override these values.", ""]
    for s in settings():
        value = (values or {}).get(s.name, s.default)
        lines += ["# " + line for line in textwrap.wrap(s.doc.replace("``", ""), 96)]
        lines.append(f"# {s.name} = \"\"" if value is None else f"{s.name} = {toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def toml_value(value) -> str:
    if value is None:
        return "(unset)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a TOML basic string is a JSON string
