"""Users' Parquet and Arrow files that declare millions of rows in a few KB (null images and
two class names compress to almost nothing): every reader (prepare hf, parquet and list,
predict) refuses them from their footers or batch headers, before any row is read, in a
child process whose peak memory is measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from imgtrain.data.limits import MAX_GROUP_ROWS, ROWS_ANY_SOURCE, TableRows
from imgtrain.errors import ImgtrainError
from tests.conftest import assert_one_line_error, cli_here
from tests.conftest_data_helpers import png_bytes

IMAGE_STRUCT = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def two_classes(rows: int) -> pa.Array:
    return pa.DictionaryArray.from_arrays(pa.array(np.arange(rows, dtype=np.int32) % 2), pa.array(["cat", "dog"]))


def forged_images(path: Path, rows: int, group_rows: int) -> Path:
    """``rows`` null images (Hugging Face's struct) labelled cat or dog: a few bytes per 1,000 rows."""
    table = pa.table({"image": pa.nulls(rows, IMAGE_STRUCT), "label": two_classes(rows)})
    pq.write_table(table, path, row_group_size=group_rows, compression="zstd")
    return path


def forged_paths(path: Path, rows: int) -> Path:
    """A list table naming one file ``rows`` times."""
    paths = pa.DictionaryArray.from_arrays(pa.array(np.zeros(rows, np.int32)), pa.array(["a.png"])).cast(pa.string())
    pq.write_table(pa.table({"path": paths, "label": two_classes(rows).cast(pa.string())}), path,
                   row_group_size=1 << 20, compression="zstd")
    return path


def forged_arrow(path: Path, rows: int) -> Path:
    """An Arrow stream (what save_to_disk writes) of one compressed record batch of ``rows`` rows."""
    table = pa.table({"image": pa.nulls(rows, IMAGE_STRUCT), "label": pa.array(np.zeros(rows, np.int64))})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(
            sink, table.schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as writer:
        writer.write_table(table, max_chunksize=rows)
    return path


# Each reader on its forged file, in one process that says what each said and its own peak RSS.
CHILD = r"""
import json, sys
from pathlib import Path
from imgtrain.data.options import PrepareOptions
from imgtrain.data.prepare import prepare
from imgtrain.errors import ImgtrainError
from imgtrain.inference.inputs import list_inputs

said = {}
for name, (source, path) in json.loads(sys.argv[1]).items():
    try:
        if source == "predict":
            list_inputs(path)
        else:
            prepare(source, Path(sys.argv[2]) / name, path, PrepareOptions(workers=1))
        said[name] = "accepted"
    except ImgtrainError as e:
        said[name] = str(e)
# VmHWM, this program's own peak: getrusage's ru_maxrss keeps the peak of the process it was
# forked from (Linux carries it across exec), a pytest process holding torch: 1.4 GB before any row
peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"said": said, "peak": peak * 1024}))
"""


def run_child(readers: dict, out: Path) -> tuple[dict, int]:
    """(what each reader said, the child's peak RSS in bytes)."""
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(readers), str(out)], capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, timeout=90)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    return found["said"], found["peak"]


@pytest.mark.timeout(120)  # before the bounds, the readers built every row: minutes and GBs
def test_small_files_declaring_millions_of_rows_are_refused_before_any_row_is_read(tmp_path):
    one_group = forged_images(tmp_path / "one_group.parquet", 5_000_000, 5_000_000)  # 5 M rows in 60 KB
    groups = forged_images(tmp_path / "groups.parquet", 4_000_000, 1 << 20)  # each group under MAX_GROUP_ROWS
    arrow = forged_arrow(tmp_path / "batch.arrow", 5_000_000)
    paths = forged_paths(tmp_path / "list.parquet", 3_000_000)
    assert max(f.stat().st_size for f in (one_group, groups, arrow, paths)) < 1 << 20
    readers = {"hf": ("hf", str(one_group)), "hf_rows": ("hf", str(groups)), "hf_arrow": ("hf", str(arrow)),
               "parquet": ("parquet", str(one_group)), "parquet_rows": ("parquet", str(groups)),
               "list": ("list", str(paths)), "predict": ("predict", str(groups))}
    said, peak = run_child(readers, tmp_path)
    group_line = f"declares 5,000,000 rows in one row group, more than the {MAX_GROUP_ROWS:,} imgtrain reads at once"
    rows_line = f"groups.parquet declares 4,000,000 rows in {groups.stat().st_size:,} bytes, more than a table that " \
                f"size can honestly hold ({ROWS_ANY_SOURCE:,} rows of images): a forged or broken file"
    assert group_line in said["hf"] and group_line in said["parquet"], said
    assert "batch.arrow declares 5,000,000 rows in one record batch" in said["hf_arrow"], said
    assert rows_line in said["hf_rows"] and rows_line in said["parquet_rows"] and rows_line in said["predict"], said
    assert "list.parquet declares 3,000,000 rows" in said["list"] and "rows of image paths)" in said["list"], said
    assert peak < 400 << 20, f"peak RSS {peak >> 20} MiB"  # the imports take ~200 MB; the rows took GBs


