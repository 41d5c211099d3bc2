"""The page of ``imgtrain data inspect``: one self-contained HTML file (images as data URIs, CSS
inline, no script), from the findings of ``inspection.py``. Only the images it shows are read
back: the samples of each class and the duplicate pairs listed (at most PAIRS_SHOWN)."""

from __future__ import annotations

import base64
import html
import io
import time
from pathlib import Path

import numpy as np

from imgtrain.data.fingerprint import TRANSFORM_WORDS, UNREADABLE
from imgtrain.data.inspection_scan import Scan, read_block
from imgtrain.data.named_splits import SPLIT_NAMES
from imgtrain.data.row_names import display_name
from imgtrain.ops.files import atomic_write_text

PAIRS_SHOWN = 60
THUMB = 112  # px, the longer side of a thumbnail
CLASS_ROWS = 100  # more classes: the 50 smallest and 50 largest training classes
SKIPPED_SHOWN = 100

CSS = """
body { font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 1200px; color: #222; padding: 0 1rem; }
h1 { margin-bottom: 0.2rem; } h2 { border-bottom: 1px solid #ddd; padding-bottom: 0.2rem; margin-top: 2rem; }
table { border-collapse: collapse; font-size: 0.9rem; margin: 0.5rem 0; }
th, td { border: 1px solid #ddd; padding: 0.25rem 0.6rem; text-align: right; }
th { background: #f3f3f3; } td.text, th.text { text-align: left; }
.flag { background: #fdecea; border-left: 4px solid #c62828; padding: 0.4rem 0.8rem; }
.ok { background: #edf7ed; border-left: 4px solid #2e7d32; padding: 0.4rem 0.8rem; }
.muted { color: #777; font-size: 0.9rem; }
.samples { display: flex; flex-wrap: wrap; gap: 4px; align-items: flex-end; margin-bottom: 0.6rem; }
.samples h3 { width: 100%; margin: 0.4rem 0 0; font-size: 1rem; }
img.thumb { max-width: 112px; max-height: 112px; min-width: 56px; image-rendering: pixelated; border: 1px solid #eee; }
.pairs { display: grid; grid-template-columns: repeat(auto-fill, minmax(270px, 1fr)); gap: 0.8rem; }
.pair { border: 1px solid #ddd; padding: 0.4rem; border-radius: 4px; }
.pair.cross { border-color: #c62828; border-width: 2px; }
.pair figure { display: inline-block; margin: 0 0.3rem 0 0; vertical-align: top; }
.pair figcaption, .pair p { font-size: 0.8rem; margin: 0.2rem 0; }
.pair figcaption { max-width: 112px; } .pair .name { overflow-wrap: break-word; }  /* a path wraps at its / */
.differ { color: #c62828; font-weight: 600; }
"""


