"""The search space: ``NAME=FUNC(ARGS)`` expressions parsed by a small grammar (never ``eval``).

    uniform(a, b)       a float drawn uniformly from [a, b]
    loguniform(a, b)    a float whose logarithm is uniform: 0 < a < b
    randint(a, b)       an integer from a to b, both included (as Python's random.randint)
    choice(v1, v2, ...) one of the values, drawn at random for each trial
    grid(v1, v2, ...)   every value, each in its own trial (times --trials)

NAME is a training setting (``lr``, ``weight-decay``, ``optimizer``...); each value is checked
against the setting's type, choices and range before anything starts.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from imgtrain.config import Setting, range_problem, settings
from imgtrain.errors import ImgtrainError

FUNCTIONS = ("uniform", "loguniform", "randint", "choice", "grid")
# The sweep's schedulers and the metrics it may optimise (with their direction): here, beside the
# grammar, so that the CLI's help names them without importing Ray Tune (the driver does).
SCHEDULERS = ("asha", "fifo")
METRICS = {"val_accuracy": "max", "val_loss": "min", "val_f1_macro": "max", "train_accuracy": "max",
           "train_loss": "min"}
# Settings a sweep cannot vary: where the data and runs are, the trial's name, the backend
# (a trial's resources are planned for Ray workers), and what may change on resume anyway
# (resumable settings: workers, epochs, storage... operational, not part of the experiment).
FIXED = {"data", "name", "backend", "init_from"}
_EXPR = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_-]*)\s*=\s*([a-z]+)\s*\((.*)\)\s*$", re.DOTALL)


@dataclass(frozen=True)
class Dimension:
    """One searched setting: ``name`` (the field), ``func`` and its checked ``args``."""

    name: str
    func: str
    args: tuple

    def text(self) -> str:
        return f"{self.func}({', '.join(map(_show, self.args))})"

    def domain(self):
        """The Ray Tune search domain of this dimension."""
        from ray import tune

        a = self.args
        if self.func == "uniform":
            return tune.uniform(a[0], a[1])
        if self.func == "loguniform":
            return tune.loguniform(a[0], a[1])
        if self.func == "randint":
            return tune.randint(a[0], a[1] + 1)  # Tune's upper bound is exclusive
        if self.func == "choice":
            return tune.choice(list(a))
        return tune.grid_search(list(a))


def searchable() -> dict[str, Setting]:
    return {s.name: s for s in settings() if not s.resumable and s.name not in FIXED}


def parse(expression: str) -> Dimension:
    """``'lr=loguniform(1e-4,1e-2)'`` -> Dimension; ImgtrainError naming what is wrong."""
    m = _EXPR.match(expression)
    if not m:
        raise ImgtrainError(f"--search {expression!r} is not NAME=FUNC(ARGS), e.g. 'lr=loguniform(1e-4,1e-2)'")
    field, func, body = m.group(1).replace("-", "_"), m.group(2), m.group(3)
    return make(field, func, _split(body, expression), expression)


def make(field: str, func: str, raw_args: list[str], expression: str) -> Dimension:
    """Check one dimension: the setting exists and may be searched, the function is known, the
    arguments fit the function and the setting."""
    where = f"--search {expression!r}"
    known = searchable()
    if field not in known:
        every = {s.name for s in settings()}
        why = ("is not searched: it stays the same for every trial" if field in every
               else "is not a training setting (see `imgtrain config show`)")
        raise ImgtrainError(f"{where}: {field!r} {why}; searchable: {', '.join(sorted(known))}")
    s = known[field]
    if func not in FUNCTIONS:
        raise ImgtrainError(f"{where}: unknown function {func!r}; use one of {', '.join(FUNCTIONS)}")
    values = tuple(_value(s, text, where) for text in raw_args)
    if func in ("choice", "grid"):
        if not values:
            raise ImgtrainError(f"{where}: {func}() needs at least one value")
        if len(set(values)) != len(values):
            raise ImgtrainError(f"{where}: {func}() lists a value twice")
    else:
        if len(values) != 2:
            raise ImgtrainError(f"{where}: {func}() takes two bounds, got {len(values)}")
        wanted = int if func == "randint" else float
        if s.type is not wanted:
            raise ImgtrainError(f"{where}: {field} is {'an integer' if s.type is int else s.type.__name__} "
                                f"setting; {func}() is for {'integer' if wanted is int else 'float'} settings, "
                                f"use {'randint' if s.type is int else 'choice'}(...)")
        lo, hi = values
        if not lo < hi:
            raise ImgtrainError(f"{where}: the lower bound must be below the upper one")
        if func == "loguniform" and lo <= 0:
            raise ImgtrainError(f"{where}: loguniform() needs bounds above 0")
    for v in values:
        problem = s.range and not isinstance(v, bool) and range_problem(field, v, s.range)
        if problem:
            raise ImgtrainError(f"{where}: {problem}")
        if s.choices and v not in s.choices:
            raise ImgtrainError(f"{where}: {v!r} is not one of {', '.join(s.choices)}")
    return Dimension(field, func, values)


def parse_all(expressions: list[str]) -> dict[str, Dimension]:
    found: dict[str, Dimension] = {}
    for text in expressions:
        d = parse(text)
        if d.name in found:
            raise ImgtrainError(f"--search {text!r}: {d.name} is searched twice")
        found[d.name] = d
    return found


def from_table(table: dict, source: str) -> dict[str, Dimension]:
    """A config file's ``[search]`` table: ``lr = "loguniform(1e-4, 1e-2)"`` or, for a choice,
    a TOML list ``weight_decay = [0.01, 0.05]``."""
    if not isinstance(table, dict):
        raise ImgtrainError(f"{source}: [search] must be a table, e.g. lr = \"loguniform(1e-4, 1e-2)\"")
    found = {}
    for key, value in table.items():
        if isinstance(value, list):
            d = make(key.replace("-", "_"), "choice", [_show(v) for v in value], f"{key} = {value}")
        elif isinstance(value, str):
            d = parse(f"{key}={value}")
        else:
            raise ImgtrainError(f"{source}: search {key} must be a string such as \"uniform(0, 0.1)\" or a list")
        found[d.name] = d
    return found


def _split(body: str, expression: str) -> list[str]:
    """The comma-separated arguments; quoted strings may hold commas."""
    args, current, quote = [], "", None
    for ch in body:
        if quote:
            current += ch
            quote = None if ch == quote else quote
        elif ch in "'\"":
            current += ch
            quote = ch
        elif ch == ",":
            args.append(current)
            current = ""
        elif ch in "()":
            raise ImgtrainError(f"--search {expression!r}: arguments are plain values, not expressions")
        else:
            current += ch
    if quote:
        raise ImgtrainError(f"--search {expression!r}: a quote is not closed")
    args.append(current)
    args = [a.strip() for a in args]
    if args == [""]:
        return []
    if "" in args:
        raise ImgtrainError(f"--search {expression!r}: an argument is empty")
    return args


def _value(s: Setting, text: str, where: str):
    """One argument as the setting's type."""
    bare = text[1:-1] if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"" else text
    try:
        if s.type is bool:
            if bare.lower() not in ("true", "false"):
                raise ValueError
            return bare.lower() == "true"
        if s.type is int:
            value = float(bare)
            if not value.is_integer():
                raise ValueError
            return int(value)
        if s.type is float:
            value = float(bare)
            if not math.isfinite(value):
                raise ValueError
            return value
        return bare
    except ValueError:
        kind = {bool: "true or false", int: "an integer", float: "a finite number"}[s.type]
        raise ImgtrainError(f"{where}: {s.name} takes {kind}, got {text!r}") from None


def _show(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)
