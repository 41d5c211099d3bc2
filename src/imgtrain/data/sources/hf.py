"""hf: a Hugging Face data set saved locally: a ``save_to_disk`` folder (a Dataset, or a
DatasetDict with one folder per split), or Parquet/Arrow files as the Hub stores them. Images
are the ``{bytes, path}`` structs of the ``datasets`` library's Image feature (or plain bytes);
labels a ClassLabel column (its class names kept) or class-name strings. The source's own
train/validation/test splits are kept.

Read with pyarrow a unit at a time (``hf_files``): the labels first, then the pool's chunks read
their rows' images. Rows without a label (ClassLabel's -1, null) are skipped and listed.
With ``--multi-label`` the label column holds several labels a row: a ``Sequence(ClassLabel)``
(its names kept), a list of names, or names joined by ``--label-sep``; a row without any is
kept (every class negative).

The ``parquet`` source reads the same image structs from any Parquet table, as a plain table
(labels as they are, a ``split`` column); this source adds what the ``datasets`` library
writes around them: ClassLabel names, split names, save_to_disk folders and Arrow files.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from imgtrain.data import hf_files
from imgtrain.data import label_sets
from imgtrain.data.class_labels import ClassBook
from imgtrain.data.limits import TableRows, check_class_count
from imgtrain.data.listing import MAX_LISTED_BAD, Chunk, Listing, Skipped
from imgtrain.data.named_splits import SPLIT_CODES, fixed_splits
from imgtrain.data.tables import foreign_extension
from imgtrain.errors import ImgtrainError

CHUNK_ROWS = 256  # rows of one unit per chunk of the preparation pool (the Hub's image units hold 100)


@dataclass
class _Unit:
    """Rows of one unit of one file that have a label: what a chunk reads."""

    part: hf_files.Part
    unit: int
    rows: np.ndarray  # int64, in the unit
    row0: int  # the unit's first row in its file
    labels: np.ndarray | label_sets.LabelSets  # int64, provisional (ClassBook); --multi-label: LabelSets
    ids: np.ndarray  # int64: the rows' positions in the whole source
    split: int  # SPLIT_CODES, -1: none of the source's own


def list_hf(source, opts) -> Listing:
    source = Path(source)
    layout = hf_files.find_parts(source)
    if not layout.parts:
        raise ImgtrainError(f"{source} holds no train, validation or test split; nothing to prepare")
    schema = hf_files.schema_of(layout.parts[0].path)
    features = layout.features or hf_files.features_of(schema) or {}
    image = _pick(schema, features, opts.image_column, ("image", "Image"), layout.parts[0])
    label = _pick(schema, features, opts.label_column, ("label", "ClassLabel"), layout.parts[0])
    feature = features.get(label)
    if opts.multi_label and isinstance(feature, dict) and feature.get("_type") in ("Sequence", "List"):
        feature = feature.get("feature")  # Sequence(ClassLabel): the names of the listed ids
    book = ClassBook(_class_names(feature), "class ids and class names")
    rows = TableRows()  # the rows every file declares, held to bounds before any is read
    for part in layout.parts:
        hf_files.check_rows(part.path, rows, part.name)
    skipped, found, first_id = Skipped(), [], 0
    for name, why in layout.not_read:
        skipped.add(name, why)
    for part in layout.parts:
        _check_columns(hf_files.schema_of(part.path) if part is not layout.parts[0] else schema, part, image, label)
        first_id = _list_part(part, label, book, first_id, found, skipped, opts)
    if not found:
        if not skipped.count:
            raise ImgtrainError(f"{source} holds no rows")
        return Listing([], np.zeros(0, np.int64), [], skipped=skipped)  # prepare says what was skipped
    return _chunked(found, image, book, skipped, opts, source, schema.field(label).type)


def _list_part(part: hf_files.Part, label: str, book: ClassBook, first_id: int, found: list[_Unit],
               skipped: Skipped, opts) -> int:
    """The labelled rows of one file, unit by unit; returns the id of the next file's first row."""
    split = SPLIT_CODES[part.split] if part.split else -1
    bad, bad_count, reasons, row0 = [], 0, set(), 0
    for u, (column,) in enumerate(hf_files.units(part.path, [label])):
        if opts.multi_label:
            labels, why = _unit_label_sets(column, label, book, opts.label_sep, f"{part.name} row {row0}")
        else:
            labels, why = _unit_labels(column, book, f"{part.name} row {row0}")
        for k in np.flatnonzero(why != ""):
            bad_count += 1
            reasons.add(why[k])
            if len(bad) < MAX_LISTED_BAD:
                bad.append((f"{part.name} row {row0 + k}", str(why[k])))
        rows = np.flatnonzero(why == "")
        for start in range(0, len(rows), CHUNK_ROWS):
            take = rows[start:start + CHUNK_ROWS]
            found.append(_Unit(part, u, take, row0, labels[take], first_id + row0 + take, split))
        row0 += len(column)
    if bad_count and bad_count == row0 and len(reasons) == 1:  # a split without labels: one line, not one a row
        skipped.add(part.name, f"{reasons.pop()} in every row ({bad_count:,}): not read", bad_count)
    else:
        for name, why in bad:
            skipped.add(name, why)
        skipped.count += bad_count - len(bad)
    return first_id + row0


