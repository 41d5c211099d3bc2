"""The run report for real: a copy of the session's finished local run (the report is written
into the run), the real ``imgtrain report`` command, and the page rendered by headless Chromium
(screenshot and DOM)."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import re
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image

import imgtrain
from imgtrain.inference import report
from imgtrain.storage import checkpoint as ckpt
from imgtrain.storage import runs
from tests.browser import chromium
from tests.conftest import cli_here, copy_run, quiet_display
from tests.conftest import tiny_config as shared_tiny_config

pytestmark = pytest.mark.integration

QUIET = quiet_display()
PLOTS = {  # element id -> file in report/
    "learning-curves": "learning_curves.png",
    "predictions-grid": "predictions_grid.png",
    "confusion-matrix": "confusion_matrix.png",
    "confident-errors": "confident_errors.png",
    "confident-errors-maps": "confident_errors_maps.png",
    "reliability-diagram": "reliability_diagram.png",
    "label-issues": "label_issues.png",
}
TABLE_IDS = ("summary", "metrics-table", "config-table", "averages-table", "per-class-table", "checkpoints-table",
             "label-issues-table")


def tiny_config(data, storage, name, **overrides):
    return shared_tiny_config(data, storage, name, **{"backend": "local", "workers": 1, "log_every_steps": 10, **overrides})


@pytest.fixture(scope="module")
def trained(local_run, tmp_path_factory):
    """(storage, result) of a copy of ``local_run``: 2 epochs on the local backend."""
    storage = copy_run(local_run, tmp_path_factory.mktemp("report-runs"))
    result = runs.load_run(str(storage), local_run.name)
    assert result.status == "finished" and len(result.history) == 2
    return storage, result


def cli_in_fixture(*args: str) -> subprocess.CompletedProcess:
    """``cli_here`` for a module fixture, which has no capsys: the output caught by redirection."""
    out, err = io.StringIO(), io.StringIO()

    class Caught:  # what cli_here reads the output back from
        def readouterr(self):
            return out.getvalue(), err.getvalue()

    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        return cli_here(Caught(), *args)


@pytest.fixture(scope="module")
def page(trained) -> Path:
    """The page written by the real CLI."""
    storage, result = trained
    proc = cli_in_fixture("report", result.name, "--storage", str(storage))
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 2 and lines[1].startswith("report: "), proc.stdout
    figures = json.loads((result.path / report.REPORT_DIR / report.EVAL_FILE).read_text())
    # the figure the page shows, where a terminal (make demo's last lines) sees it
    assert lines[0] == f"test accuracy {figures['accuracy']:.2%} on {figures['num_samples']:,} images, " \
                       f"{Path(figures['checkpoint']).name}"
    printed = Path(lines[1].removeprefix("report: "))
    assert printed == result.path / report.REPORT_DIR / report.PAGE_FILE
    assert printed.is_file()
    return printed


class PageParser(HTMLParser):
    """Every element id, every src/href, each <img> and the body rows of each table by id."""

    def __init__(self):
        super().__init__()
        self.ids, self.urls, self.images, self.rows, self.tags = set(), [], {}, {}, set()
        self._table, self._in_body = None, False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.add(tag)
        if "id" in a:
            self.ids.add(a["id"])
        self.urls += [a[k] for k in ("src", "href") if a.get(k)]
        if tag == "img":
            self.images[a.get("id")] = a.get("src", "")
        elif tag == "table":
            self._table = a.get("id")
            self.rows[self._table] = 0
        elif tag == "tbody":
            self._in_body = True
        elif tag == "tr" and self._in_body:
            self.rows[self._table] += 1

    def handle_endtag(self, tag):
        if tag == "tbody":
            self._in_body = False


def parse(text: str) -> PageParser:
    parser = PageParser()
    parser.feed(text)
    return parser


def png_from_data_uri(src: str) -> Image.Image:
    prefix = "data:image/png;base64,"
    assert src.startswith(prefix), src[:60]
    return Image.open(io.BytesIO(base64.b64decode(src[len(prefix):], validate=True)))


def assert_nontrivial_png(image: Image.Image, min_w=300, min_h=200) -> None:
    assert image.format == "PNG"
    assert image.width >= min_w and image.height >= min_h, image.size
    colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 50, "an almost blank image"


def test_cli_writes_the_plots_and_the_evaluation(trained, page):
    _, result = trained
    out = page.parent
    for file in PLOTS.values():
        with Image.open(out / file) as image:
            assert_nontrivial_png(image)

    ev = json.loads((out / report.EVAL_FILE).read_text())
    # The best checkpoint (num_to_keep=1 keeps the best and the latest, which may differ).
    assert Path(ev["checkpoint"]) == result.best_checkpoint
    meta = ckpt.read_meta(result.best_checkpoint)
    recorded = next(r for r in result.history if r["checkpoint"] == result.best_checkpoint.name)
    # Re-evaluated in this process, the saved weights score what training measured.
    assert ev["accuracy"] == pytest.approx(meta["metrics"]["val_accuracy"], abs=1e-9)
    assert ev["accuracy"] == pytest.approx(recorded["val_accuracy"], abs=1e-9)
    assert ev["recorded_val_accuracy"] == meta["metrics"]["val_accuracy"]
    assert ev["num_samples"] == 100 and np.asarray(ev["confusion_matrix"]).sum() == 100
    assert sorted(ev["per_class"]) == [str(d) for d in range(10)]
    assert 0 < ev["top5_accuracy"] <= 1 and ev["top5_accuracy"] >= ev["accuracy"]  # 10 classes: given
    assert set(ev["macro_avg"]) == set(ev["weighted_avg"]) == {"precision", "recall", "f1"}
    assert len(ev["calibration"]) == 15 and sum(b["count"] for b in ev["calibration"]) == 100
    assert 0 <= ev["ece"] <= 1 and ev["tta"] == "none"
    issues = ev["label_issues"]  # the training images the model disagrees with, as evaluate finds them
    assert issues["scanned"] == issues["of"] == 256 and 0 < len(issues["issues"]) <= 16
    again = imgtrain.evaluate(str(result.path), options=imgtrain.InferenceOptions(backend="local"), label_issues=16)
    assert again.to_json()["label_issues"] == issues


def test_page_is_self_contained_and_complete(trained, page):
    _, result = trained
    text = page.read_text()
    doc = parse(text)
    assert not [u for u in doc.urls if re.match(r"\s*(https?:)?//", u, re.I)]
    assert not re.search(r"url\(|@import|https?://", text, re.I), "a reference to an outside resource"
    assert "script" not in doc.tags
    assert set(PLOTS) | set(TABLE_IDS) <= doc.ids
    for plot_id, file in PLOTS.items():  # the embedded image is the file written beside the page
        assert doc.images[plot_id] == "data:image/png;base64," + base64.b64encode(
            (page.parent / file).read_bytes()).decode()
    assert doc.rows["metrics-table"] == 2
    assert doc.rows["per-class-table"] == 10
    assert doc.rows["averages-table"] == 2  # macro and weighted
    assert doc.rows["checkpoints-table"] == len(ckpt.listing(result.path))
    assert doc.rows["config-table"] == len(result.config)
    assert f"<h1>imgtrain report: {result.name}</h1>" in text
    assert result.best_checkpoint.name in text


def headless(page: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    # Own profile directory: another Chromium running on the machine cannot lock this one out.
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           f"--user-data-dir={tmp_path / 'profile'}", *args, page.as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def test_chromium_renders_the_plots(page, tmp_path):
    shot = tmp_path / "shot.png"
    headless(page, tmp_path, f"--screenshot={shot}", "--window-size=1280,4000", "--hide-scrollbars")
    assert shot.is_file() and shot.stat().st_size > 50_000
    with Image.open(shot) as image:
        assert image.size == (1280, 4000)
        rgb = np.asarray(image.convert("RGB"))
    colours = np.unique(rgb.reshape(-1, 3), axis=0)
    assert len(colours) > 1000, "the screenshot is (almost) one colour"
    # The digits' black backgrounds: 16 in the grid and 16 errors, about 100x100 px each. Text
    # alone (the page without its images) has a small fraction of this.
    assert (rgb.max(axis=2) < 20).sum() > 150_000


def test_chromium_dom_holds_every_plot(page, tmp_path):
    proc = headless(page, tmp_path, "--dump-dom")
    dom = parse(proc.stdout)
    for plot_id in PLOTS:
        assert plot_id in dom.images, f"no <img id={plot_id}> in the rendered DOM"
        assert_nontrivial_png(png_from_data_uri(dom.images[plot_id]))
    assert "metrics-table" in dom.ids and "config-table" in dom.ids


def test_one_epoch_run_still_plots(tiny_data, tmp_path):
    result = imgtrain.train(tiny_config(tiny_data, tmp_path, "one", epochs=1, limit_train_batches=2),
                            display=QUIET)
    page = report.write_report(str(result.path), checkpoint="latest")  # a run directory, not a name
    assert page == result.path / "report" / "report.html"
    with Image.open(page.parent / PLOTS["learning-curves"]) as image:
        assert_nontrivial_png(image)
    doc = parse(page.read_text())
    assert doc.rows["metrics-table"] == 1 and doc.rows["checkpoints-table"] == 1


def test_no_errors_draws_a_no_errors_image(tmp_path):
    path = tmp_path / "errors.png"
    none = pd.DataFrame({"label": [], "pred_index": [], "pred_class": [], "confidence": []})
    report._image_grid(np.zeros((0, 28, 28, 1), np.uint8), none, [str(d) for d in range(10)], path, True)
    with Image.open(path) as image:
        assert_nontrivial_png(image, min_w=300, min_h=100)


def one_line_error(proc) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stdout + proc.stderr
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error:"), err
    return err


def test_a_few_errors_get_a_box_their_size(tmp_path):
    """Two errors were drawn in the 4x4 grid's 800x880 px box, 14 cells of it blank."""
    sizes = {}
    for n in (2, 5, 16, 40):
        rows = pd.DataFrame({"label": np.zeros(n, int), "pred_index": np.ones(n, int), "pred_class": ["1"] * n,
                             "confidence": np.linspace(0.9, 0.5, n)})
        report._image_grid(np.zeros((n, 28, 28, 1), np.uint8), rows, [str(d) for d in range(10)],
                           tmp_path / f"{n}.png", True)
        with Image.open(tmp_path / f"{n}.png") as image:
            sizes[n] = image.size
    width, height = sizes[16]  # the whole grid: 4 x 4 cells
    assert sizes[40] == sizes[16]  # at most 16 shown
    assert sizes[2] == (width // 2, height // 4)  # one row of two
    assert sizes[5] == (width, height // 2)  # a row of four and one of one


def test_at_1200_px_every_table_keeps_to_the_page(page, tmp_path):
    """The per-epoch metrics table ran 3 px past a 1,200 px wide window (long headers, no margin);
    a long path or config value, further."""
    from tests.browser import BrowserPage

    browser = BrowserPage(page.as_uri(), tmp_path / "profile", size=(1200, 900))
    try:
        browser.wait_loaded()
        width = browser.js("document.documentElement.clientWidth")
        assert width >= 1150  # the window is as wide as asked (less a scroll bar)
        assert browser.js("document.documentElement.scrollWidth") <= width  # no sideways scrolling
        boxes = browser.js("[...document.querySelectorAll('table')].map(t => [t.id, t.getBoundingClientRect().right, "
                           "t.parentElement.scrollWidth > t.parentElement.clientWidth])")
        assert {t for t, _, _ in boxes} >= set(TABLE_IDS)
        for table, right, scrolls in boxes:
            assert right <= width and not scrolls, (table, right, width)  # fits: wraps, never cut
        browser.screenshot(tmp_path / "report-1200.png")
    finally:
        browser.close()


def test_unknown_run_is_one_line_naming_it(trained, capsys):
    storage, result = trained
    err = one_line_error(cli_here(capsys, "report", "nope", "--storage", str(storage)))
    assert "no run named 'nope'" in err and f"runs there: {result.name}" in err  # and the runs that do exist


def test_run_without_checkpoint_says_train_it_first(tmp_path, capsys):
    run_dir = tmp_path / "runs" / "empty"
    run_dir.mkdir(parents=True)
    runs.write_config(run_dir, tiny_config("data", tmp_path / "runs", "empty").to_dict())
    err = one_line_error(cli_here(capsys, "report", str(run_dir)))
    assert "'empty'" in err and "train it first" in err
    assert not (run_dir / "report").exists()
