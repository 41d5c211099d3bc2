"""list: a CSV or Parquet table of image paths and labels (and optionally a train/test column)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from imgtrain.data import tables
from imgtrain.data.limits import MIN_PATH_ROW_BYTES
from imgtrain.data.listing import Listing, files_listing, fixed_test
from imgtrain.errors import ImgtrainError, one_line


def list_file_table(path, path_column: str = "path", label_column: str = "label", seed: int = 0) -> Listing:
    """A CSV or Parquet table of image paths (relative to the table's folder, or absolute) and
    labels; a ``split`` column of train/test, when present, is the test split."""
    path = Path(path)
    if path.suffix.lower() == ".csv":
        import pyarrow.csv as pacsv

        try:
            table = pacsv.read_csv(path)
        except (pa.ArrowException, OSError) as e:
            raise ImgtrainError(f"cannot read {path}: {one_line(e, 200)}") from None
        missing = [c for c in (path_column, label_column) if c not in table.column_names]
        if missing:
            raise ImgtrainError(f"{path} has no column {' or '.join(map(repr, missing))}; available columns: "
                                f"{', '.join(table.column_names)}; choose with --path-column / --label-column")
    else:
        files = tables.parquet_files(path)
        if not files:
            raise ImgtrainError(f"no Parquet or CSV table at {path}; pass a .csv or .parquet file")
        table = tables.read_parquet_columns(files, [path_column, label_column], ["split"],
                                            "choose with --path-column / --label-column",
                                            min_row_bytes=MIN_PATH_ROW_BYTES)
    if table.num_rows == 0:
        raise ImgtrainError(f"{path} has no rows")
    paths = table.column(path_column)
    if not pa.types.is_string(paths.type) and not pa.types.is_large_string(paths.type) or paths.null_count:
        raise ImgtrainError(f"column {path_column!r} of {path} must hold a path in every row, got {paths.type}")
    labels, classes = tables.labels_from_column(table.column(label_column), label_column)
    return files_listing(classes, paths.to_pylist(), labels, fixed_test(table), path.parent, seed)