def _unit_labels(column: pa.Array, book: ClassBook, where: str) -> tuple[np.ndarray, np.ndarray]:
    """(labels int64 [n], why each row has none: "" where it has one) of one unit."""
    if pa.types.is_dictionary(column.type):
        column = column.cast(column.type.value_type)
    why = np.where(column.is_null().to_numpy(zero_copy_only=False), "empty (null) label", "").astype(object)
    labels = np.zeros(len(column), np.int64)
    if pa.types.is_integer(column.type):
        values = column.fill_null(0).to_numpy().astype(np.int64)  # a copy: nothing keeps the file mapped
        why[(values < 0) & (why == "")] = "no label (-1)"
        if book.fixed is not None:
            why[(values >= len(book.fixed)) & (why == "")] = f"label beyond the {len(book.fixed)} class names"
        good = why == ""
        labels[good] = book.indices(values[good], where)
    elif pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        distinct = pc.unique(column.drop_null())  # a string per class name, not per row
        numbers = np.array([book.name(name, where) for name in distinct.to_pylist()], np.int64)
        good = why == ""
        labels[good] = numbers[pc.index_in(column, value_set=distinct).drop_null().to_numpy()]
    else:
        raise ImgtrainError(f"label column at {where} has type {column.type}; expected class ids (a ClassLabel) "
                            "or class names; choose another with --label-column")
    return labels, why


def _unit_label_sets(column: pa.Array, label: str, book: ClassBook, sep: str | None,
                     where: str) -> tuple[label_sets.LabelSets, np.ndarray]:
    """(each row's labels, provisional; "" for every row: none is skipped) of one unit."""
    if label_sets.column_kind(column.type) is None:
        raise ImgtrainError(f"--multi-label: label column {label!r} at {where} has type {column.type}; expected a "
                            "Sequence(ClassLabel), a list of class names, or names joined by --label-sep")
    sets, names = label_sets.from_column(column, label, sep, book.fixed)
    if label_sets.column_kind(column.type) == "ids":
        book.indices(sets.values, where)
    else:
        sets = sets.renumbered(np.array([book.name(n, where) for n in names], np.int64))
    return sets, np.full(len(sets), "", object)


def _pick(schema: pa.Schema, features: dict, given: str, default: tuple[str, str], part: hf_files.Part) -> str:
    """The column asked for; when it is the default name and absent, the one column whose feature
    is of that type (CIFAR-10's images are "img")."""
    if given in schema.names:
        return given
    name, hf_type = default
    typed = [c for c, f in features.items() if isinstance(f, dict) and f.get("_type") == hf_type and c in schema.names]
    if given == name and len(typed) == 1:
        return typed[0]
    raise ImgtrainError(f"{part.name} has no column {given!r}; available columns: {', '.join(schema.names)}; "
                        "choose with --image-column / --label-column")


