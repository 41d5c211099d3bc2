"""Bounds on what a data set may hold, checked by every source and every reader."""

from __future__ import annotations

from imgtrain.data.images import MAX_DECODE_PIXELS
from imgtrain.errors import ImgtrainError

# Each side of a data set's image shape (the stored shape, or the training resolution), in px:
# the bound a checkpoint's image shape is held to when inference loads it (predictor.py), so a
# data set within it trains a model that can be served.
MAX_IMAGE_SIDE = 8192
# Its height x width: no image with more pixels is decoded anywhere (images.MAX_DECODE_PIXELS:
# prepare, predict, training), so a larger resolution could only be an upsampling. One decoded
# RGB image is then at most 150 MiB.
MAX_IMAGE_PIXELS = MAX_DECODE_PIXELS

# One class per label value up to the largest: a stray label of 20,000,000 would make as many
# classes (and a 10-GB output layer). Real data sets with more classes than this are rare.
MAX_CLASSES = 100_000


def check_class_count(count: int, where: str, hint: str = "check the labels") -> None:
    if count > MAX_CLASSES:
        raise ImgtrainError(f"{where} make {count:,} classes, more than the {MAX_CLASSES:,} imgtrain accepts; {hint}")


# Rows a user's table files may declare (a Parquet footer, an Arrow batch's header), checked
# before any row is read. Values all alike or null compress to almost nothing: a 254-KiB Parquet
# file declared 30 M rows, and listing them (a label and a name per row, 100-200 bytes each)
# took GBs. An honest row of an image table holds an image: the smallest PNG is 67 bytes, and
# scikit-learn's 8x8 digits take 26 bytes a row as pixels (zstd at its top level). So a
# source's files hold at most one row per 4 bytes they weigh: listing then takes at most ~50
# times the files' size. (Copies of the same images compress further: 20 copies of the digits
# took 2.9 bytes a row; ROWS_ANY_SOURCE leaves such test tables room.)
MIN_IMAGE_ROW_BYTES = 4.0
# A table of image paths (the list source) compresses far better: sequential names took 0.66
# bytes a row with zstd and 0.06 with delta encoding, zstd's top level and sorted labels. 32
# rows a byte leaves those room; MAX_FILE_ROWS bounds the rest.
MIN_PATH_ROW_BYTES = 1 / 32
# Any source may hold this many rows whatever its files weigh (a test table of identical or
# blank images compresses to nothing); listing them takes ~15 MB.
ROWS_ANY_SOURCE = 1 << 16
# Rows of one file: more than ImageNet-21k's 14 M images, in a single file.
MAX_FILE_ROWS = 1 << 24
# Rows of one Parquet row group or Arrow record batch: one is read whole (a chunk of the
# preparation pool, the labels of a unit). pyarrow writes at most 1,048,576 by default (older
# versions 64 Mi: a whole table that fit in memory); the Hub's image files hold 100 to 1,000.
MAX_GROUP_ROWS = 1 << 22


class TableRows:
    """The rows one source's table files declare, held to the bounds above as each file's
    footer or headers are read, before any row is: a file over them is forged or broken."""

    def __init__(self, min_row_bytes: float = MIN_IMAGE_ROW_BYTES):
        self.min_row_bytes = min_row_bytes
        self.rows = 0
        self.bytes = 0

    def group(self, rows: int, where: str, unit: str = "row group") -> None:
        """One row group (or record batch) of ``where``."""
        if not 0 <= rows <= MAX_GROUP_ROWS:
            raise ImgtrainError(f"{where} declares {rows:,} rows in one {unit}, more than the "
                                f"{MAX_GROUP_ROWS:,} imgtrain reads at once: a forged or broken file")

    def file(self, rows: int, size: int, where: str) -> None:
        """A whole file of ``size`` bytes, after its groups."""
        self.rows += rows
        self.bytes += size
        allowed = max(ROWS_ANY_SOURCE, int(self.bytes / self.min_row_bytes))
        if rows > MAX_FILE_ROWS:
            raise ImgtrainError(f"{where} declares {rows:,} rows, more than the {MAX_FILE_ROWS:,} imgtrain "
                                "reads from one file: a forged or broken file; split it")
        if self.rows > allowed:
            before = f" ({self.rows:,} in {self.bytes:,} bytes with the files before it)" if self.rows > rows else ""
            what = "images" if self.min_row_bytes >= 1 else "image paths"
            raise ImgtrainError(f"{where} declares {rows:,} rows in {size:,} bytes{before}, more than a table that "
                                f"size can honestly hold ({allowed:,} rows of {what}): a forged or broken file")
