"""The data sources ``data prepare`` knows, by name. Each source has a ``SourceSpec``, registered
in the package's ``__init__.py`` (its reader is a module of its own, imported when used): what
``--source`` names, which options it takes, and how it is listed. prepare's checks and the CLI's
help ask the specs: nothing else compares source names. docs/data.md's table of sources is
written by hand; ``tests/test_docs.py`` holds it to these specs.

A lister returns one of three things, and prepare writes each its own way:

* ``raw.RawDataset``: small images already split, in memory (or rows of a file on disk);
* ``listing.Listing``: labels and chunks of encoded PNG/JPEG images that a pool process reads
  on its own (``Chunk.read``), checked and written chunk by chunk;
* ``listing.PixelListing``: labels and batches of pixel arrays, written batch by batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Union

from imgtrain.errors import ImgtrainError
from imgtrain.ops.remote import is_remote

if TYPE_CHECKING:  # what a lister returns imports numpy and pyarrow: the specs, and --help, need neither
    from imgtrain.data.listing import Listing, PixelListing
    from imgtrain.data.options import PrepareOptions
    from imgtrain.data.raw import RawDataset

Listed = Union["RawDataset", "Listing", "PixelListing"]

# The options only some sources take: the flags messages name, and their PrepareOptions fields.
# The others apply to every source, unless its spec says its images or its split are fixed.
SOURCE_OPTIONS = {
    "--download": ("download",),
    "--image-column/--label-column": ("image_column", "label_column"),
    "--path-column": ("path_column",),
    "--multi-label/--label-sep": ("multi_label", "label_sep"),
    "--split-column": ("split_column",),
}


@dataclass(frozen=True)
class SourceSpec:
    name: str
    """What ``data prepare NAME`` calls it."""
    summary: str
    """What it reads, in a few words (``data prepare --help``)."""
    lister: Callable[[Union[Path, None], PrepareOptions], Listed]
    """(--source or None, options) -> what prepare writes; raises ImgtrainError for a bad source."""
    source: str = ""
    """What --source names, e.g. "DIR of IDX files"; "" for a source built in (no --source)."""
    options: frozenset[str] = frozenset()
    """The fields of SOURCE_OPTIONS it uses."""
    ignores: frozenset[str] = frozenset()
    """Fields of SOURCE_OPTIONS it accepts and does not use (kept so that a command that worked
    goes on working)."""
    fixed_images: str = ""
    """Its images' one shape, e.g. "28x28 grayscale": --channels/--size are refused."""
    fixed_split: bool = False
    """It has its own train/test split: --test-fraction is refused."""
    walks_source: bool = False
    """Every file under --source is read: an output folder inside it would be read as data."""
    remote_source: bool = False
    """--source may be in an object store (s3://...): its lister copies what it reads."""


SOURCES: dict[str, SourceSpec] = {}
"""Every registered source, in the order of registration (the order help and messages list them)."""


def register(spec: SourceSpec) -> SourceSpec:
    if spec.name in SOURCES:
        raise ValueError(f"data source {spec.name!r} is registered twice")
    unknown = (spec.options | spec.ignores) - {f for fields in SOURCE_OPTIONS.values() for f in fields}
    if unknown:
        raise ValueError(f"data source {spec.name!r} takes unknown options {sorted(unknown)}")
    SOURCES[spec.name] = spec
    return spec


def get(name: str) -> SourceSpec:
    try:
        return SOURCES[name]
    except KeyError:
        raise ImgtrainError(f"unknown data source {name!r}; choose one of: {', '.join(SOURCES)}") from None


def using(*options: str) -> list[str]:
    """The names of the sources that use any of ``options`` (fields of SOURCE_OPTIONS)."""
    return [s.name for s in SOURCES.values() if s.options & set(options)]


def problems(spec: SourceSpec, source_path, opts: PrepareOptions) -> list[str]:
    """Every option given that ``spec`` does not take, and a missing or unwanted --source."""
    given, issues = opts.changed(), []
    if spec.source and source_path is None:
        issues.append(f"source {spec.name!r} needs --source PATH")
    if not spec.source and source_path is not None:
        issues.append(f"{spec.name} is built in and takes no --source")
    elif source_path is not None and is_remote(source_path) and not spec.remote_source:
        issues.append(f"{spec.name} reads a local --source; copy {source_path} to this machine first (only "
                      f"{', '.join(s.name for s in SOURCES.values() if s.remote_source)} reads an object store)")
    issues += _not_taken(spec, given, "--download")
    if spec.fixed_images and given & {"channels", "size"}:
        issues.append(f"--channels/--size do not apply to {spec.name} ({spec.fixed_images})")
    issues += _not_taken(spec, given, "--image-column/--label-column")
    issues += _not_taken(spec, given, "--path-column")
    issues += _not_taken(spec, given, "--multi-label/--label-sep")
    issues += _not_taken(spec, given, "--split-column")
    if spec.fixed_split and "test_fraction" in given:
        issues.append(f"{spec.name} has a fixed train/test split; drop --test-fraction")
    return issues


def _not_taken(spec: SourceSpec, given: set[str], flags: str) -> list[str]:
    fields = SOURCE_OPTIONS[flags]
    if (given & set(fields)) <= (spec.options | spec.ignores):
        return []
    names = using(*fields)
    where = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
    verb = "apply" if "/" in flags else "applies"
    return [f"{flags} only {verb} to the {where} source{'s' if len(names) > 1 else ''}"]


def help_lines() -> list[str]:
    """One line per source, for ``data prepare --help``: what it reads, what --source names and
    the options only some sources take."""
    lines = []
    for spec in SOURCES.values():
        needs = f": --source {spec.source}" if spec.source else " (built in: no --source)"
        takes = ", ".join(flag(f) for fields in SOURCE_OPTIONS.values() for f in fields if f in spec.options)
        lines.append(f"{spec.name}: {spec.summary}{needs}{f'; takes {takes}' if takes else ''}")
    return lines


def flag(option: str) -> str:
    """The command line's flag of a PrepareOptions field: image_column -> --image-column."""
    return "--" + option.replace("_", "-")
