"""The run report: plots and one self-contained HTML page in ``{run_dir}/report/``.

    write_report("demo")  ->  runs/demo/report/report.html, beside
        learning_curves.png    train / val loss and accuracy (and val macro F1 when recorded) per epoch
        predictions_grid.png   16 test images with true and predicted class, mistakes in red
        confusion_matrix.png   counts, rows = true class, columns = predicted class
        confident_errors.png   the test images the model got wrong most confidently
        confident_errors_maps.png  the same, each with where the model looked (Grad-CAM of its predicted class)
        reliability_diagram.png  accuracy against confidence in 15 bins, with the calibration error
        evaluation.json        the re-evaluation of the checkpoint (``imgtrain evaluate --json``)

The checkpoint is evaluated again in this process (no Ray: 1,000 MNIST digits take seconds),
so the page shows what the saved weights really do, next to what training recorded.
The page embeds its images as data URIs and its CSS inline: it can be mailed, attached to a
ticket or opened offline, and it needs no JavaScript.
"""

from __future__ import annotations

import base64
import html
import json
import time
from pathlib import Path

import numpy as np

from imgtrain.errors import ImgtrainError
from imgtrain.inference.options import ReportOptions
from imgtrain.ops import remote
from imgtrain.ops.files import atomic_write_text
from imgtrain.storage import checkpoint as ckpt
from imgtrain.storage import location, mirror, runs

REPORT_DIR = "report"
PAGE_FILE = "report.html"
EVAL_FILE = "evaluation.json"
GRID_SIDE = 4  # the tutorial shows 3x3; 4x4 shows more mistakes at the same glance
WRONG = "#c62828"
RIGHT = "#2e7d32"
DPI = 100
# Above batch.DENSE_CONFUSION_MAX_CLASSES the confusion plot shows this many classes, those with the
# most errors: all of them would be a K x K image (100,000 classes: 80 GB), unreadable long before.
CONFUSED_CLASSES_SHOWN = 30

# (id, file, caption). The ids are a stable contract: tests and links use them.
PLOTS = (
    ("learning-curves", "learning_curves.png",
     "Loss and accuracy per epoch, as recorded during training (validation = the {split} split)."),
    ("predictions-grid", "predictions_grid.png",
     "The first 16 test images (stored in seeded random order) with true and predicted class; "
     "mistakes in red."),
    ("confusion-matrix", "confusion_matrix.png",
     "Test-set confusion matrix: rows are the true class, columns the predicted class."),
    ("confident-errors", "confident_errors.png",
     "The misclassified test images the model was most confident about."),
    ("confident-errors-maps", "confident_errors_maps.png",
     "Where the model looked for each of them: the Grad-CAM map of the class it predicted over the image it saw "
     "(red: the strongest evidence for that class; docs/inference.md, Explanations)."),
    ("label-issues", "label_issues.png",
     "Training images whose label deserves a second look: the model confidently predicts another class "
     "(label_issues.py says the rule); the title gives the label and the model's answer."),
    ("reliability-diagram", "reliability_diagram.png",
     "Reliability diagram: the accuracy of the test images in each of 15 equal-width confidence bins "
     "(confidence: the predicted class's probability) against the diagonal of perfect calibration; below, "
     "how many images fall in each bin. The expected calibration error (ECE) is the mean gap, weighted by "
     "the bins' counts."),
)


