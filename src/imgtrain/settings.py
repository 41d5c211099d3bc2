"""Options declared once: a dataclass field made with ``setting()`` (a training setting) or
``option()`` (a command's option) carries its default, its help, its flag, the values it takes
and what may be done with it. The command line (``cli.py`` turns fields into options), the Python
API (its functions' defaults are the fields' own), config files and the lists of names other
modules need (what a sweep may change on a re-run, the model card's recipe, what a tracker must
not be told) are all read from these fields, through ``settings_of``.

Imports nothing of imgtrain: every layer declares its options with it, and ``imgtrain --help``
reads them without numpy, torch or Ray.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import typing
from dataclasses import dataclass, field
from typing import Callable

REQUIRED = ...  # the default of an option that must be given (``predict --out``)
RUNS = "./runs"  # where runs live when --storage does not say
STORAGE_HELP = "Where runs live: a local or shared path, or an object store (s3://bucket/prefix)."


def setting(default, doc: str, *, help: str | None = None, flag: str | None = None, aliases: tuple = (),
            choices: tuple = (), range: str | None = None, shown: str | Callable[[], str] | None = None,
            metavar: str | None = None, parse: Callable[[str], object] | None = None, cli: bool = True,
            resumable: bool = False, run_only: bool = False, recipe: int = 0, secret: bool = False,
            place: bool = False):
    """A dataclass field with everything said about it.

    doc: what it is (``config show --toml`` prints it all); help: the ``--help`` text, by default
    the doc's first sentence. flag: the option's spelling when it is not ``--field-name``
    (``--gpu/--cpu``: a second name turns it off); aliases: more names (``-y``). choices: the
    allowed values; range: interval notation, ``"[0, 1)"`` (brackets include the bound).
    shown: what --help says the default is where the value says too little ("as many as the
    cluster holds"); metavar: how --help shows the value; parse: the option is given as text,
    read by this function (``--size 64x64``). cli: False for a field set through another option
    (``min_workers`` by ``--workers 1-4``).

    What may be done with the value: resumable, it may differ when a run is resumed (operational,
    not part of the experiment); run_only, it may differ when a sweep is run again (where, how
    fast, where the logs go); recipe, its row in the model card's training recipe (1 first; 0:
    none); secret, it may hold a credential (a URI's ``user:password@``), written to files and
    trackers without it; place, it names a place on this machine, which a tracker is told by
    its last name alone.
    """
    return field(default=default, metadata={
        "doc": " ".join(doc.split()), "help": " ".join(help.split()) if help else None, "flag": flag,
        "aliases": tuple(aliases), "choices": tuple(choices), "range": range, "shown": shown, "metavar": metavar,
        "parse": parse, "cli": cli, "resumable": resumable, "run_only": run_only, "recipe": recipe, "secret": secret,
        "place": place})


def option(default, help: str, **more):
    """A command's option: ``help`` is all it says, in --help as written (see ``setting``)."""
    return setting(default, help, help=help, **more)


def storage_option(help: str = STORAGE_HELP):
    """``--storage``, the option of every command that finds runs by name."""
    return option(RUNS, help)


@dataclass(frozen=True)
class Setting:
    """One declared field with everything said about it (``setting``)."""

    name: str
    type: type  # int, float, bool, str, Path... (``X | None`` fields: X, with ``optional``)
    optional: bool
    default: object
    doc: str
    help_text: str | None
    flag: str  # "--batch-size", "--gpu/--cpu"
    aliases: tuple
    choices: tuple
    range: str | None
    shown: str | Callable[[], str] | None
    metavar: str | None
    parse: Callable[[str], object] | None
    cli: bool
    resumable: bool
    run_only: bool
    recipe: int
    secret: bool
    place: bool

    @classmethod
    def of(cls, name: str, hint, f: dataclasses.Field) -> Setting:
        """The Setting of the field ``f`` named ``name``, of the type ``hint``."""
        optional = type(None) in typing.get_args(hint)
        if optional:
            hint = next(t for t in typing.get_args(hint) if t is not type(None))
        m = f.metadata
        return cls(name, hint, optional, f.default, m["doc"], m["help"], m["flag"] or "--" + name.replace("_", "-"),
                   m["aliases"], m["choices"], m["range"], m["shown"], m["metavar"], m["parse"], m["cli"],
                   m["resumable"], m["run_only"], m["recipe"], m["secret"], m["place"])

    @property
    def summary(self) -> str:
        """The description's first sentence: ``config show``'s column."""
        return re.split(r"(?<=\.)\s+(?=[A-Z`(])", self.doc.replace("``", ""), maxsplit=1)[0]

    @property
    def help(self) -> str:
        """What --help says of it: the declared help, or the description's first sentence."""
        return self.help_text or self.summary

    @property
    def shown_default(self) -> str:
        """The default as --help names it ("" when there is nothing to name)."""
        if self.shown is not None:
            return self.shown() if callable(self.shown) else self.shown
        return "" if self.default in (None, "", REQUIRED) else str(self.default)

    @property
    def flag_names(self) -> list[str]:
        """Every spelling a config file may use too: the field, and the flag's names."""
        return [part.removeprefix("--").replace("-", "_") for part in self.flag.split("/")]


@functools.cache
def settings_of(cls) -> tuple[Setting, ...]:
    """The declared fields of the dataclass ``cls``, in order (fields made otherwise are left out)."""
    hints = typing.get_type_hints(cls)
    return tuple(Setting.of(f.name, hints[f.name], f) for f in dataclasses.fields(cls) if "doc" in f.metadata)


def values(instance) -> dict:
    """The declared fields of a dataclass instance, by name: keyword arguments for the function
    that takes them (``evaluate(run, **values(opts))``). Not ``asdict``: nested values stay as they are."""
    return {s.name: getattr(instance, s.name) for s in settings_of(type(instance))}
