// Shared helpers: plotly.js loading (once per page), theme from JupyterLab's --jp-* CSS
// variables, one colour per metric, and unpacking of the kernel's binary buffers.

import { axisLength, dataSpan, logTicks } from "./logaxis.js";
import { fitInto, userY, watch } from "./yfit.js";

const G = globalThis;

// plotly.js travels once per page: the first view asks the kernel for it (a message, so it
// is never saved in the notebook); later views, of any dashboard, reuse the loaded module.
export function plotlyState() {
  if (!G.__nbwatchPlotly) {
    let resolve;
    const promise = new Promise((r) => (resolve = r));
    G.__nbwatchPlotly = { promise, resolve, module: null, asked: 0 };
  }
  return G.__nbwatchPlotly;
}

export function needPlotly() {
  const s = plotlyState();
  if (s.module) return false;
  const now = Date.now();
  if (now - s.asked < 3000) return false; // asked a moment ago: wait for the answer
  s.asked = now;
  return true;
}

export async function receivePlotly(buffer) {
  const s = plotlyState();
  if (s.module) return;
  const url = URL.createObjectURL(new Blob([buffer], { type: "text/javascript" }));
  try {
    const mod = await import(/* webpackIgnore: true */ url);
    if (!s.module) {
      s.module = mod.default;
      s.resolve(s.module);
    }
  } finally {
    URL.revokeObjectURL(url);
  }
}

// {"$buf": i, dtype, shape} → typed array (copied: buffer offsets need not be aligned).
const CTORS = { f4: Float32Array, i4: Int32Array, u1: Uint8Array };
export function unpack(obj, buffers) {
  if (Array.isArray(obj)) return obj.map((v) => unpack(v, buffers));
  if (obj && typeof obj === "object") {
    if ("$buf" in obj) {
      const dv = buffers[obj.$buf];
      const bytes = dv.buffer.slice(dv.byteOffset, dv.byteOffset + dv.byteLength);
      const arr = new CTORS[obj.dtype](bytes);
      arr.shape = obj.shape;
      return arr;
    }
    const out = {};
    for (const k of Object.keys(obj)) out[k] = unpack(obj[k], buffers);
    return out;
  }
  return obj;
}

// One colour per metric, the same in every panel.
export const COLORS = {
  "loss/train": "#7aa6d6",
  "loss/train_smooth": "#1f5fa8",
  "loss/val": "#e8740c",
  gap: "rgba(232,116,12,0.18)",
  lr: "#2ca02c",
  "grad_norm/global": "#d62728",
  "grad_norm/clipped": "#9467bd",
  clip: "#8c564b",
  "data/padding_ratio": "#17becf",
  "data/seq_len": "#e377c2",
  "time/data": "#bcbd22",
  "time/compute": "#7f7f7f",
};
const SEVERITY = { info: "#4a90d9", warning: "#e6a700", critical: "#d62728" };
export const severityColor = (s) => SEVERITY[s] || SEVERITY.info;

// Layers are coloured by depth along one hue ramp, in every panel that shows layers.
export function layerColor(i, n) {
  const t = n > 1 ? i / (n - 1) : 0;
  return `hsl(${Math.round(260 - 220 * t)}, 65%, 50%)`;
}

// Ranks keep one colour each across the ranks panel; none is the warning orange/red, which
// marks the slowest rank.
const RANK_COLORS = ["#1f77b4", "#2ca02c", "#9467bd", "#17becf", "#8c564b", "#e377c2",
  "#7f7f7f", "#bcbd22", "#393b79", "#637939"];
export const rankColor = (r) => RANK_COLORS[r % RANK_COLORS.length];

function cssVar(el, name, fallback) {
  const v = getComputedStyle(el).getPropertyValue(name).trim();
  return v || fallback;
}

export function theme(el) {
  return {
    font: cssVar(el, "--jp-ui-font-color1", "#333"),
    muted: cssVar(el, "--jp-ui-font-color2", "#777"),
    grid: cssVar(el, "--jp-border-color2", "#ddd"),
    bg: cssVar(el, "--jp-layout-color1", "#fff"),
    warn: cssVar(el, "--jp-warn-color1", "#f57c00"),
  };
}