def write_report(run, checkpoint: str = ReportOptions.checkpoint, storage: str = ReportOptions.storage) -> Path:
    """Write the plots, ``evaluation.json`` and ``report.html`` for ``run`` (a run name in
    ``storage`` or a run directory); return the page's path."""
    from imgtrain.data import stream
    from imgtrain.inference.batch import InferenceOptions, evaluate
    from imgtrain.inference.predictor import preprocess_preset

    run_dir = runs.locate(run, storage)
    result = runs.load_run(str(run_dir.parent), run_dir.name)
    if checkpoint in ckpt.CHOICES and result.best_checkpoint is None:
        raise ImgtrainError(
            f"run {result.name!r} has no complete checkpoint yet ({result.path}); train it first"
        )
    if _multi_label_run(result, checkpoint):
        return _write_multi_label_report(result, run_dir, checkpoint, storage)
    ev = evaluate(str(result.path), checkpoint, storage, options=InferenceOptions(backend="local"),
                  label_issues=GRID_SIDE**2)
    preds = ev.predictions.reset_index(drop=True)  # one row per image: id, label, pred_index, confidence
    n = GRID_SIDE**2
    wrong = preds[preds["pred_index"] != preds["label"]]
    worst = wrong.sort_values("confidence", ascending=False, kind="stable").iloc[:n]
    # Only the images shown are fetched (as the model saw them), matched by id, not position.
    pictures = stream.fetch_images(ev.data, ev.split, set(preds["id"].iloc[:n]) | set(worst["id"]),
                                   preset=preprocess_preset(Path(ev.checkpoint)))

    out, used, used_meta, in_store, where = _page_place(result, run_dir, storage, ev)
    png = {plot_id: out / file for plot_id, file, _ in PLOTS}
    _learning_curves(result.history, used_meta.get("epoch"), png["learning-curves"])
    first = preds.iloc[:n]
    _image_grid(_stack(pictures, first), first, ev.classes, png["predictions-grid"], with_confidence=False)
    _confusion_plot(ev.confusion, ev.classes, png["confusion-matrix"])
    _image_grid(_stack(pictures, worst), worst, ev.classes, png["confident-errors"], with_confidence=True)
    _confident_error_maps(ev, _stack(pictures, worst), worst, png["confident-errors-maps"])
    _reliability_diagram(ev.calibration, ev.ece, png["reliability-diagram"])
    _label_issues(ev, png["label-issues"])
    shown = {"checkpoint": _located(used, result.path, where), "data": _data_location(ev, used_meta)}
    atomic_write_text(out / EVAL_FILE, json.dumps({**ev.to_json(), **shown}, indent=2))

    page = out / PAGE_FILE
    atomic_write_text(page, _page(result, ev, used, used_meta, out, num_wrong=len(wrong), where=where))
    if in_store:
        mirror.push(location.store(storage), run_dir.name, under=REPORT_DIR)
    return page


def _label_issues(ev, path: Path) -> None:
    """Draw the training images evaluate found worth a second look, as the model saw them."""
    from imgtrain.data import stream
    from imgtrain.inference.label_issues import issue_rows
    from imgtrain.inference.predictor import preprocess_preset

    rows = issue_rows(ev.label_issues, ev.classes)
    pictures = stream.fetch_images(ev.data, "train", set(rows["id"]), preset=preprocess_preset(Path(ev.checkpoint)))
    _image_grid(_stack(pictures, rows), rows, ev.classes, path, with_confidence=True, given="labelled",
                empty="No training image contradicts its label confidently: nothing to show.")


def _confident_error_maps(ev, images: np.ndarray, rows, path: Path) -> None:
    """The confident errors again, each with the Grad-CAM map of the class the model predicted
    over it (``explain.py``), in the same grid and order."""
    from imgtrain.inference.explain import Explainer, overlay
    from imgtrain.inference.predictor import load_checkpoint

    empty = "No misclassified test images: no map to show."
    if len(rows):
        try:
            maps = Explainer(load_checkpoint(ev.checkpoint)).maps(images, rows["pred_index"].to_numpy())
            images = np.stack([overlay(image, cam) for image, cam in zip(images, maps)])
        except ImgtrainError as e:  # a model with no map to place: said in the picture, the page still written
            images, rows, empty = images[:0], rows.iloc[:0], f"No maps: {e}"
    _image_grid(images, rows, ev.classes, path, with_confidence=True, empty=empty)


def _page_place(result, run_dir: Path, storage, ev) -> tuple[Path, Path, dict, bool, str]:
    """The report's folder (made), the checkpoint evaluated and its meta, whether the run lives in
    the object store, and the run as its user names it (the s3:// URI of a run in an object
    store), not its working copy in this machine's cache: that path holds this user's name, and
    the page is uploaded."""
    out = result.path / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    used = Path(ev.checkpoint)
    in_store = remote.is_remote(storage) and run_dir.parent == location.storage_root(storage)
    where = location.location(storage, run_dir.name) if in_store else str(result.path)
    return out, used, ckpt.read_meta(used), in_store, where


def _located(path: Path, run_dir: Path, where: str) -> str:
    """``path`` as the run's user names it: by its place in the run's location ``where`` when it
    lies in the run, else as given (a path of the user's own, such as --checkpoint PATH)."""
    if not path.is_relative_to(run_dir):
        return str(path)
    rel = path.relative_to(run_dir).as_posix()
    return where if rel == "." else f"{where}/{rel}"


def _data_location(ev, used_meta: dict) -> str:
    """The evaluated data set as training named it when it lies in an object store (``ev.data``
    is then this machine's copy in the cache), else its path here."""
    named = (used_meta.get("config") or {}).get("data")
    return named if named and remote.is_remote(named) else ev.data


def _stack(pictures: dict, rows) -> np.ndarray:
    """uint8 [N, H, W, C] of ``rows``' images, in their order."""
    return np.stack([pictures[i] for i in rows["id"].tolist()]) if len(rows) else np.zeros((0, 1, 1, 1), np.uint8)


