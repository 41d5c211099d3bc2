"""list: a CSV or Parquet table of image paths and labels (and optionally a train/test column, or
the train/val/test column ``--split-column`` names); with ``--multi-label`` several labels a row."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from imgtrain.data import tables
from imgtrain.data.limits import MIN_PATH_ROW_BYTES
from imgtrain.data.listing import Listing, files_listing, table_labels, table_splits
from imgtrain.errors import ImgtrainError, one_line


def list_file_table(path, path_column: str = "path", label_column: str = "label", seed: int = 0,
                    opts=None) -> Listing:
    """A CSV or Parquet table of image paths (relative to the table's folder, or absolute) and
    labels; a ``split`` column of train/test, when present, is the test split (``--split-column``:
    the column of train/val/test splits)."""
    path = Path(path)
    split_column = getattr(opts, "split_column", None)
    wanted = [path_column, label_column] + ([split_column] if split_column else [])
    if path.suffix.lower() == ".csv":
        import pyarrow.csv as pacsv

        # several labels are names joined in a string, whatever they look like ("3", "3 7")
        strings = {c: pa.string() for c in (label_column, split_column) if c}
        text = {c: pa.string() for c in (split_column,) if c}
        try:
            table = pacsv.read_csv(path, convert_options=pacsv.ConvertOptions(
                column_types=strings if getattr(opts, "multi_label", False) else text))
        except (pa.ArrowException, OSError) as e:
            raise ImgtrainError(f"cannot read {path}: {one_line(e, 200)}") from None
        missing = [c for c in wanted if c not in table.column_names]
        if missing:
            raise ImgtrainError(f"{path} has no column {' or '.join(map(repr, missing))}; available columns: "
                                f"{', '.join(table.column_names)}; choose with --path-column / --label-column"
                                f"{' / --split-column' if split_column else ''}")
    else:
        files = tables.parquet_files(path)
        if not files:
            raise ImgtrainError(f"no Parquet or CSV table at {path}; pass a .csv or .parquet file")
        table = tables.read_parquet_columns(files, wanted, ["split"],
                                            "choose with --path-column / --label-column / --split-column",
                                            min_row_bytes=MIN_PATH_ROW_BYTES)
    if table.num_rows == 0:
        raise ImgtrainError(f"{path} has no rows")
    paths = table.column(path_column)
    if not pa.types.is_string(paths.type) and not pa.types.is_large_string(paths.type) or paths.null_count:
        raise ImgtrainError(f"column {path_column!r} of {path} must hold a path in every row, got {paths.type}")
    test, val = table_splits(table, split_column, f"--source {path}")
    row = (lambda r: f"line {r + 2} of {path.name}") if path.suffix.lower() == ".csv" else \
        (lambda r: f"row {r} of {path.name}")
    labels, classes = table_labels(table, label_column, opts, (test, val), row)
    return files_listing(classes, paths.to_pylist(), labels, test, path.parent, seed, val)