def test_prepare_says_so_in_one_line(tmp_path, capsys):
    forged = forged_images(tmp_path / "t.parquet", 1_000_000, 1 << 20)
    proc = cli_here(capsys, "data", "prepare", "parquet", str(tmp_path / "out"), "--source", str(forged))
    assert_one_line_error(proc, "t.parquet declares 1,000,000 rows in", "a forged or broken file")


def test_the_bound_is_on_the_whole_source_not_each_file(tmp_path):
    """Files each under the rows any source may hold, together over it for their bytes."""
    from imgtrain.data.sources.parquet import list_parquet_images

    folder = tmp_path / "parts"
    folder.mkdir()
    for k in range(3):
        forged_images(folder / f"part-{k}.parquet", ROWS_ANY_SOURCE - 1, ROWS_ANY_SOURCE)
    with pytest.raises(ImgtrainError, match=r"part-1.parquet declares 65,535 rows in [\d,]+ bytes \(131,070 in "):
        list_parquet_images(folder, "image", "label")


def test_honest_tables_pass_at_the_bounds():
    rows = TableRows()
    rows.group(MAX_GROUP_ROWS, "a")
    rows.file(ROWS_ANY_SOURCE, 10, "a")  # blank test images: any source may hold this many
    rows.file(1_000_000 - ROWS_ANY_SOURCE, 4_000_000 - 10, "b")  # beyond it, one row per 4 bytes
    with pytest.raises(ImgtrainError, match="more than a table that size can honestly hold"):
        rows.file(10_000, 1_000, "c")
    with pytest.raises(ImgtrainError, match="in one row group"):
        TableRows().group(MAX_GROUP_ROWS + 1, "d")


def test_hf_reads_arrow_headers_as_pyarrow_wrote_them(tmp_path):
    """The batch lengths read from the headers alone, for both Arrow formats, compressed or
    not, with a dictionary column: the hf source lists every row."""
    from imgtrain.data.options import PrepareOptions
    from imgtrain.data.sources.hf import list_hf

    rows = 10
    table = pa.table({"image": pa.array([{"bytes": png_bytes(np.full((8, 8), 9 * k, np.uint8)), "path": None}
                                         for k in range(rows)], IMAGE_STRUCT),
                      "label": pa.array(["cat", "dog"] * (rows // 2)).dictionary_encode()})
    for new, compression in ((pa.ipc.new_stream, None), (pa.ipc.new_file, "zstd"), (pa.ipc.new_file, None)):
        path = tmp_path / f"{new.__name__}-{compression}.arrow"
        with pa.OSFile(str(path), "wb") as sink, new(sink, table.schema,
                                                    options=pa.ipc.IpcWriteOptions(compression=compression)) as writer:
            writer.write_table(table, max_chunksize=4)
        listing = list_hf(path, PrepareOptions())
        assert sorted(listing.ids.tolist()) == list(range(rows)) and listing.classes == ["cat", "dog"], path.name
        assert np.bincount(listing.labels).tolist() == [5, 5]


def test_predict_reads_a_big_row_group_a_slice_at_a_time(tmp_path):
    from imgtrain.inference.inputs import TASK_ROWS, list_inputs
    from tests.conftest_data_helpers import read_inputs_whole

    rows = 700
    images = [png_bytes(np.full((8, 8), k % 256, np.uint8)) if k % 7 else None for k in range(rows)]
    table = pa.table({"image": pa.array(images, pa.binary()), "id": pa.array(np.arange(rows) * 3),
                      "label": pa.array(np.arange(rows) % 5), "notes": pa.array(["x"] * rows)})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=600)
    tasks = list_inputs(str(tmp_path / "t.parquet")).tasks
    assert [t["count"] for t in tasks] == [TASK_ROWS, TASK_ROWS, 600 - 2 * TASK_ROWS, 100]
    read = read_inputs_whole(str(tmp_path / "t.parquet"), (8, 8, 1))
    assert read["_row"].tolist() == list(range(rows)) and read["id"].tolist() == list(range(0, 3 * rows, 3))
    usable = read["_error"] == ""
    assert usable.tolist() == [bool(k % 7) for k in range(rows)]
    assert read["image"][usable, 0, 0, 0].tolist() == [k % 256 for k in range(rows) if k % 7]