# ---------------------------------------------------------------- plots


def _literal(text) -> str:
    """``text`` (a class name: a user's folder name) drawn as written: matplotlib reads $...$ as
    mathtext, and a class named $\\nope$ crashed the report. ``\\$`` is its literal dollar."""
    return str(text).replace("$", r"\$")


def _figure(width: float, height: float):
    # matplotlib's object API, not pyplot: no global backend switch (a notebook that imports
    # imgtrain keeps its own), no display needed, and figures are freed with their object.
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=DPI, layout="constrained")


def _learning_curves(history: list[dict], used_epoch: int | None, path: Path) -> None:
    from matplotlib.ticker import MaxNLocator

    fig = _figure(11, 4)
    loss_ax, acc_ax = fig.subplots(1, 2)
    epochs = [r["epoch"] + 1 for r in history]  # 1-based, as the training display prints them

    def series(ax, key, label, style):
        points = [(e, r[key]) for e, r in zip(epochs, history) if runs.is_number(r.get(key))]
        if points:  # markers: a one-epoch run is a single point, invisible as a line alone
            ax.plot(*zip(*points), style, marker="o", label=label)

    series(loss_ax, "train_loss", "train loss", "-")
    series(loss_ax, "val_loss", "val loss", "-")
    series(acc_ax, "train_accuracy", "train accuracy", "--")
    series(acc_ax, "val_accuracy", "val accuracy", "-")
    series(acc_ax, "val_f1_macro", "val macro F1", "-.")  # recorded by training with issue 36, when it is
    if used_epoch is not None:  # where the evaluated weights sit on the curve
        acc_ax.axvline(used_epoch + 1, color="grey", linestyle=":", label="checkpoint used")
    for ax, title in ((loss_ax, "Loss"), (acc_ax, "Accuracy")):
        ax.set_title(title)
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if epochs:  # without it, one epoch gets an axis of fractional epochs around 1
            ax.set_xlim(min(epochs) - 0.5, max(epochs) + 0.5)
        ax.grid(alpha=0.3)
        if history:
            ax.legend()
        else:
            ax.text(0.5, 0.5, "no epoch recorded", ha="center", va="center", transform=ax.transAxes)
    fig.savefig(path)


def _reliability_diagram(bins: list[dict], ece: float, path: Path) -> None:
    """``bins``: ``EvalResult.calibration`` (metrics.py): accuracy per confidence bin as bars from
    the bin's lower to its upper edge, the gap to the diagonal hatched; counts underneath."""
    fig = _figure(6, 6.5)
    acc_ax, count_ax = fig.subplots(2, 1, sharex=True, height_ratios=(3, 1))
    lower = [b["lower"] for b in bins]
    width = [b["upper"] - b["lower"] for b in bins]
    filled = [b for b in bins if b["count"]]
    acc_ax.plot([0, 1], [0, 1], ":", color="grey", label="perfect calibration")
    acc_ax.bar([b["lower"] for b in filled], [b["accuracy"] for b in filled],
               [b["upper"] - b["lower"] for b in filled], align="edge", edgecolor="white", label="accuracy")
    gaps = [b["confidence"] - b["accuracy"] for b in filled]  # > 0: overconfident
    acc_ax.bar([b["lower"] for b in filled], gaps, [b["upper"] - b["lower"] for b in filled],
               bottom=[b["accuracy"] for b in filled], align="edge", color=WRONG, alpha=0.3, hatch="//",
               label="gap to the mean confidence")
    acc_ax.set_xlim(0, 1)
    acc_ax.set_ylim(0, 1)
    acc_ax.set_ylabel("accuracy")
    acc_ax.set_title(f"expected calibration error {ece:.4f} ({len(bins)} bins)")
    acc_ax.legend(loc="upper left")
    acc_ax.grid(alpha=0.3)
    count_ax.bar(lower, [b["count"] for b in bins], width, align="edge", edgecolor="white", color="grey")
    count_ax.set_xlabel("confidence (probability of the predicted class)")
    count_ax.set_ylabel("images")
    count_ax.grid(alpha=0.3)
    fig.savefig(path)


def _show_image(ax, image: np.ndarray) -> None:
    # [H, W, 1] grayscale needs the channel dropped and a gray colour map; [H, W, 3] is RGB.
    if image.shape[-1] == 1:
        ax.imshow(image[..., 0], cmap="gray", vmin=0, vmax=255)
    else:
        ax.imshow(image)
    ax.set_xticks([])
    ax.set_yticks([])


def _nothing_to_show(path: Path, message: str) -> None:
    """A figure that says there is nothing to plot: still an image, so the page and files keep one shape."""
    fig = _figure(6, 1.5)
    fig.text(0.5, 0.5, message, ha="center", va="center", fontsize=14, color=RIGHT)
    fig.savefig(path)


