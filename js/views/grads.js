// Grads: a layer × step heat map of per-layer grad norms (log colour, its bar labelled with
// the norms; depth order: which layer, and when), the newest step's largest norms as bars
// (every layer one click away), and the global norm over time with the post-clip norm and the
// clip threshold line, on a log y axis where the norms span more than LOG_SPAN (a spike of 1e3
// would flatten the rest), until a click on its "log y" says otherwise.
import { Series, apply } from "../downsample.js";
import { logColorTicks } from "../logaxis.js";
import { baseLayout, COLORS, CONFIG, el, esc, labelMargin, layerColor, legendAbove, panel, zsmooth } from "../plot.js";
import { blockOf } from "./weights.js";

const TOP = 12; // bars shown before "all layers"
const LOG_SPAN = 100; // the global norm's largest / smallest past which its y axis is log

// Largest over smallest of the positive finite values of `series` (1 where there are none).
export function span(...series) {
  let lo = Infinity, hi = 0;
  for (const s of series) for (const v of s.y) if (v > 0 && Number.isFinite(v)) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
  return hi > 0 ? hi / lo : 1;
}

export function create(root, ctx) {
  const p = panel(root, "grads", "Gradients");
  const more = el("button", "nbw-btn nbw-grads-all", "all layers");
  more.hidden = true;
  // The global norm's y scale: log by default where the norms span > 2 decades; a click
  // keeps the user's choice (for this page) whatever the norms do after.
  const logLabel = el("label", "nbw-toggle nbw-grads-logy-label");
  const logBox = el("input", "nbw-grads-logy");
  logBox.type = "checkbox";
  logLabel.append(logBox, document.createTextNode(" log y"));
  logLabel.title = `global norm on a log y axis (on by itself where the norms span more than ${LOG_SPAN}×, until clicked)`;
  p.head.append(more, logLabel);
  const heatDiv = el("div", "nbw-plot nbw-grads-heat");
  const bars = el("div", "nbw-plot nbw-half nbw-grads-bars");
  const line = el("div", "nbw-plot nbw-half nbw-grads-norm");
  p.body.append(heatDiv, bars, line);
  const g = new Series(), c = new Series();
  let layers = [], norms = [], step = null, clip = [];
  let heat = null; // {w, c0, z: [layer][column from c0]} of raw norms
  let all = false;
  let chosen = null; // "log" | "linear": the user's click; null: by the norms' span
  let dirty = false;
  more.onclick = () => { all = !all; dirty = true; ctx.schedule(); };
  logBox.onchange = () => { chosen = logBox.checked ? "log" : "linear"; dirty = true; ctx.schedule(); };

  function foldHeat(h) {
    const rows = Array.from({ length: h.z.shape[0] }, (_, i) =>
      Array.from(h.z.subarray(i * h.z.shape[1], (i + 1) * h.z.shape[1])));
    if (!heat || heat.w !== h.w || h.c0 <= heat.c0 || rows.length !== heat.z.length) {
      heat = { w: h.w, c0: h.c0, z: rows }; // the whole map, from its first column
    } else heat.z = heat.z.map((r, i) => r.slice(0, h.c0 - heat.c0).concat(rows[i]));
  }

  function drawHeat(Plotly, t) {
    if (!heat || !layers.length) { heatDiv.hidden = true; return; }
    heatDiv.hidden = false;
    const n = heat.z.length, cols = heat.z[0].length;
    const ax = t.axis;
    const x = ax.x(Array.from({ length: cols }, (_, j) => (heat.c0 + j) * heat.w));
    let lo = Infinity, hi = -Infinity;
    const logz = heat.z.map((r) => r.map((v) => {
      if (!(v > 0 && Number.isFinite(v))) return null;
      const u = Math.log10(v);
      if (u < lo) lo = u;
      if (u > hi) hi = u;
      return u;
    }));
    const height = Math.min(Math.max(160, 12 * n + 80), 720);
    heatDiv.style.height = `${height}px`;
    const names = layers.slice(0, n).map(esc);
    // Every row identifiable: a label every `every` rows (≥ 11 px apart; all on hover),
    // and a line where one block ends and the next begins.
    const every = Math.max(1, Math.ceil(11 / ((height - 56) / Math.max(n, 1))));
    const tickvals = names.filter((_, i) => i % every === 0);
    const bounds = [];
    for (let i = 1; i < n; i++) if (blockOf(layers[i]) !== blockOf(layers[i - 1])) bounds.push(1 - i / n); // paper units: rows fill the axis, top to bottom
    Plotly.react(heatDiv, [{
      // the colour is log₁₀ of the norm; its bar labels each tick with the norm (0.01, not −2)
      type: "heatmap", x, y: names, z: logz, customdata: heat.z, colorscale: "Viridis",
      colorbar: { title: { text: "norm (log scale)", side: "right" }, thickness: 10, len: 0.9,
        tickfont: { size: 10 }, ...logColorTicks(lo, hi, 0.9 * (height - 56)) },
      hovertemplate: `%{y}<br>${ax.mode === "step" ? "steps %{x}…" : ax.hover()} (${heat.w} step${heat.w > 1 ? "s" : ""} a bin)<br>max grad norm %{customdata:.4g}<extra></extra>`,
      xgap: 0, ygap: n > 60 ? 0 : 1, zsmooth: n > 60 ? zsmooth(x, names) : false,
    }], baseLayout(t, {
      margin: { l: labelMargin(tickvals, { ticks: true }), r: 8, t: 24, b: 32 },
      title: { text: `per-layer grad norm (bins of ${heat.w} step${heat.w > 1 ? "s" : ""}, max)`, font: { size: 11 } },
      yaxis: { autorange: "reversed", automargin: true, tickfont: { size: 9 }, type: "category", tickvals, ticktext: tickvals },
      shapes: bounds.map((y) => ({ type: "line", xref: "paper", x0: 0, x1: 1, yref: "paper", y0: y, y1: y,
        layer: "above", line: { color: t.font, width: 1.5 }, opacity: 0.8 })),
    }), CONFIG);
  }

  return {
    box: p.box,
    series: { global: g, clipped: c },
    update(d, full) {
      if (full) { g.set([], []); c.set([], []); clip = []; heat = null; }
      dirty = apply(g, d["grad_norm/global"], full) || dirty;
      dirty = apply(c, d["grad_norm/clipped"], full) || dirty;
      if (d.layers) { layers = d.layers; norms = d.norms; step = d.step; dirty = true; }
      if (d.heat) { foldHeat(d.heat); dirty = true; }
      if (d.clip) { clip = clip.concat(d.clip); dirty = true; }
    },
    restyle() { dirty = true; },
    draw(Plotly, t) {
      if (!dirty) return;
      dirty = false;
      drawHeat(Plotly, t);
      // The newest step: the TOP largest norms, largest first; or every layer in depth order.
      const order = layers.map((_, i) => i);
      if (!all) order.sort((a, b) => norms[b] - norms[a]).splice(TOP);
      more.hidden = layers.length <= TOP;
      more.textContent = all ? `top ${TOP}` : `all ${layers.length} layers`;
      bars.style.height = `${Math.max(240, 14 * order.length + 60)}px`;
      const barNames = order.map((i) => esc(layers[i]));
      Plotly.react(bars, [{
        type: "bar", orientation: "h", y: barNames, x: order.map((i) => norms[i]),
        marker: { color: order.map((i) => layerColor(i, layers.length)) },
        hovertemplate: `%{y}<br>grad norm %{x:.4g}<br>step ${step}<extra></extra>`,
      }], baseLayout(t, {
        margin: { l: labelMargin(barNames), r: 8, t: 24, b: 32 },
        title: { text: step === null ? "per layer" : all ? `every layer, step ${step}` : `largest ${order.length}, step ${step}`, font: { size: 11 } },
        xaxis: { title: { text: "grad norm" }, gridcolor: t.grid },
        yaxis: { autorange: "reversed", automargin: true, tickfont: { size: 9 }, type: "category" },
      }), CONFIG);
      // The clip threshold as a step function of the controls' clip events.
      const ax = t.axis;
      const last = g.x.length ? g.x[g.x.length - 1] : 0;
      const cx = [], cy = [];
      clip.forEach((e, i) => {
        const end = i + 1 < clip.length ? clip[i + 1].step : last;
        cx.push(ax.at(e.step), ax.at(end), null); cy.push(e.value, e.value, null);
      });
      const scale = chosen || (span(g, c) > LOG_SPAN ? "log" : "linear");
      logBox.checked = scale === "log";
      p.box.dataset.normScale = chosen ? scale : `${scale} (auto)`;
      Plotly.react(line, [
        { name: "global norm", ...ax.line(g.x, g.y), type: "scatter", mode: "lines",
          line: { color: COLORS["grad_norm/global"], width: 1.2 },
          hovertemplate: `${ax.hover()}<br>global norm %{y:.4g}<extra></extra>` },
        { name: "after clipping", ...ax.line(c.x, c.y), type: "scatter", mode: "lines",
          line: { color: COLORS["grad_norm/clipped"], width: 1 },
          hovertemplate: `${ax.hover()}<br>after clip %{y:.4g}<extra></extra>` },
        { name: "clip threshold", x: cx, y: cy, type: "scatter", mode: "lines",
          line: { color: COLORS.clip, width: 2, dash: "dash" },
          hovertemplate: `${ax.hover()}<br>clip at %{y:.4g}<extra></extra>` },
      ], baseLayout(t, { ...legendAbove({ text: "global norm", x: 0, xanchor: "left" }, { l: 48, r: 8, b: 32 }, line.clientHeight),
        // another scale keeps a zoom on x; one on y (in the other scale's units) starts over
        yaxis: { type: scale, gridcolor: t.grid, zerolinecolor: t.grid, exponentformat: "e",
          uirevision: `${ax.active()}:${scale}` } }), CONFIG);
    },
  };
}