export function baseLayout(t, extra = {}) {
  return {
    autosize: true,
    margin: { l: 48, r: 16, t: 8, b: 32 },
    paper_bgcolor: "rgba(0,0,0,0)",
    plot_bgcolor: "rgba(0,0,0,0)",
    font: { color: t.font, size: 11 },
    showlegend: false,
    hovermode: "closest",
    hoverlabel: { namelength: -1 },
    // the trend panels' x (step, time, tokens: js/axis.js), set on the theme by mount.js
    xaxis: t.axis ? t.axis.xaxis(t) : { gridcolor: t.grid, zerolinecolor: t.grid, title: { text: "step" } },
    // A zoom or pan survives the redraws of a live run (a plot redraws with each refresh):
    // plotly keeps what the user changed while `uirevision` stays the same. Another x axis
    // (step, time, tokens) is another revision: its ranges start over.
    uirevision: t.axis ? t.axis.active() : "step",
    yaxis: { gridcolor: t.grid, zerolinecolor: t.grid },
    ...extra,
  };
}

// What the views draw with: Plotly, whose `react` tells each cartesian axis to leave tick
// labels that reach past the plot's edge alone (plotly's default, "hide past div", measures
// every tick label's box at every draw, which forces a page layout each time: a quarter of
// the dashboard's main-thread time in a Chromium profile of a live run), refits y to the
// x window while x is zoomed (js/yfit.js), and labels each tick of a log y axis with its
// whole value, at 1, 2, 5 of each decade or at whole decades (js/logaxis.js).
const LIGHT = new WeakMap();
export function lighten(Plotly) {
  if (!Plotly || LIGHT.has(Plotly)) return Plotly && LIGHT.get(Plotly);
  const light = Object.create(Plotly);
  light.react = (gd, data, layout, config) => {
    const out = { ...layout };
    for (const k of ["xaxis", "yaxis", ...Object.keys(out)]) {
      if (/^[xy]axis\d*$/.test(k) && !(out[k] && out[k].ticklabeloverflow)) out[k] = { ...out[k], ticklabeloverflow: "allow" };
    }
    fitInto(gd, data, out);
    for (const k of Object.keys(out)) {
      const ax = out[k];
      if (!/^yaxis\d*$/.test(k) || !ax || ax.type !== "log") continue;
      // the range drawn: the view's (or the x window's fit), the user's zoom, or the data's
      const r = Array.isArray(ax.range) && ax.autorange !== true ? ax.range : userY(gd, k);
      out[k] = { ...logTicks(r ? Math.abs(r[1] - r[0]) : dataSpan(data, k), axisLength(gd, k, out.margin)), ...ax };
    }
    const done = Plotly.react(gd, data, out, config);
    watch(Plotly, gd);
    return done;
  };
  LIGHT.set(Plotly, light);
  return light;
}

// A heat map's `zsmooth`: "fast" (plotly draws one image pixel per cell, which the CSS
// scales up pixelated: a grads heat map of 75 layers × 200 columns took half the time of
// plotly's default, a fillRect per cell) where its cells are evenly spaced (category
// labels are) and need no gaps between them; plotly's default otherwise.
export function zsmooth(x, y) {
  return evenly(x) && evenly(y) ? "fast" : false;
}
function evenly(v) {
  if (!v || v.length < 3 || typeof v[0] !== "number") return true;
  const step = (v[v.length - 1] - v[0]) / (v.length - 1);
  for (let i = 1; i < v.length; i++) if (!(Math.abs(v[i] - v[i - 1] - step) <= Math.abs(step / 100))) return false;
  return true;
}

