"""`imgtrain data inspect`: the planted problems of a real prepared folder of photos (a test image
copied into train, a turned copy, a 10x imbalance) in the JSON and on the page, in a real Chromium."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from imgtrain.data.options import PrepareOptions
from imgtrain.data.prepare import prepare
from tests.browser import BrowserPage
from tests.conftest import assert_one_line_error, cli_here
from tests.data.planted import planted_photos


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """(prepared data set, {what: id}) of the planted folder; ids are the sorted paths' positions."""
    root = tmp_path_factory.mktemp("planted")
    where = planted_photos(root / "photos")
    prepare("folder", root / "pets", root / "photos", PrepareOptions())
    paths = sorted(p.relative_to(root / "photos").as_posix() for p in (root / "photos").rglob("*.png"))
    return root / "pets", {what: paths.index(rel) for what, rel in where.items()}


def run_inspect(capsys, *args: str) -> dict:
    result = cli_here(capsys, "data", "inspect", *args, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def pair_ids(found: dict) -> dict[tuple, dict]:
    return {(p["a"]["split"], p["a"]["id"], p["b"]["split"], p["b"]["id"]): p for p in found["duplicates"]["pairs"]}


def test_inspect_finds_the_leaked_test_image_the_turned_copy_and_the_imbalance(planted, capsys, tmp_path):
    data, ids = planted
    found = run_inspect(capsys, str(data), "--out", str(tmp_path / "page.html"))
    pairs = pair_ids(found)
    leak = pairs[("test", ids["leaked"], "train", ids["leak"])]
    assert leak["kind"] == "exact" and leak["cross_split"] and leak["same_label"]
    turned = pairs[("train", ids["original"], "train", ids["turned"])]
    assert turned["kind"] == "near" and turned["transform"] in ("rotated 90°", "rotated 270°")
    assert turned["distance"] <= found["duplicates"]["threshold"] == 4
    assert len(pairs) == 2  # nothing else: unrelated photos are ~30 bits apart
    assert list(pairs.values())[0] == leak  # across splits first
    counts = found["duplicates"]["counts"]
    assert counts == {"cross_split": {"exact": 1, "near": 0}, "within_split": {"exact": 0, "near": 1}}
    groups = found["duplicates"]["groups"]  # the two pairs are two groups, the one across splits first
    assert found["duplicates"]["groups_total"] == 2 and found["duplicates"]["largest_group"] == 2
    assert groups[0]["cross_split"] and groups[0]["splits"] == {"train": 1, "test": 1}
    assert [(i["split"], i["id"]) for i in groups[0]["first"]] == [("test", ids["leaked"]), ("train", ids["leak"])]
    assert not groups[1]["cross_split"] and groups[1]["images"] == 2 and groups[1]["classes"] == 1
    imbalance = found["imbalance"]
    assert imbalance["flagged"] and imbalance["ratio"] == 10.5
    assert imbalance["largest"] == {"class": "big", "images": 42} and imbalance["smallest"]["class"] == "small"
    assert found["splits"]["train"]["per_class"] == [42, 4] and found["splits"]["test"]["per_class"] == [6, 3]
    assert found["modes"] == {"RGB": 55} and not found["mode_mix"]
    assert found["sizes"]["one_size"] and found["sizes"]["width"]["median"] == 48
    assert Path(found["page"]) == tmp_path / "page.html" and (tmp_path / "page.html").stat().st_size > 10_000


@pytest.mark.integration  # a browser process
def test_the_page_shows_the_planted_problems_with_its_images_in_chromium(planted, capsys, tmp_path):
    data, ids = planted
    found = run_inspect(capsys, str(data), "--out", str(tmp_path / "page.html"))
    page = BrowserPage(Path(found["page"]).as_uri(), tmp_path / "profile", size=(1200, 1800))
    try:
        page.wait_loaded()
        sizes = page.js("[...document.images].map(i => [i.complete, i.naturalWidth])")
        pairs = page.js("[...document.querySelectorAll('#pairs .pair')].map(p => ({...p.dataset, "
                        "text: p.innerText, cross: p.classList.contains('cross')}))")
        imbalance = page.js("(() => { const p = document.getElementById('imbalance'); "
                            "return [p.className, p.innerText, getComputedStyle(p).backgroundColor]; })()")
        samples = page.js("[...document.querySelectorAll('#samples .samples')].map(d => [d.dataset.class, "
                          "d.querySelectorAll('img').length])")
        shot = page.screenshot(tmp_path / "page.png")
    finally:
        page.close()
    assert len(sizes) == 6 + 4 + 4 and all(done and width > 0 for done, width in sizes)  # samples, two pairs
    leak, turned = pairs
    assert leak["cross"] and leak["a"] == f"test:{ids['leaked']}" and leak["b"] == f"train:{ids['leak']}"
    assert "exact duplicate" in leak["text"] and "across splits" in leak["text"]
    assert turned["a"] == f"train:{ids['original']}" and turned["b"] == f"train:{ids['turned']}"
    assert turned["transform"] in ("rotated 90°", "rotated 270°") and turned["transform"] in turned["text"]
    assert imbalance[0] == "flag" and "10.5x" in imbalance[1] and imbalance[2] != "rgba(0, 0, 0, 0)"
    assert samples == [["big", 6], ["small", 4]]
    from PIL import Image

    colours = np.unique(np.asarray(Image.open(shot).convert("RGB")).reshape(-1, 3), axis=0)
    assert len(colours) > 200  # a rendered page with its photos, not a blank one


def test_pixel_tensors_get_their_shape_exact_copies_and_the_digits_threshold(capsys, tmp_path):
    from imgtrain.data.writer import write_dataset
    from tests.conftest_data_helpers import tiny_raw

    raw = tiny_raw(n_train=40, n_test=20, shape=(8, 8, 1))
    raw.test.images[3] = raw.train.images[7]
    write_dataset(raw, tmp_path / "digits", name="digits", source="test")
    found = run_inspect(capsys, str(tmp_path / "digits"), "--out", str(tmp_path / "d.html"))
    assert found["sizes"]["fixed_shape"] == [8, 8, 1] and found["modes"] == {"L": 60}
    assert found["duplicates"]["threshold"] == 0 and "grayscale" in found["duplicates"]["threshold_rule"]
    leak = found["duplicates"]["pairs"][0]
    assert leak["kind"] == "exact" and (leak["a"]["id"], leak["b"]["id"]) == (int(raw.test.ids[3]), int(raw.train.ids[7]))


def test_the_page_goes_to_the_current_folder_by_default_and_the_terminal_gets_a_summary(planted, capsys, tmp_path,
                                                                                         monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = cli_here(capsys, "data", "inspect", str(planted[0]), "--near-threshold", "0")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "pets-inspect.html").is_file()
    assert "across splits 1 exact, 0 near; within a split 0 exact, 1 near" in result.stdout  # a turned copy is 0 bits off
    assert "10.5x (imbalanced)" in result.stdout and f"page: {tmp_path / 'pets-inspect.html'}" in result.stdout


@pytest.mark.parametrize("args, fragment", [
    (["{tmp}"], "not a prepared data set"),
    (["{data}", "--near-threshold", "9"], "--near-threshold must be a whole number of bits from 0 to 8"),
    (["{data}", "--out", "{tmp}"], "is a folder"),
])
def test_bad_input_is_one_line(planted, capsys, tmp_path, args, fragment):
    filled = [a.format(tmp=tmp_path, data=planted[0]) for a in args]
    assert_one_line_error(cli_here(capsys, "data", "inspect", *filled), fragment)


def test_many_images_with_one_phash_are_counted_grouped_and_shown_by_a_few(capsys, tmp_path):
    """40 photos that differ in one pixel's blue by 1 (other bytes, the same gray copy, so one
    pHash): 780 pairs, one group."""
    from imgtrain.data.writer import write_dataset
    from tests.conftest_data_helpers import tiny_raw
    from tests.data.planted import photo

    raw = tiny_raw(n_train=30, n_test=10, shape=(48, 48, 3), k=2)
    from PIL import Image

    base = np.minimum(np.asarray(photo(np.random.default_rng(0))), 254)
    bluer = base.copy()
    bluer[..., 2] += 1
    gray = [np.asarray(Image.fromarray(im).convert("L")) for im in (base, bluer)]
    spots = np.flatnonzero(gray[0] == gray[1])  # pixels whose gray value a bluer blue leaves alone
    for k, images in enumerate([raw.train.images, raw.test.images]):
        images[:] = base
        at = spots[np.arange(len(images)) + 30 * k]
        images[np.arange(len(images)), at // 48, at % 48, 2] += 1  # each its own bytes
    write_dataset(raw, tmp_path / "same", name="same", source="test")
    found = run_inspect(capsys, str(tmp_path / "same"), "--out", str(tmp_path / "same.html"))
    d = found["duplicates"]
    assert d["counts"] == {"cross_split": {"exact": 0, "near": 300}, "within_split": {"exact": 0, "near": 435 + 45}}
    assert d["pairs_total"] == 780 and d["different_labels"] == 780 - (15 * 14 + 5 * 4) - 15 * 5 * 2
    assert d["groups_total"] == 1 and d["largest_group"] == d["images_involved"] == 40
    assert d["groups"][0]["splits"] == {"train": 30, "test": 10} and d["groups"][0]["classes"] == 2
    assert [i["split"] for i in d["groups"][0]["first"]] == ["test"] * 10  # test first, then by id
    assert d["pairs_listed"] == 16 * 15 // 2  # the pairs of 16 of them: both splits, both labels
    shown = {(p[side]["split"], p[side]["label"]) for p in d["pairs"] for side in "ab"}
    assert shown == {("train", 0), ("train", 1), ("test", 0), ("test", 1)} and d["pairs"][0]["cross_split"]
    page = (tmp_path / "same.html").read_text()
    assert "40 image(s) in 1 group(s) of duplicates (the largest: 40 images)" in page
    assert "720 more pair(s) not shown; --json lists 120 of them and the groups" in page


def test_duplicates_are_named_by_their_files_in_the_json_and_on_the_page(planted, capsys, tmp_path):
    """They were named by row id only ("test · id 17"), which tells a user nothing of which file to delete."""
    data, ids = planted
    photos = data.parent / "photos"
    paths = sorted(p.relative_to(photos).as_posix() for p in photos.rglob("*.png"))  # by id, as prepare lists them
    found = run_inspect(capsys, str(data), "--out", str(tmp_path / "page.html"))
    named = {(p["a"]["name"], p["b"]["name"]) for p in found["duplicates"]["pairs"]}
    assert named == {(paths[ids["leaked"]], paths[ids["leak"]]), (paths[ids["original"]], paths[ids["turned"]])}
    page = BrowserPage(Path(found["page"]).as_uri(), tmp_path / "profile", size=(1200, 1800))
    try:
        page.wait_loaded()
        captions = page.js("[...document.querySelectorAll('#pairs figcaption')].map(f => f.innerText)")
        overflowing = page.js("[...document.querySelectorAll('#pairs .pair')].filter(p => p.scrollWidth > "
                              "p.clientWidth).length")
    finally:
        page.close()
    assert [c.split("\n")[0] for c in captions] == [
        f"test · {paths[ids['leaked']]}", f"train · {paths[ids['leak']]}",
        f"train · {paths[ids['original']]}", f"train · {paths[ids['turned']]}"], captions
    assert overflowing == 0

    from imgtrain.data.writer import write_dataset
    from tests.conftest_data_helpers import tiny_raw

    raw = tiny_raw(n_train=40, n_test=20, shape=(8, 8, 1))  # pixel tensors: no file behind an image
    raw.test.images[3] = raw.train.images[7]
    write_dataset(raw, tmp_path / "digits", name="digits", source="test")
    leak = run_inspect(capsys, str(tmp_path / "digits"), "--out", str(tmp_path / "d.html"))["duplicates"]["pairs"][0]
    assert leak["a"]["name"] is None and f">id {leak['a']['id']}</span>" in (tmp_path / "d.html").read_text()


def test_the_names_file_is_a_data_set_file_read_as_untrusted_input(planted, capsys, tmp_path, monkeypatch):
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    from imgtrain.data import row_names

    data, ids = planted
    names = pq.ParquetFile(data / "sources.parquet")
    assert names.metadata.num_rows == 55 and names.schema_arrow.equals(row_names.SCHEMA)
    monkeypatch.setattr(row_names, "BUFFER_ROWS", 8)  # written a few rows at a time, not held whole
    monkeypatch.setattr("imgtrain.data.listing.CHUNK_FILES", 4)
    copy = tmp_path / "pets"
    prepare("folder", copy, data.parent / "photos", PrepareOptions())
    written = pq.ParquetFile(copy / "sources.parquet").metadata
    groups = [written.row_group(g).num_rows for g in range(written.num_row_groups)]
    assert sum(groups) == 55 and len(groups) > 1 and max(groups) <= 8 + 4  # a buffer and a chunk at most
    prepare("folder", copy, data.parent / "photos", PrepareOptions(overwrite=True))  # the data set's own file
    shutil.copytree(data, tmp_path / "odd")
    pq.write_table(pa.table({"id": [ids["leaked"]], "name": [7]}), tmp_path / "odd" / "sources.parquet")  # not names
    found = run_inspect(capsys, str(tmp_path / "odd"), "--out", str(tmp_path / "odd.html"))
    assert all(p["a"]["name"] is None for p in found["duplicates"]["pairs"])  # by id, as before the file existed
