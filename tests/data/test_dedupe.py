"""`data prepare --dedupe`: the copy of a test image leaves train (the test copy stays), `all`
also drops the turned copy within train; the list beside the manifest, a data set that verifies."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from imgtrain.data.format import DEDUPE_FILE, verify_dataset
from imgtrain.data.inspection import inspect_dataset
from tests.conftest import assert_one_line_error, cli_here
from tests.conftest_data_helpers import read_back
from tests.data.planted import planted_photos


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """(source folder, {what: relative path}, {relative path: id})."""
    root = tmp_path_factory.mktemp("dedupe") / "photos"
    where = planted_photos(root)
    paths = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.png"))
    return root, where, {rel: k for k, rel in enumerate(paths)}


def prepare_cli(capsys, photos, out: Path, *flags: str):
    return cli_here(capsys, "data", "prepare", "folder", str(out), "--source", str(photos[0]), *flags)


def dropped_rows(data: Path) -> list[dict]:
    with open(data / DEDUPE_FILE, newline="") as f:
        return list(csv.DictReader(f))


def test_cross_split_drops_the_train_copy_keeps_the_test_copy_and_lists_it(photos, capsys, tmp_path):
    _, where, ids = photos
    result = prepare_cli(capsys, photos, tmp_path / "d", "--dedupe", "cross-split")
    assert result.returncode == 0, result.stderr
    manifest = verify_dataset(tmp_path / "d")  # counts and hashes consistent with what was written
    kept = read_back(tmp_path / "d")
    train, test = set(kept["train"][0].tolist()), set(kept["test"][0].tolist())
    assert ids[where["leak"]] not in train and ids[where["leaked"]] in test
    assert {ids[where["original"]], ids[where["turned"]]} <= train  # within a split: kept
    assert manifest["splits"]["train"]["num_samples"] == 45 and manifest["class_counts"]["train"] == [41, 4]
    assert manifest["dedupe"] == {"mode": "cross-split", "threshold": 4, "dropped": 1, "exact": 1, "near": 0,
                                  "file": DEDUPE_FILE, "by_split": {"train": 1, "val": 0, "test": 0}}
    assert dropped_rows(tmp_path / "d") == [{
        "dropped_id": str(ids[where["leak"]]), "dropped_name": where["leak"], "dropped_split": "train",
        "dropped_class": "big", "kept_id": str(ids[where["leaked"]]), "kept_name": where["leaked"], "kept_split": "test",
        "kept_class": "big",
        "kind": "exact", "distance": "0", "transform": "as is"}]
    assert f"dedupe cross-split: dropped 1 image(s) (1 exact, 0 near copies within 4 bits), listed in " \
           f"{tmp_path / 'd' / DEDUPE_FILE}" in result.stderr
    # what inspect finds in it: no duplicate across splits is left
    found = inspect_dataset(tmp_path / "d", tmp_path / "d.html")
    assert found["duplicates"]["counts"]["cross_split"] == {"exact": 0, "near": 0}
    assert found["dedupe"]["dropped"] == 1


def test_all_also_drops_the_turned_copy_within_train_and_a_dedupe_set_can_be_replaced_and_cleaned(photos, capsys,
                                                                                                    tmp_path):
    _, where, ids = photos
    result = prepare_cli(capsys, photos, tmp_path / "d", "--dedupe", "all", "--near-threshold", "2")
    assert result.returncode == 0, result.stderr
    manifest = verify_dataset(tmp_path / "d")
    rows = {row["dropped_name"]: row for row in dropped_rows(tmp_path / "d")}
    assert set(rows) == {where["leak"], where["turned"]}
    turned = rows[where["turned"]]  # source order: train/big/001.png stays, train/big/turned.png goes
    assert turned["kept_name"] == where["original"] and turned["kind"] == "near"
    assert turned["transform"] in ("rotated 90°", "rotated 270°") and int(turned["distance"]) <= 2
    assert manifest["dedupe"]["dropped"] == 2 and manifest["dedupe"]["threshold"] == 2
    assert ids[where["turned"]] not in set(read_back(tmp_path / "d")["train"][0].tolist())
    # the list is the data set's own file: --overwrite replaces it, clean deletes it
    again = prepare_cli(capsys, photos, tmp_path / "d", "--overwrite")
    assert again.returncode == 0, again.stderr
    assert not (tmp_path / "d" / DEDUPE_FILE).exists() and "dedupe" not in json.loads((tmp_path / "d/manifest.json").read_text())
    from imgtrain.commands.clean import plan_dataset

    prepare_cli(capsys, photos, tmp_path / "d", "--overwrite", "--dedupe", "all")
    assert tmp_path / "d" / DEDUPE_FILE in plan_dataset(tmp_path / "d").files


@pytest.mark.parametrize("args, fragment", [
    (["folder", "{out}", "--source", "{src}", "--dedupe", "train"], "--dedupe must be one of off, cross-split, all"),
    (["folder", "{out}", "--source", "{src}", "--near-threshold", "2"], "--near-threshold applies to --dedupe"),
    (["mnist-sample", "{out}", "--dedupe", "cross-split"], "--dedupe works on sources of PNG/JPEG images"),
])
def test_bad_input_is_one_line(photos, capsys, tmp_path, args, fragment):
    filled = [a.format(out=tmp_path / "out", src=photos[0]) for a in args]
    assert_one_line_error(cli_here(capsys, "data", "prepare", *filled), fragment)
    assert not (tmp_path / "out").exists()


def test_dedupe_csv_quotes_names_a_spreadsheet_would_run_as_formulas(capsys, tmp_path):
    """Class folders and files named =..., +..., -..., @...: each a copy of another image."""
    from tests.data.planted import photo

    rng = np.random.default_rng(0)
    copies = {"=eq": "=1+2.png", "+plus": "+sum.png", "-minus": "-x.png", "@at": "@home.png"}
    for name, copy in copies.items():
        (tmp_path / "src" / name).mkdir(parents=True)
        for i in range(4):
            photo(rng).save(tmp_path / "src" / name / f"{i}.png")
        (tmp_path / "src" / name / copy).write_bytes((tmp_path / "src" / name / "0.png").read_bytes())
    result = cli_here(capsys, "data", "prepare", "folder", str(tmp_path / "d"), "--source", str(tmp_path / "src"),
                      "--dedupe", "all")
    assert result.returncode == 0, result.stderr
    rows = dropped_rows(tmp_path / "d")
    assert len(rows) == 4
    for row in rows:
        for column in ("dropped_name", "dropped_class", "kept_name", "kept_class"):
            assert row[column][0] == "'" and row[column][1] in "=+-@", (column, row)  # text, not a formula
        assert row["dropped_class"][1:] in copies and row["dropped_name"][1:].startswith(row["dropped_class"][1:] + "/")
    assert {row["dropped_name"][1:].split("/")[1] for row in rows} | {row["kept_name"][1:].split("/")[1]
                                                                       for row in rows} >= set(copies.values())