// The left margin a y axis's tick labels take: plotly's `automargin` finds it by drawing
// the plot, measuring the labels and, when the margin changed, drawing the whole plot again
// (a fifth of a cold first draw: the grads heat map and bars, the attention overview).
// Given the margin they take up front (measured on a canvas, no layout: the labels' widest
// text in plotly's font, plus the gap plotly leaves between a label and its axis), plotly
// finds nothing to push and draws once; `automargin` stays on, so a label wider than this
// still gets its room (and that one redraw). `labels` are the tick texts as shown (esc'd
// text is measured unescaped); `ticks`: the axis draws outside ticks of 5 px (heat maps).
// The gaps as plotly 3.7 leaves them (measured: a label's box to the plot's edge, 9 px, and
// 15.8 px past outside ticks), with 0.1 px to spare: plotly redraws only past a 1 px change.
const GAP = 9.1, TICKS_GAP = 15.9;
let measurer = null;
export function labelMargin(labels, { size = 9, ticks = false, min = 8 } = {}) {
  const w = textWidth(labels, size);
  return w === null ? min : Math.max(min, Math.ceil(w + (ticks ? TICKS_GAP : GAP)));
}

// The widest of `texts` (as shown: esc'd text is measured unescaped) in plotly's default
// font at `size` px, measured on a canvas (no layout); null where there is no canvas.
export function textWidth(texts, size = 11) {
  if (!measurer) measurer = document.createElement("canvas").getContext("2d");
  if (!measurer) return null;
  measurer.font = `${size}px "Open Sans", verdana, arial, sans-serif`; // plotly's default font
  let w = 0;
  for (const s of texts) {
    const text = String(s).replace(/&lt;/g, "<").replace(/&gt;/g, ">").replace(/&amp;/g, "&");
    w = Math.max(w, measurer.measureText(text).width);
  }
  return w;
}

// Figures side by side keep each title inside its own figure (centred on it, a title wider
// than its figure runs into the next one's): each figure is at least as wide as its title,
// so a row too narrow for them all wraps. Set before the figure is drawn (plotly sizes the
// figure to its box); the panel's own width caps it.
export function fitTitle(div, title, size = 11) {
  const w = textWidth([title], size);
  div.style.minWidth = w === null ? "" : `min(100%, ${Math.ceil(w) + 16}px)`;
}

// A legend off the data: its row (or rows, as many as its entries wrap to) above the plot
// area at the right, under the figure's title. Both are placed in the figure (yref
// "container"): the title at its top, the legend's top TITLE px down. A legend placed so
// reserves the top margin down to its bottom (plotly), so the plot area starts under it, at
// any width or number of entries: the title, the legend and the data never cover one another.
// `height`: the figure's height in px (its div's); `title` may carry `x`/`xanchor` (a title at
// the left); `margin`: the figure's other margins (its top one is the title's and legend's).
const TITLE = 20;
export function legendAbove(title, margin, height) {
  return {
    margin: { ...margin, t: 0 },
    title: { font: { size: 11 }, ...title, yref: "container", y: 1, yanchor: "top", pad: { t: 5 } },
    showlegend: true,
    legend: { orientation: "h", x: 1, xanchor: "right", yref: "container", y: 1 - TITLE / Math.max(height || 240, 2 * TITLE),
      yanchor: "top", font: { size: 10 } },
  };
}

export const CONFIG = { displaylogo: false, responsive: true, modeBarButtonsToRemove: ["select2d", "lasso2d"] };

export function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text; // user strings: always text, never HTML
  return e;
}

export function panel(root, name, title) {
  const box = el("section", `nbw-panel nbw-${name}`);
  box.dataset.panel = name;
  const head = el("div", "nbw-panel-head");
  head.appendChild(el("span", "nbw-panel-title", title));
  box.appendChild(head);
  const body = el("div", "nbw-panel-body");
  box.appendChild(body);
  root.appendChild(box);
  return { box, head, body };
}

export const fmt = (v, digits = 4) =>
  v === null || v === undefined || !Number.isFinite(v) ? "–" : Number(v).toPrecision(digits);

export function duration(s) {
  if (s === null || s === undefined || !Number.isFinite(s)) return "–";
  s = Math.round(s);
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), sec = s % 60;
  return h ? `${h}h${String(m).padStart(2, "0")}m` : m ? `${m}m${String(sec).padStart(2, "0")}s` : `${sec}s`;
}

