"""The page ``imgtrain serve`` shows at ``/``: draw a digit or drop an image, see the top classes
(a multi-label model's: every label at or over its threshold, with its probability).
A photo model (the photos preset, from /healthz) gets no drawing pad, whose white strokes on
black mean nothing to it: a photo is dropped, pasted or chosen instead.
With "show where the model looked" ticked, the page asks /explain instead of /predict and shows
the map of the predicted class over the image it sent (a server of an export has no /explain:
/healthz says so, and the choice is not offered).

Everything is inline (no scripts, styles or fonts from elsewhere: it works offline, and the
Content-Security-Policy sent with it forbids anything else). A drawing is framed as MNIST frames
its digits before it is sent: the strokes' bounding box scaled to 20/28 of the model's input and
centred, white on black; a dropped file is sent as it is and converted by the server like
``imgtrain predict`` converts files.
"""

CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                           "img-src data: blob:; connect-src 'self'")

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>imgtrain: try the model</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body { font: 15px/1.4 system-ui, sans-serif; margin: 24px; color: #222; max-width: 760px; }
h1 { font-size: 20px; margin: 0 0 4px; } .muted { color: #666; font-size: 13px; }
.row { display: flex; gap: 24px; flex-wrap: wrap; margin-top: 16px; }
canvas#pad { background: #000; border-radius: 6px; touch-action: none; cursor: crosshair; }
#drop { width: 280px; height: 120px; border: 2px dashed #999; border-radius: 6px; display: flex;
        align-items: center; justify-content: center; text-align: center; color: #666; margin-top: 12px; }
#drop.over { border-color: #2a6; color: #2a6; }
button { font: inherit; padding: 6px 14px; margin: 8px 8px 0 0; border-radius: 4px; border: 1px solid #888;
         background: #f4f4f4; cursor: pointer; }
#result { list-style: none; padding: 0; margin: 8px 0; min-width: 260px; }
#result li { display: grid; grid-template-columns: 90px 1fr 64px; gap: 8px; align-items: center; margin: 4px 0; }
.bar { height: 14px; background: #2a6; border-radius: 3px; }
.prob { text-align: right; font-variant-numeric: tabular-nums; }
#top { font-size: 28px; font-weight: 600; min-height: 36px; }
#seen { width: 84px; height: 84px; image-rendering: pixelated; background: #000; border-radius: 4px; }
#looked { width: 84px; height: 84px; image-rendering: pixelated; border-radius: 4px; }
body[data-mode="photos"] #drop { width: 320px; height: 200px; margin-top: 0; }
body[data-mode="photos"] #seen { width: 160px; height: 160px; object-fit: contain; image-rendering: auto;
                                 background: #f4f4f4; }
body[data-mode="photos"] #looked { width: 160px; height: 160px; object-fit: contain; image-rendering: auto; }
#error { color: #b00; min-height: 20px; }
</style></head><body>
<h1>Try the model</h1>
<div class="muted" id="about">loading...</div>
<div class="row">
  <div>
    <div id="draw" hidden>
      <canvas id="pad" width="280" height="280" aria-label="drawing pad"></canvas><br>
      <button id="predict">Predict drawing</button><button id="clear">Clear</button>
    </div>
    <div id="drop">drop an image file here<br>or click to choose one</div>
    <input type="file" id="file" accept="image/png,image/jpeg" hidden>
    <label id="explain-choice" hidden><input type="checkbox" id="explain"> show where the model looked</label>
  </div>
  <div>
    <div class="muted">the model saw</div><img id="seen" alt="">
    <div id="looked-box" hidden><div class="muted">where it looked for its answer</div><img id="looked" alt=""></div>
    <div class="muted">prediction</div><div id="top"></div>
    <ul id="result"></ul><div id="error"></div>
  </div>
</div>
<script>
"use strict";
const pad = document.getElementById("pad"), ctx = pad.getContext("2d");
let shape = [28, 28, 1], drawing = false, last = null;
function clearPad() { ctx.fillStyle = "#000"; ctx.fillRect(0, 0, pad.width, pad.height); }
clearPad();
fetch("healthz").then(r => r.json()).then(h => {
  shape = h.image_shape;
  document.getElementById("about").textContent = h.checkpoint + ": " + h.classes.length + " classes (" +
    h.classes.slice(0, 12).join(", ") + (h.classes.length > 12 ? ", ..." : "") + "), input " +
    shape[0] + "x" + shape[1] + (shape[2] === 1 ? " gray" : " RGB");
  // Digits get the pad; a photo model gets photos (a server without "preset": by its channels).
  const photos = h.preset ? h.preset === "photos" : shape[2] === 3;
  document.body.dataset.mode = photos ? "photos" : "digits";
  document.getElementById("draw").hidden = photos;
  document.getElementById("explain-choice").hidden = !h.explain;  // an export served: no maps
  document.getElementById("drop").innerHTML = photos
    ? "drop a photo here, paste one (Ctrl+V)<br>or click to choose one"
    : "drop an image file here<br>or click to choose one";
  document.body.dataset.ready = "1";
});
function point(e) { const r = pad.getBoundingClientRect(); return [e.clientX - r.left, e.clientY - r.top]; }
pad.addEventListener("pointerdown", e => { drawing = true; last = point(e); pad.setPointerCapture(e.pointerId); });
pad.addEventListener("pointermove", e => {
  if (!drawing) return;
  const p = point(e);
  ctx.strokeStyle = "#fff"; ctx.lineWidth = 22; ctx.lineCap = "round"; ctx.lineJoin = "round";
  ctx.beginPath(); ctx.moveTo(last[0], last[1]); ctx.lineTo(p[0], p[1]); ctx.stroke(); last = p;
});
for (const ev of ["pointerup", "pointercancel"]) pad.addEventListener(ev, () => { drawing = false; });
document.getElementById("clear").onclick = () => {
  clearPad(); show([], ""); document.getElementById("looked-box").hidden = true;
};

// The strokes' bounding box, scaled to 20/28 of the input and centred, as MNIST frames digits.
function framed() {
  const px = ctx.getImageData(0, 0, pad.width, pad.height).data;
  let x0 = pad.width, y0 = pad.height, x1 = -1, y1 = -1;
  for (let y = 0; y < pad.height; y++) for (let x = 0; x < pad.width; x++)
    if (px[(y * pad.width + x) * 4] > 32) { x0 = Math.min(x0, x); x1 = Math.max(x1, x); y0 = Math.min(y0, y); y1 = Math.max(y1, y); }
  if (x1 < 0) return null;
  const [h, w] = shape, out = document.createElement("canvas"); out.width = w; out.height = h;
  const o = out.getContext("2d"); o.fillStyle = "#000"; o.fillRect(0, 0, w, h);
  const bw = x1 - x0 + 1, bh = y1 - y0 + 1, s = Math.min(w, h) * 20 / 28 / Math.max(bw, bh);
  o.imageSmoothingQuality = "high";
  o.drawImage(pad, x0, y0, bw, bh, (w - bw * s) / 2, (h - bh * s) / 2, bw * s, bh * s);
  return out;
}
document.getElementById("predict").onclick = () => {
  const c = framed();
  if (!c) { show([], "draw something first"); return; }
  c.toBlob(b => send(b, c.toDataURL("image/png")), "image/png");
};
const drop = document.getElementById("drop"), file = document.getElementById("file");
drop.onclick = () => file.click();
file.onchange = () => file.files[0] && sendFile(file.files[0]);
drop.addEventListener("dragover", e => { e.preventDefault(); drop.classList.add("over"); });
drop.addEventListener("dragleave", () => drop.classList.remove("over"));
drop.addEventListener("drop", e => {
  e.preventDefault(); drop.classList.remove("over");
  if (e.dataTransfer.files[0]) sendFile(e.dataTransfer.files[0]);
});
document.addEventListener("paste", e => {  // a screenshot or a copied image
  const f = [...e.clipboardData.files].find(f => f.type === "image/png" || f.type === "image/jpeg");
  if (f) { e.preventDefault(); sendFile(f); }
});
function sendFile(f) { send(f, URL.createObjectURL(f)); }
async function send(blob, preview) {
  document.getElementById("seen").src = preview;
  document.getElementById("looked-box").hidden = true;  // until this image's map comes
  document.body.dataset.state = "waiting";
  try {
    const route = document.getElementById("explain").checked ? "explain" : "predict";
    const r = await fetch(route, { method: "POST", body: blob, headers: { "Content-Type": blob.type || "image/png" } });
    const answer = await r.json();
    if (!r.ok) { show([], answer.error || ("HTTP " + r.status)); return; }
    if (answer.explanation) {  // the map of the predicted class over the image as sent
      document.getElementById("looked").src = "data:image/png;base64," + answer.explanation.overlay_png;
      document.getElementById("looked-box").hidden = false;
    }
    if (Array.isArray(answer.labels)) {  // a multi-label model: every label at or over its threshold
      const over = answer.labels.map(l => [l.label, l.probability]);
      show(over, "", over.length ? over.map(l => l[0]).join(", ") : "no label over its threshold");
      return;
    }
    const top = Object.entries(answer.probabilities).sort((a, b) => b[1] - a[1]).slice(0, 5);
    show(top, "", answer.label);
  } catch (err) { show([], String(err)); }
}
function show(top, error, label) {
  const list = document.getElementById("result"); list.replaceChildren();
  for (const [name, p] of top) {
    const li = document.createElement("li"); li.dataset.class = name; li.dataset.prob = p;
    const n = document.createElement("span"); n.textContent = name;
    const bar = document.createElement("div"); bar.className = "bar"; bar.style.width = (100 * p).toFixed(1) + "%";
    const v = document.createElement("span"); v.className = "prob"; v.textContent = (100 * p).toFixed(1) + " %";
    li.append(n, bar, v); list.append(li);
  }
  document.getElementById("top").textContent = label === undefined ? "" : label;
  document.getElementById("error").textContent = error;
  document.body.dataset.state = error ? "error" : (top.length || label ? "answered" : "");
}
</script></body></html>
"""