def write_page(path: Path, result: dict, extra: dict, found: Scan, manifest: dict) -> None:
    """Write the page for ``result`` (``inspection.findings``) to ``path``."""
    pairs = extra["pairs"]  # in the order shown
    order = np.arange(min(PAIRS_SHOWN, len(pairs)))
    wanted = set(np.concatenate([*extra["samples"].values(), pairs.a[order], pairs.b[order]]).tolist())
    thumbs = _thumbnails(found, sorted(wanted), manifest["storage"])
    sections = [
        f"<h1>imgtrain data inspect: {_e(result['name'])}</h1>",
        _summary(result),
        "<h2>Images per class</h2>", *_classes(result),
        *_multi_label(result),
        "<h2>Sizes and colour</h2>", *_sizes(result, found),
        "<h2>Samples per class</h2>", _samples(result, extra["samples"], thumbs),
        "<h2>Duplicates</h2>", *_duplicates(result, pairs, order, found, thumbs, extra["names"]),
        "<h2>Skipped at prepare time</h2>", _skipped(result),
    ]
    page = ('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f"<title>imgtrain data inspect: {_e(result['name'])}</title><style>{CSS}</style></head>\n<body>\n"
            + "\n".join(sections) + "\n</body></html>\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, page)


def _e(value) -> str:
    return html.escape(str(value), quote=True)


def _table(table_id: str, header: list[str] | None, rows: list[list], text_columns=(0,)) -> str:
    def cell(tag, i, value):
        return f"<{tag}{' class=text' if i in text_columns else ''}>{_e(value)}</{tag}>"

    head = "<tr>" + "".join(cell("th", i, h) for i, h in enumerate(header)) + "</tr>" if header else ""
    body = "".join("<tr>" + "".join(cell("td", i, v) for i, v in enumerate(row)) + "</tr>" for row in rows)
    return f'<table id="{table_id}"><thead>{head}</thead><tbody>{body}</tbody></table>'


def _summary(result: dict) -> str:
    d, imb = result["duplicates"], result["imbalance"]
    cross = d["counts"]["cross_split"]
    ratio = "a class has no image" if imb["ratio"] is None else f"{imb['ratio']:.1f}x"
    per_split = ", ".join(f"{s} {v['images']:,}" for s, v in result["splits"].items())
    rows = [["data set", result["data"]], ["source", result["source"]],
            ["images", f"{result['images']:,} ({per_split})"],
            ["classes", len(result["classes"])], ["stored as", result["storage"]],
            ["largest / smallest training class", ratio + (" (imbalanced)" if imb["flagged"] else "")],
            ["colour modes", ", ".join(f"{m} {n:,}" for m, n in result["modes"].items())],
            ["duplicate pairs across splits", f"{cross['exact']:,} exact, {cross['near']:,} near"],
            ["generated", time.strftime("%Y-%m-%d %H:%M:%S %Z")]]
    if result.get("dedupe"):
        dd = result["dedupe"]
        rows.insert(5, ["prepared with", f"--dedupe {dd['mode']}: {dd['dropped']:,} duplicate(s) dropped "
                        f"({dd['file']})"])
    return _table("summary", None, rows, text_columns=(0, 1))


def _classes(result: dict) -> list[str]:
    imb, classes = result["imbalance"], result["classes"]
    splits = list(result["splits"])
    counts = np.array([result["splits"][s]["per_class"] for s in splits]).T  # [k, splits]
    if imb["ratio"] is None:
        text = (f"Imbalanced: {len(imb['empty_classes'])} class(es) have no training image "
                f"({', '.join(imb['empty_classes'][:10])}).")
    else:
        text = (f"{'Imbalanced' if imb['flagged'] else 'Balanced enough'}: the largest training class "
                f"({imb['largest']['class']}, {imb['largest']['images']:,} images) has {imb['ratio']:.1f}x the images "
                f"of the smallest ({imb['smallest']['class']}, {imb['smallest']['images']:,}).")
    rule = (f" Flagged when the largest training class has {imb['flag_at']:.0f}x the images of the smallest or "
            "more; <code>imgtrain train --sampling balanced</code> draws the classes evenly.")
    shown = np.arange(len(classes))
    note = ""
    if len(classes) > CLASS_ROWS:
        by_size = np.argsort(counts[:, 0], kind="stable")
        shown = np.r_[by_size[:CLASS_ROWS // 2], by_size[-CLASS_ROWS // 2:]]
        note = (f'<p class="muted">{len(classes):,} classes: the {CLASS_ROWS // 2} smallest and '
                f"{CLASS_ROWS // 2} largest training classes are shown (all are in --json).</p>")
    rows = [[classes[c], *counts[c].tolist(), int(counts[c].sum())] for c in shown]
    return [f'<p id="imbalance" class="{"flag" if imb["flagged"] else "ok"}">{_e(text)}{rule}</p>', note,
            _table("class-table", ["class", *splits, "all"], rows)]


def _multi_label(result: dict) -> list[str]:
    """A multi-label data set's images per number of labels, and the labels seen together most."""
    ml = result.get("multi_label")
    if not ml:
        return []
    splits = list(ml["label_set_sizes"])
    most = max(len(v) for v in ml["label_set_sizes"].values())
    sizes = [[str(k), *[(v[k] if k < len(v) else 0) for v in ml["label_set_sizes"].values()]] for k in range(most)]
    pairs = [[f"{p['a']} + {p['b']}", p["images"]] for p in ml["co_occurrence"]]
    return ['<p class="muted">Multi-label: an image carries any number of the classes; the counts above are the '
            "images carrying each.</p>",
            "<h2>Labels per image</h2>", _table("label-set-sizes", ["labels", *splits], sizes),
            f"<h2>Labels seen together (the {len(pairs)} most frequent pairs, all splits)</h2>",
            _table("co-occurrence", ["pair", "images"], pairs) if pairs else "<p>No image has two labels.</p>"]


def _sizes(result: dict, found: Scan) -> list[str]:
    sizes, modes = result["sizes"], result["modes"]
    out = []
    if sizes["fixed_shape"]:
        h, w, c = sizes["fixed_shape"]
        out.append(f'<p id="fixed-shape">Every image is stored as a {h} x {w} x {c} tensor.</p>')
    elif sizes["width"] is not None and sizes["one_size"]:
        out.append(f'<p id="one-size">Every image is {sizes["width"]["max"]:.0f} x {sizes["height"]["max"]:.0f} px '
                   "(width x height).</p>")
    elif sizes["width"] is not None:
        out.append(f'<figure><img id="size-histograms" src="data:image/png;base64,{_histograms(found)}" '
                   'alt="histograms of width, height and aspect ratio"><figcaption class="muted">Width, height '
                   "(after EXIF orientation) and aspect ratio (width / height) of every image.</figcaption></figure>")
    mix = result["mode_mix"]
    text = ("Mixed colour modes: training converts every image to the data set's channels (grayscale images "
            "among colour ones train as gray)." if mix else "One colour mode.")
    out += [f'<p id="mode-mix" class="{"flag" if mix else "ok"}">{_e(text)}</p>',
            _table("mode-table", ["mode", "images"], [[m, f"{n:,}"] for m, n in modes.items()])]
    if result["exif_turned"]:
        out.append(f'<p class="muted">{result["exif_turned"]:,} image(s) carry an EXIF orientation: imgtrain turns '
                   "them upright when decoding (as the thumbnails show them).</p>")
    return out


def _histograms(found: Scan) -> str:
    from matplotlib.figure import Figure

    readable = found.prints.mode != UNREADABLE
    w, h = found.prints.width[readable].astype(np.float64), found.prints.height[readable].astype(np.float64)
    fig = Figure(figsize=(11, 3), dpi=90, layout="constrained")
    for ax, values, title in zip(fig.subplots(1, 3), (w, h, w / h), ("width (px)", "height (px)", "aspect ratio")):
        ax.hist(values, bins=40, color="#4e79a7")
        ax.set_title(title)
        ax.set_ylabel("images")
        ax.grid(alpha=0.3)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _samples(result: dict, samples: dict, thumbs: dict) -> str:
    classes = result["classes"]
    blocks = []
    for c, positions in samples.items():
        images = "".join(_img(thumbs, p, f"{classes[c]} sample") for p in positions.tolist())
        blocks.append(f'<div class="samples" data-class="{_e(classes[c])}"><h3>{_e(classes[c])}</h3>'
                      f"{images or '<span class=muted>no training image</span>'}</div>")
    more = len(classes) - len(samples)
    note = f'<p class="muted">A seeded choice of training images (--seed); {more:,} more classes not shown.</p>' \
        if more else '<p class="muted">A seeded choice of training images (--seed).</p>'
    return '<div id="samples">' + "".join(blocks) + "</div>" + note


def _img(thumbs: dict, position: int, alt: str) -> str:
    uri = thumbs.get(position)
    return f'<img class="thumb" src="{uri}" alt="{_e(alt)}">' if uri else '<span class="muted">unreadable</span>'


def _duplicates(result: dict, pairs, order, found: Scan, thumbs: dict, names: dict[int, str]) -> list[str]:
    d = result["duplicates"]
    c = d["counts"]
    rule = (_e(f"Exact: the same stored bytes (or pixel tensor). Near: pHash from the imagehash library (64 bits), "
               f"Hamming distance at most {d['threshold_rule']}, comparing each image also rotated by 90°, 180° and "
               "270° and mirrored. Across splits a duplicate makes the test (or validation) accuracy a lie: ")
            + "<code>imgtrain data prepare ... --dedupe cross-split</code> drops the copy in the lower split "
            "(test &gt; val &gt; train; the left image of a pair is the one kept).")
    flagged = c["cross_split"]["exact"] + c["cross_split"]["near"]
    head = (f'<p id="cross-split" class="{"flag" if flagged else "ok"}">{flagged:,} duplicate pair(s) across splits, '
            f'{c["within_split"]["exact"] + c["within_split"]["near"]:,} within a split; '
            f'{d["different_labels"]:,} pair(s) with different labels; {d["images_involved"]:,} image(s) in '
            f'{d["groups_total"]:,} group(s) of duplicates{_largest(d)}.</p>')
    table = _table("duplicate-counts", ["", "exact", "near"],
                   [["across splits", c["cross_split"]["exact"], c["cross_split"]["near"]],
                    ["within a split", c["within_split"]["exact"], c["within_split"]["near"]]])
    cards = [_pair(pairs, p, found, result["classes"], thumbs, names) for p in order.tolist()]
    more = d["pairs_total"] - len(cards)
    listed = "them" if d["pairs_listed"] == d["pairs_total"] else f"{d['pairs_listed']:,} of them and the groups"
    note = f'<p class="muted">{more:,} more pair(s) not shown; --json lists {listed}.</p>' if more > 0 else ""
    return [head, f'<p class="muted">{rule}</p>', table, '<div id="pairs" class="pairs">' + "".join(cards) + "</div>",
            note]


def _largest(d: dict) -> str:
    return f" (the largest: {d['largest_group']:,} images)" if d["largest_group"] > 2 else ""


def _pair(pairs, p: int, found: Scan, classes: list[str], thumbs: dict, names: dict[int, str]) -> str:
    a, b = int(pairs.a[p]), int(pairs.b[p])
    cross = found.split[a] != found.split[b]
    differ = found.labels[a] != found.labels[b]
    kind = "exact" if pairs.exact[p] else "near"
    turn = TRANSFORM_WORDS[pairs.transform[p]] if kind == "near" else "as is"

    def side(i):  # named by its file where the data set knows it (row_names.py), else by its id
        split, label = SPLIT_NAMES[int(found.split[i])], found.class_of(i, classes)
        name = display_name(names, found.ids[i])
        return (f"<figure>{_img(thumbs, i, f'{split} {name}')}<figcaption>{_e(split)} · "
                f'<span class="name" title="{_e(name)}">{_e(name).replace("/", "/<wbr>")}</span><br>{_e(label)}'
                "</figcaption></figure>")

    words = f"{kind} duplicate" + (f", distance {pairs.distance[p]}" if kind == "near" else "")
    words += f", {turn}" if turn != "as is" else ""
    words += " · across splits" if cross else f" · within {SPLIT_NAMES[int(found.split[a])]}"
    label_note = '<p class="differ">labels differ</p>' if differ else ""
    return (f'<div class="pair{" cross" if cross else ""}" data-kind="{kind}" data-cross="{int(cross)}" '
            f'data-transform="{_e(turn)}" data-distance="{int(pairs.distance[p])}" data-same-label="{int(not differ)}" '
            f'data-a="{_e(SPLIT_NAMES[int(found.split[a])])}:{found.ids[a]}" '
            f'data-b="{_e(SPLIT_NAMES[int(found.split[b])])}:{found.ids[b]}">'
            f"{side(a)}{side(b)}<p>{_e(words)}</p>{label_note}</div>")


def _skipped(result: dict) -> str:
    skipped = result["skipped"]
    if not skipped.get("count"):
        return '<p id="skipped" class="ok">No file was skipped when the data set was prepared.</p>'
    files = skipped.get("files", [])
    rows = [[name, why] for name, why in files[:SKIPPED_SHOWN]]
    more = skipped["count"] - len(rows)
    return (f'<p id="skipped" class="flag">{skipped["count"]:,} file(s) of the source were skipped when the data set '
            "was prepared:</p>" + _table("skipped-table", ["file", "why"], rows, text_columns=(0, 1))
            + (f'<p class="muted">and {more:,} more.</p>' if more > 0 else ""))


def _thumbnails(found: Scan, positions: list[int], storage: str) -> dict[int, str]:
    """{position: data URI} of small JPEG copies, each row group read once."""
    out = {}
    by_block: dict[int, list[int]] = {}
    for p in positions:
        by_block.setdefault(int(found.block[p]), []).append(p)
    for block, members in sorted(by_block.items()):
        path, group = found.blocks[block]
        _, _, pictures = read_block(path, group, storage, found.label_sets is not None)
        for p in members:
            uri = _thumbnail(pictures[int(found.row[p])], storage)
            if uri:
                out[p] = uri
    return out


def _thumbnail(picture, storage: str) -> str | None:
    from PIL import Image, ImageOps

    from imgtrain.data import images

    try:
        if storage == "tensor":
            im = Image.fromarray(picture[..., 0] if picture.shape[-1] == 1 else picture)
        else:
            im = ImageOps.exif_transpose(images.open_image(picture))
        im = im.convert("RGB")
        im.thumbnail((THUMB, THUMB))
        buffer = io.BytesIO()
        im.save(buffer, format="JPEG", quality=85)
    except Exception:  # a stored image that does not decode: shown as such
        return None
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