// Plotly draws a subset of HTML in titles, tick labels and hover text: a layer name, a
// token or an alert message from someone else's run is shown as text, never as markup.
export function esc(s) {
  return String(s).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
}

// Inside a hovertemplate, plotly also expands `%{...}`: a name there keeps its `%` as text.
export function escTemplate(s) {
  return esc(s).replace(/%/g, "&#37;");
}

// Names without the prefix they all share ("blocks.0.attn", "blocks.1.attn" → "0.attn",
// "1.attn"), cut at a dot or slash so a label stays a word.
export function shortNames(names) {
  if (names.length < 2) return names.slice();
  let p = names[0];
  for (const n of names) while (p && !n.startsWith(p)) p = p.slice(0, -1);
  let cut = Math.max(p.lastIndexOf("."), p.lastIndexOf("/"));
  // "blocks.0", "blocks.1" → "blocks.0", not a bare "0": keep the word before a number
  if (names.some((n) => /^\d+$/.test(n.slice(cut + 1)))) {
    cut = Math.max(p.lastIndexOf(".", cut - 1), p.lastIndexOf("/", cut - 1));
  }
  const k = cut + 1;
  return names.map((n) => (n.length > k ? n.slice(k) : n));
}

// Direct labels at the right end of each line: the plot reads without hovering or a legend.
// `lines`: [{label, color, x, y (the line's points)}]; `log`: a log y axis. The y range is set
// here (so a label sits where its line ends), and labels closer than one text line are
// pushed apart. `win`: the x window in view (js/yfit.js xWindow; null: all of it): the range
// fits the points inside it, each label at its line's last point there; `y`: the user's own
// y range (a zoom on y), kept. Returns {yaxis: {range}, annotations, r (right margin, px)}.
export function endLabels(lines, { log = false, height = 240, top = 24, bottom = 32, win = null, y = null } = {}) {
  const f = (v) => (log ? (v > 0 ? Math.log10(v) : NaN) : v);
  let lo = Infinity, hi = -Infinity;
  const ends = [];
  for (const l of lines) {
    let last = NaN;
    for (let i = 0; i < l.y.length; i++) {
      const u = f(l.y[i]);
      if (!Number.isFinite(u)) continue;
      if (win && !(l.x && l.x[i] >= win[0] && l.x[i] <= win[1])) continue;
      lo = Math.min(lo, u); hi = Math.max(hi, u); last = u;
    }
    if (Number.isFinite(last)) ends.push({ ...l, at: last });
  }
  if (!ends.length) return { yaxis: y ? { range: y, autorange: false } : {}, annotations: [], r: 8 };
  if (!(hi > lo)) { const d = Math.abs(hi) * 0.1 || 1; lo -= d; hi += d; }
  const pad = (hi - lo) * 0.06;
  lo -= pad; hi += pad;
  if (y) [lo, hi] = y;
  const gap = 11 / Math.max(height - top - bottom, 40); // one label's height, as a fraction
  // a line that ends outside a y range the user chose: its label at the edge it ran off
  ends.forEach((e) => { e.frac = Math.min(1, Math.max(0, (e.at - lo) / (hi - lo))); });
  ends.sort((a, b) => a.frac - b.frac);
  for (let i = 1; i < ends.length; i++) ends[i].frac = Math.max(ends[i].frac, ends[i - 1].frac + gap);
  const over = ends[ends.length - 1].frac - 1;
  if (over > 0) for (const e of ends) e.frac -= over; // shift down what ran off the top
  for (let i = ends.length - 2; i >= 0; i--) ends[i].frac = Math.min(ends[i].frac, ends[i + 1].frac - gap);
  const longest = Math.max(...ends.map((e) => e.label.length));
  return {
    yaxis: { range: [lo, hi], autorange: false },
    annotations: ends.map((e) => ({
      xref: "paper", yref: "paper", x: 1, y: e.frac, xanchor: "left", yanchor: "middle", xshift: 4,
      showarrow: false, text: esc(e.label), font: { color: e.color, size: 10 }, align: "left",
      name: "end-label",
    })),
    r: Math.min(12 + 6 * longest, 130),
  };
}
