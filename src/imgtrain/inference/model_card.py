"""The ``MODEL_CARD.md`` an export writes beside its model: what the model is, what it was trained
on and how, how well it does on its test split (measured during the export's verification, not
copied from training), and what it is and is not meant for.

Every value from the data set, the run's configuration or its checkpoint (class names, the data
set's name and source, the run's name, its settings) goes in as text (``_md``): a class named
``<img src=x onerror=...>`` or ``a\n\n## Fake section`` shows as those characters, on its line,
where a Markdown viewer would otherwise render the tag or the section."""

from __future__ import annotations

import html
import platform
import re
import unicodedata
from datetime import datetime, timezone

from imgtrain.config import settings
from imgtrain.inference.preprocess import LoadedCheckpoint

# The training recipe's rows: the settings declared with ``recipe=N``, in that order.
RECIPE_KEYS = tuple(s.name for s in sorted((s for s in settings() if s.recipe), key=lambda s: s.recipe))
PER_CLASS_ROWS = 50  # a card with 1,000 classes lists the 50 weakest; labels.json has them all
# What marks up inline Markdown text (CommonMark, and GitHub's tables, strikethrough and math):
# escaped, no link, image, emphasis, code span or cell end can start. The characters that start a
# block (#, -, >, 1.) only do so at the start of a line, and no value starts one.
MARKDOWN_INLINE = re.compile(r"[\\`*_\[\]|~$]")


def model_card(fmt: str, model_file: str, runtime: str, loaded: LoadedCheckpoint, manifest: dict,
               verification: str, test: dict, calibration=None) -> str:
    """``calibration``: the checkpoint's (``calibrate.Calibration``), whose temperature the
    exported softmax divides the logits by; None: not calibrated."""
    meta, config = loaded.meta, loaded.meta.get("config") or {}
    p = loaded.preprocess
    h, w, c = p.image_shape
    arch = (meta.get("model_args") or {}).get("architecture", config.get("model", "?"))
    multi = bool(test.get("multi_label"))
    kind = f"{len(p.classes)} labels (multi-label)" if multi else f"{len(p.classes)} classes"
    lines = [
        f"# {_md(config.get('name') or loaded.path.parent.name)}: {_md(arch)}, {kind}",
        "",
        f"Exported by imgtrain {_md(meta.get('imgtrain_version', '?'))} on "
        f"{datetime.now(timezone.utc):%Y-%m-%d} as **{fmt}** (`{model_file}`, loaded with {runtime}) from "
        f"checkpoint {_md(loaded.path.name)} (epoch {_md(meta.get('epoch', '?'))}).",
        "",
        "## Input and output",
        "",
        f"* Input `images`: uint8 [batch, {c}, {h}, {w}] ({'grayscale' if c == 1 else 'RGB'}, 0-255); the scaling, "
        f"normalisation (mean {list(p.mean)}, std {list(p.std)}) and {'sigmoid' if multi else 'softmax'} are "
        "inside the model.",
        f"* Output `probabilities`: float32 [batch, {len(p.classes)}], in the order of `labels.json`"
        + ("; each label's own probability: the image's labels are those at or over their threshold in "
           "`thresholds.json` (the table below)." if multi else "."),
        "* Images of another size: `preprocessing.json` says how imgtrain's evaluation resizes them.",
        "",
        "## Data",
        "",
        *_data_lines(manifest),
        "",
        "## Training recipe",
        "",
        "| setting | value |",
        "|---|---|",
        *[f"| {k} | {_md(config[k])} |" for k in RECIPE_KEYS if config.get(k, "") != ""],
        "",
        f"Versions: torch {_md(meta.get('torch_version', '?'))}, Ray {_md(meta.get('ray_version', '?'))}, "
        f"Python {platform.python_version()}. The whole configuration is in the run's `config.json`.",
        "",
        f"## Test metrics ({test['images']:,} images of the test split, measured at export)",
        "",
        *(_label_metric_lines(test) if multi else _metric_lines(test)),
        "",
        "## Export check",
        "",
        _md(verification) + ".",  # it names the split
        "",
        "## Intended use and known limits",
        "",
        *([f"* Tags {h}x{w} {'grayscale' if c == 1 else 'colour'} images with any number of the labels of "
           "`labels.json` (none included); an image of anything else may still get some of them."] if multi else
          [f"* Classifies {h}x{w} {'grayscale' if c == 1 else 'colour'} images into exactly the classes of "
           "`labels.json`; an image of anything else still gets one of them, often with high confidence."]),
        "* The test metrics hold for images like the test split's (same source, same preparation); expect "
        "less on images from other cameras, scanners or domains: measure on your own before relying on it.",
        ("* The probabilities are the sigmoids', not calibrated; the thresholds were chosen on the validation split "
         "(the F1-best per label) and trade precision for recall there." if multi else _calibration_line(calibration)),
        "* Not for decisions about people without a human review and an evaluation of its errors per group.",
        "",
    ]
    return "\n".join(lines)


