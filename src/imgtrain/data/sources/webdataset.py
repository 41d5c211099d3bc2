"""webdataset: WebDataset tar shards (what img2dataset and large corpora write). A sample is
the consecutive members sharing a key (the path up to the first dot of the file name, as
WebDataset groups them): its image ``key.jpg|jpeg|png`` and its label, ``key.cls`` (a class
index as text), else ``key.json`` (the field ``--label-column`` names), else ``key.txt`` (a
class name). Shards whose names say train/val/test keep those splits. With ``--multi-label`` a
sample has several labels: a JSON array (of names or indices) in the ``.json`` field, or names
(indices, in ``.cls``) joined by ``--label-sep``; none at all is allowed (every class negative).

Listed without reading an image: the shards' headers are read in order and each sample is kept
as (shard, offset, size, label); the pool's chunks later read the image bytes by offset. Any
other member (``.pyd``/``.pickle`` included) is never read. Shards in an object store
(``s3://...``) are first copied whole into this machine's cache (``remote_shards.py``).
"""

from __future__ import annotations

import functools
import json
import re
from array import array
from typing import Iterable, Iterator

import numpy as np

from imgtrain.data import label_sets
from imgtrain.data.class_labels import ClassBook
from imgtrain.data.listing import CHUNK_FILES, Chunk, Listing, Skipped
from imgtrain.data.named_splits import SPLIT_CODES, fixed_splits, splits_of_files
from imgtrain.data.remote_shards import find_remote_shards
from imgtrain.data.shard_patterns import find_shards, relative_name
from imgtrain.data.tar_members import Member, ShardScan, read_members
from imgtrain.errors import ImgtrainError
from imgtrain.ops.remote import is_remote

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png")
LABEL_EXTENSIONS = ("cls", "json", "txt")  # the first a sample has is its label
MAX_CLASS_NAME = 200  # characters: a longer .txt is a caption, not a class name
_KEY = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")  # WebDataset's base_plus_ext: (key, extension)


def split_key(name: str) -> tuple[str, str] | None:
    """``dir/abc.seg.jpg`` -> (``dir/abc``, ``seg.jpg``); None for a name without an extension."""
    m = _KEY.match(name)
    return (m[1], m[2].lower()) if m else None


def is_label_file(name: str) -> bool:
    """Whether the scan reads a member while listing (a label file; images are read later)."""
    found = split_key(name)
    return found is not None and found[1] in LABEL_EXTENSIONS


def grouped(members: Iterable[Member]) -> Iterator[tuple[str, dict[str, Member]]]:
    """(key, {extension: member}) of each run of consecutive members with one key."""
    key, parts = None, {}
    for member in members:
        found = split_key(member.name)
        if found is None:
            continue
        if found[0] != key and parts:
            yield key, parts
            parts = {}
        key = found[0]
        parts.setdefault(found[1], member)
    if parts:
        yield key, parts


def label_of(parts: dict[str, Member], field: str, book: ClassBook, where: str) -> int:
    """A sample's label: a class index or a class name's provisional number (``book``);
    ValueError: why it has none."""
    ext, value = _label_file(parts, field)
    if ext != "json":
        value = value.strip()
        if ext == "cls":
            if not value.isascii() or not value.isdigit():
                raise ValueError(f".cls holds {value[:20]!r}, not a class index")
            value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return int(book.indices(np.array([value], np.int64), where)[0])
    if not isinstance(value, str) or not value or len(value) > MAX_CLASS_NAME:
        raise ValueError(f"the label in .{ext} is not a class name or index: {str(value)[:40]!r}")
    return book.name(value, where)


def labels_of(parts: dict[str, Member], field: str, book: ClassBook, sep: str | None, where: str) -> tuple[list, bool]:
    """--multi-label: a sample's labels (class indices or names' provisional numbers), and whether
    they were names joined in a string; ValueError: why it has none that can be read."""
    ext, value = _label_file(parts, field)
    joined = isinstance(value, str)
    if joined:
        value = [v.strip() for v in value.split(sep if sep is not None else label_sets.DEFAULT_SEP) if v.strip()]
        if ext == "cls":
            if not all(v.isascii() and v.isdigit() for v in value):
                raise ValueError(f".cls holds {parts[ext].data[:20]!r}, not class indices")
            value = [int(v) for v in value]
    elif not isinstance(value, list):
        value = [value]
    if len(value) > label_sets.MAX_LABELS_PER_IMAGE:
        raise ValueError(f"the sample has {len(value):,} labels, over {label_sets.MAX_LABELS_PER_IMAGE:,}")
    found = []
    for v in value:
        if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
            found.append(int(book.indices(np.array([v], np.int64), where)[0]))
        elif isinstance(v, str) and v and len(v) <= MAX_CLASS_NAME:
            found.append(book.name(v, where))
        else:
            raise ValueError(f"a label in .{ext} is not a class name or index: {str(v)[:40]!r}")
    return sorted(set(found)), joined


def _label_file(parts: dict[str, Member], field: str) -> tuple[str, object]:
    """The sample's label file's extension and what it holds: the .json's ``field``, or the text
    of a .cls or .txt; ValueError: why there is none that can be read."""
    ext = next((e for e in LABEL_EXTENSIONS if e in parts), None)
    if ext is None:
        raise ValueError("no label (.cls, .json or .txt)")
    data = parts[ext].data
    if data is None:
        raise ValueError(f"label file .{ext} is over 1 MiB")
    if ext == "json":
        return ext, _json_field(data, field)
    try:
        return ext, data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"label file .{ext} is not UTF-8 text") from None