def _label_grid(n: int):
    """(figure, its axes) for ``n`` multi-label pictures, GRID_SIDE a row, every axis off until drawn on."""
    columns, used_rows = min(GRID_SIDE, n), -(-n // GRID_SIDE)
    fig = _figure(2.4 * columns, 2.4 * used_rows)
    axes = np.atleast_1d(fig.subplots(used_rows, columns)).ravel()
    for ax in axes:
        ax.axis("off")
    return fig, axes


def _image_grid(images: np.ndarray, rows, classes: list[str], path: Path, with_confidence: bool,
                given: str = "true", empty: str = "No misclassified test images: nothing to show.") -> None:
    """Up to GRID_SIDE x GRID_SIDE images titled true (or ``given``) / pred; a red frame marks a mistake."""
    if len(images) == 0:  # a perfect model
        _nothing_to_show(path, empty)
        return
    # As many cells as images (two errors: one row of two, not a 4x4 box of blanks)
    columns, rows_used = min(GRID_SIDE, len(images)), -(-min(len(images), GRID_SIDE**2) // GRID_SIDE)
    fig = _figure(2.0 * columns, 2.2 * rows_used)
    axes = np.atleast_1d(fig.subplots(rows_used, columns)).ravel()
    for ax in axes:  # the last row's cells past the last image stay blank
        ax.axis("off")
    for ax, image, row in zip(axes, images, rows.itertuples()):
        ax.axis("on")
        _show_image(ax, image)
        ok = row.pred_index == row.label
        title = f"{given} {_literal(classes[row.label])} / pred {_literal(row.pred_class)}"
        if with_confidence:
            title += f"\nconfidence {row.confidence:.0%}"
        ax.set_title(title, color=RIGHT if ok else WRONG, fontsize=10, fontweight="normal" if ok else "bold")
        for spine in ax.spines.values():
            spine.set_visible(not ok)
            spine.set_color(WRONG)
            spine.set_linewidth(4)
    fig.savefig(path)


def _confusion_plot(counts: np.ndarray, classes: list[str], path: Path) -> None:
    """The whole matrix up to batch.DENSE_CONFUSION_MAX_CLASSES classes, else the rows and columns
    of the CONFUSED_CLASSES_SHOWN classes with the most errors. ``counts``: batch.confusion_counts."""
    from imgtrain.inference.batch import DENSE_CONFUSION_MAX_CLASSES, dense_confusion

    k, (true, pred, n) = len(classes), counts.T
    if k <= DENSE_CONFUSION_MAX_CLASSES:
        return _confusion_matrix(dense_confusion(counts, k), classes, path)
    wrong = true != pred
    errors = np.bincount(true[wrong], n[wrong], minlength=k) + np.bincount(pred[wrong], n[wrong], minlength=k)
    support = np.bincount(true, n, minlength=k)
    ranked = np.lexsort((-support, -errors))[:CONFUSED_CLASSES_SHOWN]  # most errors, then most images
    shown = np.sort(ranked[(errors[ranked] + support[ranked]) > 0])
    inside = np.isin(true, shown) & np.isin(pred, shown)
    sub = np.zeros((len(shown), len(shown)), np.int64)
    sub[np.searchsorted(shown, true[inside]), np.searchsorted(shown, pred[inside])] = n[inside]
    accuracy = n[~wrong].sum() / max(n.sum(), 1)
    title = (f"accuracy {accuracy:.2%} on {n.sum():,} images\nthe {len(shown)} of {k:,} classes "
             "with the most errors")
    _confusion_matrix(sub, [classes[i] for i in shown], path, title)


def _confusion_matrix(cm: np.ndarray, classes: list[str], path: Path, title: str | None = None) -> None:
    k = len(classes)
    side = min(3.5 + 0.45 * k, 24)  # readable cells for 10 classes, bounded for 100
    fig = _figure(side + 1.5, side)
    ax = fig.subplots()
    ax.set_title(title or f"accuracy {np.trace(cm) / max(cm.sum(), 1):.2%} on {cm.sum():,} images")
    im = ax.imshow(cm, cmap="Blues")
    fig.colorbar(im, ax=ax, shrink=0.8)
    labels = [_literal(c) for c in classes]
    ax.set_xticks(range(k), labels, rotation=90 if k > 10 else 0)
    ax.set_yticks(range(k), labels)
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    if k <= 30:  # beyond that the numbers no longer fit their cells
        threshold = cm.max() / 2 if cm.size else 0
        for (i, j), n in np.ndenumerate(cm):
            ax.text(j, i, str(n), ha="center", va="center", fontsize=9,
                    color="white" if n > threshold else "black")
    fig.savefig(path)


# ---------------------------------------------------------------- the page


CSS = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 1200px; color: #222; padding: 0 1rem; }
h1 { margin-bottom: 0.2rem; } h2 { border-bottom: 1px solid #ddd; padding-bottom: 0.2rem; margin-top: 2rem; }
table { border-collapse: collapse; font-size: 0.9rem; margin: 0.5rem 0; }
th, td { border: 1px solid #ddd; padding: 0.25rem 0.6rem; text-align: right; }
th { background: #f3f3f3; } td.text, th.text { text-align: left; }
#summary td.text, #config-table td.text { overflow-wrap: anywhere; }  /* a long path or value wraps to fit */
.table-box { max-width: 100%; overflow-x: auto; }  /* what still does not fit scrolls in its own box */
tr.used { background: #fff6d6; font-weight: 600; }
figure { margin: 1rem 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #555; font-size: 0.9rem; }
.beside { display: flex; gap: 1rem; } .beside figure { flex: 1; min-width: 0; }  /* the errors and their maps */
.muted { color: #777; }
"""


def _e(value) -> str:
    return html.escape(str(value), quote=True)


def _num(value, digits: int = 4) -> str:
    if value is None:
        return ""
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _pct(value) -> str:
    return "n/a" if value is None else f"{value:.2%}"


def _table(table_id: str, header: list[str] | None, rows: list[list], text_columns=(0,),
           row_classes: list[str] | None = None) -> str:
    def cell(tag, i, value):
        cls = ' class="text"' if i in text_columns else ""
        text = _e(value).replace("_", "_<wbr>") if tag == "th" else _e(value)  # train_<wbr>accuracy: a header may wrap
        return f"<{tag}{cls}>{text}</{tag}>"

    head = ""
    if header:
        head = "<thead><tr>" + "".join(cell("th", i, h) for i, h in enumerate(header)) + "</tr></thead>"
    body = []
    for n, row in enumerate(rows):
        cls = f' class="{_e(row_classes[n])}"' if row_classes and row_classes[n] else ""
        body.append(f"<tr{cls}>" + "".join(cell("td", i, v) for i, v in enumerate(row)) + "</tr>")
    return f'<div class="table-box"><table id="{_e(table_id)}">{head}<tbody>{"".join(body)}</tbody></table></div>'


def _model_line(args: dict, config: dict) -> str:
    from imgtrain.models.zoo import describe

    line = describe({"architecture": args.get("architecture", "resnet18"), **args}).removeprefix("model ")
    start = config.get("init_from") or ("published weights" if config.get("pretrained") else None)
    taught = f", distilled from {config['distillation']}" if config.get("distillation") else ""
    return line + (f", started from {start}" if start else "") + taught


def _page(result: runs.RunResult, ev, used: Path, used_meta: dict, out: Path, num_wrong: int, where: str) -> str:
    """The HTML page; ``where``: the run's location as its user names it (``write_report``)."""
    summary = _summary(result, ev, used, used_meta, num_wrong, where)

    keys = ["train_loss", "train_accuracy", "val_loss", "val_accuracy", "lr", "epoch_time_s", "images_per_s"]
    if any(r.get("val_f1_macro") is not None for r in result.history):  # recorded by newer runs only
        keys.insert(4, "val_f1_macro")
    metrics = [[r["epoch"] + 1, *(_num(r.get(k), 6 if k == "lr" else 4) for k in keys), r.get("checkpoint", "")]
               for r in result.history]
    # --checkpoint PATH may name another run's checkpoint: then no epoch of this run is marked.
    used_here = used.parent == result.path
    metric_marks = ["used" if used_here and r.get("checkpoint") == used.name else "" for r in result.history]

    best, latest = result.best_checkpoint, result.latest_checkpoint
    checkpoints, ckpt_marks = [], []
    for path, meta in ckpt.listing(result.path):
        marks = [m for m, p in (("best", best), ("latest", latest), ("used", used)) if p == path]
        checkpoints.append([path.name, meta.get("epoch", -1) + 1, meta.get("step", ""),
                            _pct((meta.get("metrics") or {}).get("val_accuracy")), ", ".join(marks)])
        ckpt_marks.append("used" if path == used else "")

    per_class = [[c, _num(s["precision"]), _num(s["recall"]), _num(s["f1"]), s["support"]]
                 for c, s in ev.per_class.items()]
    averages = [[name, _num(s["precision"]), _num(s["recall"]), _num(s["f1"]), ev.num_samples]
                for name, s in (("macro average", ev.macro_avg), ("weighted average", ev.weighted_avg))]
    config = [[k, json.dumps(v) if isinstance(v, (dict, list)) else v] for k, v in sorted(result.config.items())]

    figures = _figures(result, out, num_wrong)

    sections = [
        f"<h1>imgtrain report: {_e(result.name)}</h1>",
        _table("summary", None, summary, text_columns=(0, 1)),
        "<h2>Learning curves</h2>", figures["learning-curves"],
        "<h2>Per-epoch metrics</h2>",
        _table("metrics-table", ["epoch", *keys, "checkpoint"], metrics, text_columns=(len(keys) + 1,),
               row_classes=metric_marks),
        f"<h2>Predictions on the {_e(ev.split)} split</h2>", figures["predictions-grid"],
        "<h2>Confusion matrix</h2>", figures["confusion-matrix"],
        "<h2>Most confident errors</h2>",
        f'<div class="beside">{figures["confident-errors"]}{figures["confident-errors-maps"]}</div>',
        "<h2>Calibration</h2>", figures["reliability-diagram"],
        *_issues_section(ev.label_issues, ev.classes, figures["label-issues"]),
        "<h2>Per-class scores</h2>",
        _table("averages-table", ["average", "precision", "recall", "F1", "support"], averages),
        '<p class="muted">Macro: the unweighted mean over the classes present or predicted; weighted: the '
        "mean weighted by each class's support. An undefined precision or recall (a class never predicted "
        "or never present) counts as 0.</p>",
        _table("per-class-table", ["class", "precision", "recall", "F1", "support"], per_class),
        "<h2>Checkpoints</h2>",
        _table("checkpoints-table", ["checkpoint", "epoch", "step", "val accuracy", ""], checkpoints,
               text_columns=(0, 4), row_classes=ckpt_marks),
        "<h2>Configuration</h2>",
        _table("config-table", ["field", "value"], config, text_columns=(0, 1)),
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>imgtrain report: {_e(result.name)}</title><style>{CSS}</style></head>\n<body>\n"
        + "\n".join(sections) + "\n</body></html>\n"
    )


def _issues_section(issues: dict, classes: list[str], figure: str) -> list[str]:
    rows = [[x["id"], classes[x["label"]], classes[x["predicted"]], _num(x["label_prob"]),
             _num(x["predicted_prob"]), _num(x["score"], 3)] for x in issues["issues"]]
    return [
        "<h2>Labels worth a second look</h2>", figure,
        f'<p class="muted">Scanned {issues["scanned"]:,} of the {issues["of"]:,} training images (the first, '
        "in the files' seeded random order). Rule: " + _e(issues["rule"]) + ". The model learnt from these "
        "labels, so it may have learnt a wrong one too: the list is where to start, not all there is.</p>",
        _table("label-issues-table", ["id", "labelled", "model says", "p(label)", "p(model's class)", "score"],
               rows, text_columns=(1, 2)),
    ]


def _summary(result: runs.RunResult, ev, used: Path, used_meta: dict, num_wrong: int, where: str) -> list[list]:
    """The summary table's rows: the run, its data, model and checkpoint, and the figures."""
    data_name = (used_meta.get("data") or {}).get("name", "")
    data, used_at = _data_location(ev, used_meta), _located(used, result.path, where)
    summary = [
        ["run", result.name], ["status", result.status], ["run directory", where],
        ["data set", f"{data_name} ({data})" if data_name else data],
        ["model", _model_line(used_meta.get("model_args") or {}, result.config)],
        ["epochs completed", f"{len(result.history)} of {result.config.get('epochs')}"],
        ["checkpoint used", f"{used.name} (epoch {used_meta.get('epoch', -1) + 1}, {used_at})"],
        [f"accuracy recorded in training ({ev.recorded_split or result.validation_split} split)",
         _pct(ev.recorded_val_accuracy)],
        [f"accuracy re-evaluated now ({ev.split} split)", f"{_pct(ev.accuracy)} of {ev.num_samples:,} images"],
        ["top-5 accuracy", _pct(ev.top5_accuracy) if ev.top5_accuracy is not None
         else f"n/a ({len(ev.classes)} classes: it needs 6 or more)"],
        ["macro F1 / weighted F1", f"{_num(ev.macro_avg['f1'])} / {_num(ev.weighted_avg['f1'])}"],
        ["expected calibration error", f"{_num(ev.ece)} (15 equal-width confidence bins)"],
        ["temperature scaling", ev.calibration_line()],
        ["misclassified", f"{num_wrong:,}"],
        ["generated", time.strftime("%Y-%m-%d %H:%M:%S %Z")],
    ]
    if result.error:
        summary.insert(2, ["error", result.error])
    return summary


def _figures(result: runs.RunResult, out: Path, num_wrong: int) -> dict[str, str]:
    """Each plot of PLOTS as an HTML figure, its PNG inlined."""
    figures = {}
    for plot_id, file, caption in PLOTS:
        if plot_id == "confident-errors" and num_wrong == 0:
            caption = "No test image is misclassified, so there are no confident errors to show."
        elif plot_id == "confident-errors" and num_wrong < GRID_SIDE**2:
            caption = f"All {num_wrong} misclassified test image(s), the most confident first."
        elif plot_id == "confident-errors-maps" and num_wrong == 0:
            caption = "No misclassified test image, so no map."
        caption = caption.format(split=result.validation_split)
        data = base64.b64encode((out / file).read_bytes()).decode("ascii")
        figures[plot_id] = (
            f'<figure><img id="{_e(plot_id)}" src="data:image/png;base64,{data}" alt="{_e(caption)}">'
            f"<figcaption>{_e(caption)} <span class=\"muted\">({_e(file)})</span></figcaption></figure>"
        )
    return figures


# ---------------------------------------------------------------- a multi-label run (issue 48)


def _multi_label_run(result: runs.RunResult, checkpoint: str) -> bool:
    from imgtrain.data.format import is_multi_label

    chosen = Path(checkpoint) if checkpoint not in ckpt.CHOICES else result.best_checkpoint
    meta = ckpt.read_meta(chosen) if chosen is not None and (Path(chosen) / ckpt.META_FILE).is_file() else {}
    return isinstance(meta.get("data"), dict) and is_multi_label(meta["data"])


def _write_multi_label_report(result: runs.RunResult, run_dir: Path, checkpoint: str, storage: str) -> Path:
    """A multi-label run's page: the figures, learning curves, per-label AP bars, the thresholds
    table, the test images with the most wrongly decided labels, and the most confidently wrong
    labels, each with where the model looked for it."""
    from imgtrain.data import stream
    from imgtrain.inference.batch import InferenceOptions, evaluate
    from imgtrain.inference.predictor import preprocess_preset

    ev = evaluate(str(result.path), checkpoint, storage, options=InferenceOptions(backend="local"))
    out, used, used_meta, in_store, where = _page_place(result, run_dir, storage, ev)
    wrong = ev.wrong_labels()
    worst = np.argsort(-wrong, kind="stable")[:GRID_SIDE**2]
    worst = worst[wrong[worst] > 0]
    sure = ev.confident_wrong_labels(GRID_SIDE**2)
    pictures = stream.fetch_images(ev.data, ev.split, set(ev.ids[np.concatenate([worst, sure[0]])].tolist()),
                                   preset=preprocess_preset(used))
    files = {"learning-curves": "learning_curves.png", "label-ap": "label_ap.png", "most-wrong": "most_wrong.png",
             "wrong-label-maps": "wrong_label_maps.png"}
    _learning_curves(result.history, used_meta.get("epoch"), out / files["learning-curves"])
    _ap_bars(ev, out / files["label-ap"])
    _most_wrong_grid(ev, worst, pictures, out / files["most-wrong"])
    _wrong_label_maps(ev, sure, pictures, out / files["wrong-label-maps"])
    shown = {"checkpoint": _located(used, result.path, where), "data": _data_location(ev, used_meta)}
    atomic_write_text(out / EVAL_FILE, json.dumps({**ev.to_json(), **shown}, indent=2))

    def figure(plot_id: str, caption: str) -> str:
        data = base64.b64encode((out / files[plot_id]).read_bytes()).decode("ascii")
        return (f'<figure><img id="{_e(plot_id)}" src="data:image/png;base64,{data}" alt="{_e(caption)}">'
                f"<figcaption>{_e(caption)} <span class=\"muted\">({_e(files[plot_id])})</span></figcaption></figure>")

    summary = [
        ["run", result.name], ["status", result.status], ["run directory", where],
        ["data set", _data_location(ev, used_meta)],
        ["model", _model_line(used_meta.get("model_args") or {}, result.config)],
        ["checkpoint used", f"{used.name} (epoch {used_meta.get('epoch', -1) + 1}, {_located(used, result.path, where)})"],
        [f"mAP recorded in training ({ev.recorded_split or result.validation_split} split)", _num(ev.recorded_val_map)],
        [f"mAP re-evaluated now ({ev.split} split)", f"{_num(ev.map)} on {ev.num_samples:,} images"],
        ["F1 micro / macro", f"{_num(ev.f1_micro)} / {_num(ev.f1_macro)}"],
        ["exact match / Hamming loss", f"{_pct(ev.exact_match)} / {_num(ev.hamming_loss)}"],
        ["thresholds", "the F1-best per label on the val split" if ev.thresholds_chosen_on == "val"
         else "0.5 for every label (no val split to choose them on)"],
        ["generated", time.strftime("%Y-%m-%d %H:%M:%S %Z")],
    ]
    labels = [[c, _num(s["ap"]) if s["ap"] is not None else "n/a", _num(s["threshold"], 3), _num(s["precision"]),
               _num(s["recall"]), _num(s["f1"]), s["support"]] for c, s in ev.per_label.items()]
    sections = [
        f"<h1>imgtrain report: {_e(result.name)}</h1>",
        _table("summary", None, summary, text_columns=(0, 1)),
        "<h2>Learning curves</h2>",
        figure("learning-curves", f"Loss and accuracy per epoch (validation = the {result.validation_split} split)."),
        "<h2>Average precision per label</h2>",
        figure("label-ap", f"Each label's average precision on the {ev.split} split; the dashed line is their mean (mAP)."),
        "<h2>Thresholds and per-label scores</h2>",
        _table("thresholds-table", ["label", "AP", "threshold", "precision", "recall", "F1", "support"], labels),
        "<h2>Images with the most wrong labels</h2>",
        figure("most-wrong", "The test images with the most labels decided wrong at the thresholds "
                             "(missed and extra), the worst first."),
        "<h2>Where the model looked for its surest wrong labels</h2>",
        figure("wrong-label-maps", "The label decisions the model got wrong most confidently (an extra label by its "
                                   "probability, a missed one by 1 - its probability), each image with the Grad-CAM "
                                   "map of that label over it: where it saw the extra label, or looked for the missed "
                                   "one (docs/inference.md, Explanations)."),
    ]
    page = out / PAGE_FILE
    atomic_write_text(page, '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
                      f"<title>imgtrain report: {_e(result.name)}</title><style>{CSS}</style></head>\n<body>\n"
                      + "\n".join(sections) + "\n</body></html>\n")
    if in_store:
        mirror.push(location.store(storage), run_dir.name, under=REPORT_DIR)
    return page


def _ap_bars(ev, path: Path) -> None:
    ap = [s["ap"] if s["ap"] is not None else 0.0 for s in ev.per_label.values()]
    fig = _figure(max(4.0, 0.35 * len(ap) + 1.5), 3.2)
    ax = fig.subplots()
    ax.bar(range(len(ap)), ap, color=RIGHT)
    ax.axhline(ev.map, color=WRONG, linestyle="--", linewidth=1)
    ax.set_xticks(range(len(ap)), [_literal(c) for c in ev.classes], rotation=90 if len(ap) > 12 else 0)
    ax.set_ylim(0, 1)
    ax.set_ylabel("average precision")
    fig.savefig(path)


def _wrong_label_maps(ev, sure: tuple, pictures: dict, path: Path) -> None:
    """``confident_wrong_labels``' decisions, each image with the Grad-CAM map of its label (``explain.py``)."""
    from imgtrain.inference.explain import Explainer, overlay
    from imgtrain.inference.predictor import load_checkpoint

    rows, labels, _ = sure
    message = "Every label of every test image decided right: no map to show."
    if len(rows):
        images = np.stack([pictures[int(ev.ids[i])] for i in rows])
        try:
            maps = Explainer(load_checkpoint(ev.checkpoint)).maps(images, labels)
        except ImgtrainError as e:  # a model with no map to place: said in the picture, the page still written
            rows, message = rows[:0], f"No maps: {e}"
    if not len(rows):
        _nothing_to_show(path, message)
        return
    fig, axes = _label_grid(len(rows))
    for ax, image, cam, i, k in zip(axes, images, maps, rows, labels):
        ax.axis("on")
        _show_image(ax, overlay(image, cam))
        kind = "missed" if ev.targets[i, k] else "extra"
        ax.set_title(_literal(f"{kind} {ev.classes[k]}\np {ev.scores[i, k]:.0%}, threshold {ev.thresholds[k]:.2f}"),
                     color=WRONG, fontsize=9)
    fig.savefig(path)


def _most_wrong_grid(ev, rows: np.ndarray, pictures: dict, path: Path) -> None:
    if len(rows) == 0:
        _nothing_to_show(path, "Every label of every test image decided right: nothing to show.")
        return
    fig, axes = _label_grid(len(rows))
    for ax, i in zip(axes, rows):
        ax.axis("on")
        _show_image(ax, pictures[int(ev.ids[i])])
        true = [ev.classes[k] for k in np.flatnonzero(ev.targets[i])]
        said = [ev.classes[k] for k in np.flatnonzero(ev.scores[i] >= ev.thresholds)]
        ax.set_title(_literal(f"true {' '.join(true) or '-'}\npred {' '.join(said) or '-'}"), color=WRONG, fontsize=9)
    fig.savefig(path)
