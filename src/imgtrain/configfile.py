"""Config files for ``imgtrain train --config run.toml``, and ``imgtrain config show``.

A config file is a flat TOML (or JSON) table of ``TrainConfig`` fields::

    data = "data/mnist-sample"
    name = "demo"
    workers = 2          # or "1-4" for an elastic run
    epochs = 12
    lr = 3e-3

Flags given on the command line override the file. Every problem in a file (TOML syntax, an
unknown field, a value of the wrong type) is collected, so one run of the command names them all.
A run's own ``config.json`` is a valid config file too: it reproduces that run.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import textwrap
import tomllib
from pathlib import Path

from imgtrain.config import ALIASES, TrainConfig, config_fields
from imgtrain.errors import ImgtrainError

# Field annotation (a string: the config module uses postponed annotations) -> accepted types.
# bool is a subclass of int, so it is excluded from the numeric ones explicitly.
_TYPES = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,), "str | None": (str,)}
_TYPE_NAMES = {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false",
               "str | None": "a string"}


def read_config_file(path: str | Path) -> tuple[dict, list[str]]:
    """(the valid values of the file, one message per problem). Raises only when the file
    cannot be read or parsed at all."""
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
    return check_values(raw)


def check_values(raw: dict) -> tuple[dict, list[str]]:
    """Normalise keys (``batch-size`` and flag names are accepted) and check each value's type."""
    fields = {f.name: f.type for f in dataclasses.fields(TrainConfig)}
    values, problems = {}, []
    for key, value in raw.items():
        name = ALIASES.get(key.replace("-", "_"), key.replace("-", "_"))
        if name not in fields:
            close = difflib.get_close_matches(name, [*fields, *ALIASES], n=1)
            problems.append(f"unknown field {key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        elif name == "workers" and isinstance(value, str):  # "MIN-MAX": an elastic run
            low, sep, high = value.partition("-")
            if sep and low.isdigit() and high.isdigit():
                values.update(min_workers=int(low), workers=int(high))
            else:
                problems.append(f"workers must be an integer or a range such as \"1-4\", got {value!r}")
        elif value is None and fields[name].endswith("None"):  # JSON null: the field's "not set"
            values[name] = None
        elif isinstance(value, bool) and fields[name] != "bool" or not isinstance(value, _TYPES[fields[name]]):
            problems.append(f"{name} must be {_TYPE_NAMES[fields[name]]}, got {value!r}")
        else:
            values[name] = float(value) if fields[name] == "float" else value
    return values, problems


# ---------------------------------------------------------------- imgtrain config show


def first_sentence(doc: str) -> str:
    """The one-line description of a field: its docstring up to the first full stop."""
    return re.split(r"(?<=\.)\s+(?=[A-Z`(])", doc.replace("``", ""), maxsplit=1)[0]


def describe_fields(values: dict | None = None) -> list[tuple[str, str, str]]:
    """(field, value as TOML writes it, one-line description) for every field; ``values``
    replaces the defaults (a run's resolved config)."""
    rows = []
    for name, default, doc in config_fields():
        value = (values or {}).get(name, default)
        rows.append((name, toml_value(value), first_sentence(doc)))
    return rows


def as_toml(values: dict | None = None) -> str:
    """Every field as a commented TOML file, ready to edit and pass to ``--config``. Fields
    that are unset (None) are written commented out: TOML has no null."""
    lines = ["# imgtrain train --config FILE; flags given on the command line override these values.", ""]
    for name, default, doc in config_fields():
        value = (values or {}).get(name, default)
        lines += ["# " + line for line in textwrap.wrap(doc.replace("``", ""), 96)]
        lines.append(f"# {name} = \"\"" if value is None else f"{name} = {toml_value(value)}")
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
