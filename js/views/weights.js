// Weights: a layer's weight histogram over time as a heatmap (layer picker), and the
// update ratios ‖Δw‖/‖w‖ of every layer.
import { Series, apply, bucketWidth } from "../downsample.js";
import { baseLayout, CONFIG, el, endLabels, esc, escTemplate, layerColor, panel, shortNames, zsmooth } from "../plot.js";
import { onZoom, userY, xWindow } from "../yfit.js";

const MAX_COLUMNS = 200;
const BINS = 64;

// A heat map's columns reach half a gap either side of their x: the first histogram's
// (step 1, with the next at step 50) would start at step −24. On an axis that starts at 0
// (steps, seconds since the start, tokens) plotly's autorange is clipped there instead: x
// stays autoranged, so a zoom of one's own outlives the live redraws (plotly keeps what the
// user changed while the layout given stays the same: a range given anew at each redraw, as
// this was, undid the zoom at the next refresh) and a double click gives back the whole run,
// which then follows the new columns.
function heatLayout(t, extra) {
  const layout = baseLayout(t, extra);
  const wall = t.axis && t.axis.active && t.axis.active() === "wall";
  if (!wall) layout.xaxis = { ...layout.xaxis, autorangeoptions: { clipmin: 0 } };
  return layout;
}

// Same as nbwatch/panels/weights.py heatmap(): spread each column onto one grid, as fractions.
export function heatmap(cols) {
  let lo = Infinity, hi = -Infinity;
  for (const c of cols) { lo = Math.min(lo, c.edges[0]); hi = Math.max(hi, c.edges[c.edges.length - 1]); }
  if (!(hi > lo)) hi = lo + 1;
  const z = Array.from({ length: BINS }, () => new Array(cols.length).fill(0));
  cols.forEach((c, j) => {
    let total = 0;
    for (let i = 0; i < c.counts.length; i++) total += c.counts[i];
    for (let i = 0; i < c.counts.length; i++) {
      const centre = (c.edges[i] + c.edges[i + 1]) / 2;
      const b = Math.min(Math.max(Math.floor(((centre - lo) / (hi - lo)) * BINS), 0), BINS - 1);
      z[b][j] += total > 0 ? c.counts[i] / total : 0;
    }
  });
  const y = Array.from({ length: BINS }, (_, i) => lo + ((i + 0.5) * (hi - lo)) / BINS);
  return { x: cols.map((c) => c.step), y, z };
}

// Same as nbwatch/panels/weights.py thin(): the first column of each bucket of `w` steps
// (a power of two, from the span of steps) and the newest, so early steps stay in view.
function thin(cols) {
  if (cols.length <= MAX_COLUMNS) return cols;
  const w = bucketWidth(cols[cols.length - 1].step, 2 * (MAX_COLUMNS - 1), cols[0].step);
  const out = [];
  let prev = null;
  for (const c of cols.slice(0, -1)) {
    const b = Math.floor(c.step / w);
    if (b !== prev) { out.push(c); prev = b; }
  }
  out.push(cols[cols.length - 1]);
  return out;
}

const MAX_LINES = 12;
const EDGE = 5; // with many layers: this many highest and lowest

// "transformer.h.3.attn.c_attn" → "transformer.h.3": the block a layer belongs to.
export function blockOf(name) {
  const m = /^(.*?\.\d+)(\.|$)/.exec(name);
  return m ? m[1] : name.split(".")[0];
}

// Every layer's update ratio while they are few; else the picked layer and the layers with
// the EDGE highest and lowest newest ratios (the rest: pick them).
function shownRatios(layers, ratios, picked) {
  const have = layers.filter((l) => ratios[l] && ratios[l].y.length);
  if (have.length <= MAX_LINES) return have;
  const last = (l) => ratios[l].y[ratios[l].y.length - 1];
  const sorted = [...have].sort((a, b) => last(b) - last(a));
  const pick = new Set([...sorted.slice(0, EDGE), ...sorted.slice(-EDGE)]);
  if (ratios[picked]) pick.add(picked);
  return have.filter((l) => pick.has(l));
}