def _json_field(data: bytes, field: str):
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):  # RecursionError: nested thousands deep, on purpose or not
        raise ValueError(".json is not valid JSON") from None
    if not isinstance(obj, dict) or field not in obj:
        raise ValueError(f".json has no field {field!r} (choose the field with --label-column)")
    return obj[field]


def list_webdataset(source, opts) -> Listing:
    """The samples of every shard, in a seeded random order, cut into chunks read by offset."""
    shards, root, not_read = find_remote_shards(str(source)) if is_remote(source) else find_shards(source)
    names = [relative_name(p, root) for p in shards]
    named = splits_of_files(names, "shards")
    skipped = Skipped()
    book = ClassBook(mix_hint="class indices (.cls, numbers in .json) and class names (.txt, strings in .json)")
    for name, why in not_read:
        skipped.add(name, why)
    found = _Found()
    labelling = (opts.label_column, book) + ((opts.label_sep,) if opts.multi_label else ())
    for s, shard in enumerate(shards):
        scan = ShardScan(shard, is_label_file)
        for key, parts in grouped(scan):
            found.add(s, f"{names[s]}:{key}", parts, labelling,
                      SPLIT_CODES[named[s]] if named[s] else -1, skipped)
        if scan.damage:
            skipped.add(names[s], f"{scan.damage}; the samples before it were kept")
    if not found.count:
        if not skipped.count:
            raise ImgtrainError(f"the shards at {source} hold no samples; WebDataset samples are members "
                                "key.jpg|jpeg|png with a label key.cls, key.json or key.txt")
        return Listing([], np.zeros(0, np.int64), [], skipped=skipped)  # prepare says what was skipped
    if opts.multi_label:
        label_array, classes = _multi_label_classes(found, book, opts.label_sep)
    else:
        label_array, classes = book.classes(np.frombuffer(found.label, np.int64))
    if len(classes) < (1 if opts.multi_label else 2):
        raise ImgtrainError(f"the shards at {source} hold {len(classes)} class(es); a classifier needs at least 2")
    return _chunked(found, [str(p) for p in shards], label_array, classes, skipped, opts.seed, source)


class _Found:
    """The samples listed so far: a few numbers and a name each, no image."""

    def __init__(self):
        self.shard, self.offset, self.size = array("i"), array("q"), array("q")
        self.label, self.split, self.id = array("q"), array("b"), array("q")
        self.values, self.joined = array("q"), False  # --multi-label: the labels (label: how many each has)
        self.names: list[str] = []
        self.count = self.seen = 0

    def add(self, shard: int, where: str, parts: dict[str, Member], labelling: tuple[str, ClassBook], split: int,
            skipped: Skipped) -> None:
        self.seen += 1
        image = next((parts[e] for e in IMAGE_EXTENSIONS if e in parts), None)
        if image is None:
            skipped.add(f"{where}.{'|'.join(sorted(parts))}", "no .jpg/.jpeg/.png image for this key")
            return
        try:
            if len(labelling) == 3:
                labels, joined = labels_of(parts, *labelling, where)
                label = len(labels)
            else:
                label = label_of(parts, *labelling, where)
        except ValueError as e:
            skipped.add(f"{where}.{image.name.rsplit('.', 1)[-1]}", str(e))
            return
        if len(labelling) == 3:
            self.values.extend(labels)
            self.joined |= joined
        self.shard.append(shard), self.offset.append(image.offset), self.size.append(image.size)
        self.label.append(label), self.split.append(split), self.id.append(self.seen - 1)
        self.names.append(f"{where}.{image.name.rsplit('.', 1)[-1]}")
        self.count += 1


def _chunked(found: _Found, paths: list[str], labels: np.ndarray, classes: list[str], skipped: Skipped,
             seed: int, source) -> Listing:
    """A seeded random order of the samples (a shard may be sorted by class), cut into chunks;
    each chunk opens the shards it reads once."""
    order = np.random.default_rng([seed, 0x7A5]).permutation(found.count)
    shard = np.frombuffer(found.shard, np.int32)[order]
    offset, size = np.frombuffer(found.offset, np.int64)[order], np.frombuffer(found.size, np.int64)[order]
    codes = np.frombuffer(found.split, np.int8)[order]
    fixed_test, fixed_val = fixed_splits(None if (codes < 0).all() else codes, f"--source {source}")
    chunks = []
    for first in range(0, found.count, CHUNK_FILES):
        part = slice(first, first + CHUNK_FILES)
        used, which = np.unique(shard[part], return_inverse=True)
        chunks.append(Chunk(first, [found.names[i] for i in order[part]],
                            functools.partial(read_members, [paths[u] for u in used], which, offset[part], size[part])))
    return Listing(classes, labels[order], chunks, fixed_test, np.frombuffer(found.id, np.int64)[order],
                   fixed_val, skipped)


def _multi_label_classes(found: _Found, book: ClassBook, sep: str | None) -> tuple[label_sets.LabelSets, list[str]]:
    """The samples' labels, in listing order, numbered by the sorted class names (indices as
    they are); a name only in val/test shards is refused."""
    sizes = np.frombuffer(found.label, np.int64)
    sets = label_sets.LabelSets(np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
                                np.frombuffer(found.values, np.int64).copy())
    if found.joined:
        label_sets.check_separator(sets, sep)
    if book.kind == "name":
        rank, classes = book.classes(np.arange(len(book.names), dtype=np.int64))
        sets = sets.renumbered(rank)
    else:
        classes = [str(i) for i in range(book.top + 1)]
    if not classes:
        raise ImgtrainError("--multi-label: no sample has a label; a classifier needs labels to learn")
    train = np.frombuffer(found.split, np.int8) <= SPLIT_CODES["train"]
    return label_sets.train_classes(sets, classes, train, lambda r: found.names[r])
