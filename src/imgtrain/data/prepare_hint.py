"""The ``data prepare`` command that would make a data set of what a user named as one: ``train
--data ./photos`` on a folder of photos must not be told to prepare MNIST. A quick look at the
folder's first entries (bounded: a folder of a million files is not listed whole) says which
source reads it; otherwise the sources are listed."""

from __future__ import annotations

import itertools
import os
import shlex
from pathlib import Path

from imgtrain.data.images import IMAGE_SUFFIXES

LOOKED_AT = 200  # entries of the folder, and of each of its first subfolders, looked at
SUBFOLDERS_LOOKED_AT = 20


def prepare_hint(path: Path) -> str:
    """What to run, in a few words, for ``path`` (which holds no prepared data set)."""
    source = _source_for(path)
    here = shlex.quote(str(path))
    out = shlex.quote(str(path.with_name(f"{path.stem or 'data'}-prepared")))  # beside it: never inside the source
    if source == "folder":
        return (f"it holds images in class folders: prepare them with `imgtrain data prepare folder {out} "
                f"--source {here}`, then train with --data {out}")
    if source == "images":
        return (f"it holds images but no class folders: put each class's images in a subfolder of its own, then "
                f"`imgtrain data prepare folder {out} --source {here}`")
    if source:
        return (f"prepare it with `imgtrain data prepare {source} {out} --source {here}`, then train with "
                f"--data {out}")
    return ("create one with `imgtrain data prepare SOURCE DIR`: for photos in one subfolder per class, "
            "`imgtrain data prepare folder DIR --source PHOTOS`; the sources: " + ", ".join(_sources())
            + " (imgtrain data prepare --help)")


def _sources() -> list[str]:
    from imgtrain.data.sources import registry  # the package registers them all

    return list(registry.SOURCES)


def _source_for(path: Path) -> str | None:
    """The source that reads ``path``, "images" for a folder of loose images, or None."""
    try:
        if path.is_file():
            return _by_suffix([path.name])
        if not path.is_dir():
            return None
        entries = _first(path)
    except OSError:  # unreadable: the sources are listed
        return None
    names = [e.name for e in entries]
    if {"dataset_dict.json", "state.json", "dataset_info.json"} & set(names):
        return "hf"
    if any("idx3-ubyte" in n or "idx3_ubyte" in n for n in names):
        return "mnist"
    if any(n.lower().endswith(IMAGE_SUFFIXES) for n in names):
        return "images"
    folders = [e for e in entries if e.is_dir(follow_symlinks=False) and not e.name.startswith(".")]
    for folder in folders[:SUBFOLDERS_LOOKED_AT]:
        try:
            inside = _first(Path(folder.path))
        except OSError:
            continue
        split = folder.name in ("train", "test") and any(e.is_dir(follow_symlinks=False) for e in inside)
        if split or any(e.name.lower().endswith(IMAGE_SUFFIXES) for e in inside):
            return "folder"  # class folders (or train/ and test/ holding them)
    return _by_suffix(names)


def _by_suffix(names: list[str]) -> str | None:
    lowered = [n.lower() for n in names]
    for suffixes, source in (((".tar",), "webdataset"), ((".parquet",), "parquet"), ((".arrow",), "hf"),
                             ((".csv",), "list")):
        if any(n.endswith(suffixes) for n in lowered):
            return source
    return None


def _first(folder: Path) -> list[os.DirEntry]:
    with os.scandir(folder) as entries:
        return list(itertools.islice(entries, LOOKED_AT))