export function create(root, ctx) {
  const p = panel(root, "weights", "Weights");
  const search = el("input", "nbw-layer-search");
  search.type = "search";
  search.placeholder = "filter layers…";
  const pick = el("select", "nbw-layer-pick");
  p.head.append(search, pick);
  // Until the run has a histogram: a line in its place saying when one comes, or that
  // hist_every=0 turns them off (the kernel's `until`), not empty axes; the update ratios
  // beside it where the run has them, across the panel.
  const none = el("div", "nbw-small nbw-empty nbw-weights-none", "no weight histogram yet");
  const heat = el("div", "nbw-plot nbw-half nbw-weights-heat");
  const ratio = el("div", "nbw-plot nbw-half nbw-weights-ratio");
  heat.hidden = ratio.hidden = search.hidden = pick.hidden = true;
  p.body.append(none, heat, ratio);
  let cols = {};       // layer → [{step, edges, counts}]
  let layers = [];     // depth order
  const ratios = {};   // layer → Series
  let dirty = false;
  pick.onchange = () => { dirty = true; ctx.schedule(); };
  search.oninput = () => { relist(); dirty = true; ctx.schedule(); };

  // The picker lists the layers that match the filter, grouped by block ("h.3", "layers.11").
  function relist() {
    const q = search.value.trim().toLowerCase();
    const keep = pick.value;
    const groups = new Map();
    for (const name of layers) {
      if (q && !name.toLowerCase().includes(q)) continue;
      const g = blockOf(name);
      if (!groups.has(g)) groups.set(g, []);
      groups.get(g).push(name);
    }
    pick.replaceChildren(...[...groups].map(([g, names]) => {
      const og = el("optgroup");
      og.label = g;
      og.append(...names.map((n) => { const o = el("option", null, n); o.value = n; return o; }));
      return og;
    }));
    if (keep && [...pick.options].some((o) => o.value === keep)) pick.value = keep;
    search.hidden = pick.hidden = !layers.length; // nothing to pick yet
  }

  const addLayer = (name) => {
    if (layers.includes(name)) return false;
    layers.push(name);
    return true;
  };

  return {
    box: p.box,
    update(d, full) {
      if (full) { cols = {}; for (const k in ratios) ratios[k].set([], []); }
      const before = layers.length;
      if (d.hist) {
        for (const [layer, h] of Object.entries(d.hist)) {
          addLayer(layer);
          const [n, nb] = [h.steps.length, h.counts.length / h.steps.length];
          const add = [];
          for (let j = 0; j < n; j++) {
            add.push({ step: h.steps[j], edges: h.edges.subarray(j * (nb + 1), (j + 1) * (nb + 1)),
              counts: h.counts.subarray(j * nb, (j + 1) * nb) });
          }
          cols[layer] = thin((cols[layer] || []).concat(add));
        }
        dirty = true;
      }
      if (d.ratios) {
        for (const [layer, tr] of Object.entries(d.ratios)) {
          addLayer(layer);
          ratios[layer] = ratios[layer] || new Series();
          apply(ratios[layer], tr, full);
        }
        dirty = true;
      }
      if (d.until) none.textContent = d.until;
      if (layers.length !== before) relist();
    },
    restyle() { dirty = true; },
    draw(Plotly, t) {
      if (!dirty) return;
      dirty = false;
      const layer = pick.value || layers[0];
      const many = layers.length > MAX_LINES;
      const c = cols[layer] || [];
      const any = Object.keys(cols).length > 0;
      none.hidden = any;
      heat.hidden = !any;
      ratio.hidden = !Object.values(ratios).some((r) => r.y.length);
      p.box.dataset.histograms = any ? "yes" : "none";
      if (any) {
      const h = c.length ? heatmap(c) : { x: [], y: [], z: [] };
      const hx = t.axis.x(h.x);
      Plotly.react(heat, [{
        type: "heatmap", x: hx, y: h.y, z: h.z, colorscale: "Viridis", showscale: false, zsmooth: zsmooth(hx, h.y),
        hovertemplate: `${t.axis.hover()}<br>weight %{y:.3g}<br>fraction %{z:.3f}<extra></extra>`,
      }], heatLayout(t, { margin: { l: 52, r: 8, t: 24, b: 32 },
        title: { text: `weight histogram: ${esc(layer || "–")}`, font: { size: 11 } },
        yaxis: { title: { text: "weight" }, gridcolor: t.grid, uirevision: layer } }), CONFIG); // another layer: its own weights' range
      }
      if (ratio.hidden) return;
      const traces = shownRatios(layers, ratios, layer).map((l) => ({
        name: esc(l), ...t.axis.line(ratios[l].x, ratios[l].y), type: "scatter", mode: many && ratios[l].x.length > 30 ? "lines" : "lines+markers", // a point or two: markers, or nothing shows
        marker: { size: 3 },
        line: { color: layerColor(layers.indexOf(l), layers.length), width: l === layer ? 2.5 : 1 },
        hovertemplate: `${escTemplate(l)}<br>${t.axis.hover()}<br>update ratio %{y:.3e}<extra></extra>`,
      }));
      const shown = shownRatios(layers, ratios, layer);
      const labels = shortNames(shown);
      const end = endLabels(traces.map((tr, i) => ({ label: labels[i], color: tr.line.color, x: tr.x, y: tr.y })),
        { log: true, height: ratio.clientHeight || 240, win: xWindow(ratio, t.axis.active()), y: userY(ratio) });
      Plotly.react(ratio, traces, baseLayout(t, { margin: { l: 52, r: end.r, t: 24, b: 32 },
        title: { text: many ? `update ratio ‖Δw‖/‖w‖: ${esc(layer || "–")}, the ${EDGE} highest and lowest`
          : "update ratio ‖Δw‖/‖w‖", font: { size: 11 } }, annotations: end.annotations,
        yaxis: { type: "log", exponentformat: "e", gridcolor: t.grid, ...end.yaxis } }), CONFIG);
      onZoom(ratio, () => { dirty = true; ctx.schedule(); }); // the range and labels fit the window
    },
  };
}
