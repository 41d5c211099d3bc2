"""Which tar shards a ``--source`` names: a folder (its ``.tar`` files, subfolders included), a
glob (``shards/*.tar``) or a brace pattern as WebDataset writes them
(``shards/train-{000000..000099}.tar``, ``{train,test}-{0..9}.tar``), expanded here and bounded.
Local files here; a ``--source`` in an object store is listed there and its shards copied into
this machine's cache by ``remote_shards.py``, which names and skips them by the same rules."""

from __future__ import annotations

import glob
import itertools
import os
import re
from pathlib import Path

from imgtrain.errors import ImgtrainError

MAX_SHARDS = 100_000  # a brace pattern naming more is refused before anything is expanded
_BRACE = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"(\d+)\.\.(\d+)")
COMPRESSED = (".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar.zst")
MISSING = "missing: the pattern names it and there is no such file"  # why a named shard is skipped
COMPRESSED_SKIPPED = "compressed shard, not read: decompress it to .tar"


def expand_braces(pattern: str, limit: int = MAX_SHARDS) -> list[str]:
    """Every name a brace pattern stands for, in order: ``{a,b}`` alternatives and ``{0..9}``
    ranges (zero-padded to the wider bound when either starts with 0, as bash and WebDataset do).
    Braces holding neither stay as they are. More than ``limit`` names is an error."""
    parts: list[list[str] | str] = []
    pos, total = 0, 1
    for m in _BRACE.finditer(pattern):
        body, bounds = m.group(1), _RANGE.fullmatch(m.group(1))
        if bounds is None and "," not in body:
            continue
        count = abs(int(bounds[2]) - int(bounds[1])) + 1 if bounds else body.count(",") + 1
        total *= count
        if total > limit:
            raise ImgtrainError(f"{pattern} names more than {limit:,} shards; narrow the ranges, or pass "
                                "the shards' folder or a glob such as 'shards/*.tar'")
        parts += [pattern[pos:m.start()], _range(bounds[1], bounds[2]) if bounds else body.split(",")]
        pos = m.end()
    parts.append(pattern[pos:])
    choices = [[p] if isinstance(p, str) else p for p in parts]
    return ["".join(names) for names in itertools.product(*choices)]


def _range(first: str, last: str) -> list[str]:
    a, b = int(first), int(last)
    width = max(len(first), len(last)) if first.startswith("0") or last.startswith("0") else 0
    step = 1 if b >= a else -1
    return [f"{i:0{width}d}" for i in range(a, b + step, step)]


def find_shards(source) -> tuple[list[Path], Path, list[tuple[str, str]]]:
    """(the .tar shards, sorted; the folder their names are given relative to; (name, why) for
    each shard named and not read: missing, or compressed). No shard at all is an error."""
    text = str(source)
    found, missing = [], []
    for pattern in expand_braces(text):
        if glob.has_magic(pattern):
            found += [Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file()]
        elif Path(pattern).is_dir():
            found += _tar_files(Path(pattern))
        elif Path(pattern).is_file():
            found.append(Path(pattern))
        else:
            missing.append(pattern)
    found = sorted(set(found))
    shards = [p for p in found if p.name.lower().endswith(".tar")]
    compressed = [p for p in found if p.name.lower().endswith(COMPRESSED)]
    if not shards:
        raise no_shards(text, compressed[0].name if compressed else None)
    root = Path(os.path.commonpath([p.parent for p in shards])) if not Path(text).is_dir() else Path(text)
    skipped = [(relative_name(Path(m), root), MISSING) for m in missing]
    skipped += [(relative_name(p, root), COMPRESSED_SKIPPED) for p in compressed]
    return shards, root, skipped


def no_shards(source: str, compressed: str | None) -> ImgtrainError:
    """The error for a ``--source`` that names no .tar shard (``compressed``: the name of a
    compressed shard it names, if any)."""
    why = (f"compressed shards ({compressed}) are not read; decompress them to .tar" if compressed
           else "pass a folder of .tar files, a glob ('shards/*.tar') or a brace pattern "
                "('shards/train-{000000..000099}.tar')")
    return ImgtrainError(f"no .tar shards at {source}; {why}")


def relative_name(path: Path, root: Path) -> str:
    """How messages and split names see a shard: its path under ``root``."""
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return path.as_posix()


def _tar_files(folder: Path) -> list[Path]:
    """The shard-like files under ``folder``, hidden files and folders left out."""
    return [p for p in folder.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)
            and p.name.lower().endswith((".tar", *COMPRESSED))]
