"""What evaluate and report produce stays bounded by what is evaluated, not by the checkpoint's
class count: a copy of the session's finished local run (the report is written into it),
evaluated in this process (no Ray)."""

from __future__ import annotations

import json

import numpy as np
from PIL import Image

from imgtrain.inference import batch, report
from tests.conftest import copy_run


def test_evaluate_lists_the_pairs_that_occur_above_the_dense_bound_and_the_report_plots_the_worst(
        local_run, tmp_path, monkeypatch):
    run = copy_run(local_run, tmp_path) / local_run.name
    local = batch.InferenceOptions(backend="local")
    dense = batch.evaluate(str(run), options=local)
    assert np.asarray(dense.confusion_matrix).shape == (10, 10)  # 10 digits: as it always was
    assert np.sum(dense.confusion_matrix) == dense.num_samples == 100

    # The same run as if its 10 classes were past the bound (100,000 would need a 200 MB model).
    monkeypatch.setattr(batch, "DENSE_CONFUSION_MAX_CLASSES", 9)
    monkeypatch.setattr(report, "CONFUSED_CLASSES_SHOWN", 4)
    page = report.write_report(str(run))
    sparse = json.loads((page.parent / report.EVAL_FILE).read_text())["confusion_matrix"]
    assert sparse["shape"] == [10, 10]
    assert sparse["entries"] == [[t, p, n] for (t, p), n in np.ndenumerate(dense.confusion_matrix) if n]
    with Image.open(page.parent / "confusion_matrix.png") as image:  # 4 classes: a small plot
        assert image.size[0] < 700