def _calibration_line(calibration) -> str:
    if calibration is None:
        return ("* The probabilities are the softmax's, not calibrated (no temperature: the data set had no validation "
                "split, or the run was never calibrated) beyond what the ECE above says.")
    return (f"* The probabilities are calibrated by temperature scaling: the logits are divided by T = "
            f"{calibration.temperature:.4f}, fitted on {calibration.images:,} {calibration.fitted_on or 'held-out'} "
            "images, before the softmax (inside the model); the ECE above is measured with it.")


def _data_lines(manifest: dict) -> list[str]:
    splits = manifest.get("splits") or {}
    counts = manifest.get("class_counts") or {}
    sizes = ", ".join(f"{_md(name)} {s.get('num_samples', 0):,}" for name, s in splits.items())
    lines = [f"Data set {_md(manifest.get('name', '?'))} (source {_md(manifest.get('source', '?'))}, prepared "
             f"{_md(manifest.get('created', '?'))}): {sizes} images."]
    train = counts.get("train")
    if train:
        low, high = min(train), max(train)
        per = "label (images carrying it)" if manifest.get("multi_label") is True else "class"
        lines.append(f"Training images per {per}: {low:,} to {high:,}"
                     + (f" (imbalanced: {high / max(low, 1):.0f}x)." if high > 3 * max(low, 1) else "."))
    return lines


def _metric_lines(test: dict) -> list[str]:
    top5 = test.get("top5_accuracy")
    macro = test["macro_avg"]
    lines = [f"* accuracy {test['accuracy']:.2%}" + (f", top-5 {top5:.2%}" if top5 is not None else ""),
             f"* macro precision {macro['precision']:.3f}, recall {macro['recall']:.3f}, F1 {macro['f1']:.3f}",
             f"* expected calibration error {test['ece']:.4f} (15 equal-width confidence bins)",
             *_int8_lines(test.get("int8")),
             "", "| class | precision | recall | F1 | test images |", "|---|---:|---:|---:|---:|"]
    rows = sorted(test["per_class"].items(), key=lambda kv: kv[1]["f1"])[:PER_CLASS_ROWS]
    if len(test["per_class"]) <= PER_CLASS_ROWS:
        rows = list(test["per_class"].items())
    lines += [f"| {_md(name)} | {s['precision']:.3f} | {s['recall']:.3f} | {s['f1']:.3f} | {s['support']:,} |"
              for name, s in rows]
    if len(test["per_class"]) > PER_CLASS_ROWS:
        lines.append(f"\n(the {PER_CLASS_ROWS} classes with the lowest F1 of {len(test['per_class']):,})")
    return lines


def _label_metric_lines(test: dict) -> list[str]:
    """A multi-label model's figures (``multilabel_eval.label_figures``) and its thresholds, per label."""
    chosen = ("the F1-best per label on the validation split" if test.get("thresholds_chosen_on") == "val"
              else "0.5 each: there was no validation split to choose them on")
    lines = [f"* mAP {test['map']:.4f} (average precision per label, averaged over the labels present)",
             f"* F1 micro {test['f1_micro']:.3f}, macro {test['f1_macro']:.3f}; exact match {test['exact_match']:.2%}; "
             f"Hamming loss {test['hamming_loss']:.4f}",
             f"* decided at the thresholds below ({chosen})",
             "", "| label | AP | threshold | precision | recall | F1 | test images |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    per_label = test["per_label"]
    rows = list(per_label.items())
    if len(rows) > PER_CLASS_ROWS:
        rows = sorted(rows, key=lambda kv: kv[1]["f1"])[:PER_CLASS_ROWS]
    lines += [f"| {_md(name)} | {'n/a' if s['ap'] is None else format(s['ap'], '.3f')} | {s['threshold']:.3f} | "
              f"{s['precision']:.3f} | {s['recall']:.3f} | {s['f1']:.3f} | {s['support']:,} |" for name, s in rows]
    if len(per_label) > PER_CLASS_ROWS:
        lines.append(f"\n(the {PER_CLASS_ROWS} labels with the lowest F1 of {len(per_label):,}; thresholds.json has "
                     "every threshold)")
    return lines


def _md(value) -> str:
    """``value`` as plain text inside a line of Markdown: every run of whitespace (line breaks
    included) one space, so it opens no block, heading or table row; control characters dropped;
    HTML's ``<``, ``>`` and ``&`` as entities, so it opens no tag; Markdown's inline marks escaped."""
    text = "".join(ch for ch in " ".join(str(value).split()) if unicodedata.category(ch) != "Cc")
    return MARKDOWN_INLINE.sub(r"\\\g<0>", html.escape(text, quote=False))


def _int8_lines(int8: dict | None) -> list[str]:
    if not int8:
        return []
    return [f"* **this export is int8** ({int8['method']}, calibrated on {int8['calibration_images']:,} training "
            f"images): accuracy {int8['accuracy']:.2%} against {int8['fp32_accuracy']:.2%} in float32 "
            f"({int8['accuracy_drop']:+.2%} drop allowed up to {int8['max_accuracy_drop']:.2%}); top-1 as the "
            f"float32 model's on {int8['agreement_with_fp32']:.2%} of the images. The figures above and per class "
            f"are the float32 model's."]