def _check_columns(schema: pa.Schema, part: hf_files.Part, image: str, label: str) -> None:
    for column in (image, label):
        if column not in schema.names:
            raise ImgtrainError(f"{part.name} has no column {column!r} (the data set's other files have it)")
        found = foreign_extension(schema.field(column))
        if found:
            raise ImgtrainError(f"{part.name}: column {column!r} has the Arrow extension type {found!r}, which "
                                "imgtrain does not read")
    typ = schema.field(image).type
    if not (pa.types.is_binary(typ) or pa.types.is_large_binary(typ)
            or pa.types.is_struct(typ) and typ.get_field_index("bytes") >= 0):
        raise ImgtrainError(f"{part.name}: column {image!r} holds {typ}, not encoded images (an Image feature's "
                            "{bytes, path}); pixel arrays: use the parquet source")


def _class_names(feature) -> list[str] | None:
    """A ClassLabel feature's class names, when it has a usable list of them."""
    if not isinstance(feature, dict) or feature.get("_type") != "ClassLabel":
        return None
    names = feature.get("names")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        return None
    check_class_count(len(names), "the ClassLabel names")
    return names if len(set(names)) == len(names) else None


def _chunked(found: list[_Unit], image: str, book: ClassBook, skipped: Skipped, opts, source,
             label_type: pa.DataType) -> Listing:
    """The chunks in a seeded random order (a saved data set is often sorted by class; the rows
    of a chunk stay in the file's order, so each chunk reads one unit)."""
    order = np.random.default_rng([opts.seed, 0x4F]).permutation(len(found))
    found = [found[i] for i in order]
    chunks, first = [], 0
    for u in found:
        chunks.append(Chunk(first, [f"{u.part.name} row {u.row0 + r}" for r in u.rows.tolist()],
                            functools.partial(hf_files.read_images, str(u.part.path), u.unit, image, u.rows.tolist())))
        first += len(u.rows)
    codes = np.concatenate([np.full(len(u.rows), u.split, np.int8) for u in found])
    fixed_test, fixed_val = fixed_splits(None if (codes < 0).all() else codes, f"--source {source}")
    if opts.multi_label:
        joined = label_sets.column_kind(label_type) == "joined"
        labels, classes = _multi_label_classes(found, book, codes, opts.label_sep, joined,
                                               [n for c in chunks for n in c.names])
        return Listing(classes, labels, chunks, fixed_test, np.concatenate([u.ids for u in found]), fixed_val, skipped)
    labels, classes = book.classes(np.concatenate([u.labels for u in found]))
    if len(classes) < 2:
        raise ImgtrainError(f"{source} holds {len(classes)} class(es); a classifier needs at least 2")
    return Listing(classes, labels, chunks, fixed_test, np.concatenate([u.ids for u in found]), fixed_val, skipped)


def _multi_label_classes(found: list[_Unit], book: ClassBook, codes: np.ndarray, sep: str | None, joined: bool,
                         names: list[str]) -> tuple[label_sets.LabelSets, list[str]]:
    """Every row's labels, numbered by the sorted class names: a ClassLabel's names as they are,
    else the names the training rows carry (one only in validation or test rows is refused)."""
    sets = label_sets.LabelSets.concat([u.labels for u in found])
    if joined:
        label_sets.check_separator(sets, sep)
    if book.kind == "name":
        rank, classes = book.classes(np.arange(len(book.names), dtype=np.int64))
        sets = sets.renumbered(rank)
    else:
        classes = list(book.fixed) if book.fixed is not None else [str(i) for i in range(book.top + 1)]
    if book.fixed is not None:
        return sets, classes
    if not classes:
        raise ImgtrainError("--multi-label: no row of the source has a label; a classifier needs labels to learn")
    return label_sets.train_classes(sets, classes, codes <= SPLIT_CODES["train"], lambda r: names[r])
