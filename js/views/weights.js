// Weights: a layer's weight histogram over time as a heatmap (layer picker), and the
// update ratios ‖Δw‖/‖w‖ of every layer.
import { Series, apply, bucketWidth } from "../downsample.js";
import { baseLayout, CONFIG, el, esc, escTemplate, layerColor, panel } from "../plot.js";

const MAX_COLUMNS = 200;
const BINS = 64;

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
// (a power of two, from the newest step) and the newest, so early steps stay in view.
function thin(cols) {
  if (cols.length <= MAX_COLUMNS) return cols;
  const w = bucketWidth(cols[cols.length - 1].step, 2 * (MAX_COLUMNS - 1));
  const out = [];
  let prev = null;
  for (const c of cols.slice(0, -1)) {
    const b = Math.floor(c.step / w);
    if (b !== prev) { out.push(c); prev = b; }
  }
  out.push(cols[cols.length - 1]);
  return out;
}

export function create(root, ctx) {
  const p = panel(root, "weights", "Weights");
  const pick = el("select", "nbw-layer-pick");
  p.head.appendChild(pick);
  const heat = el("div", "nbw-plot nbw-half");
  const ratio = el("div", "nbw-plot nbw-half");
  p.body.append(heat, ratio);
  let cols = {};       // layer → [{step, edges, counts}]
  let layers = [];     // depth order
  const ratios = {};   // layer → Series
  let dirty = false;
  pick.onchange = () => { dirty = true; ctx.schedule(); };

  const addLayer = (name) => {
    if (layers.includes(name)) return;
    layers.push(name);
    const o = el("option", null, name);
    o.value = name;
    pick.appendChild(o);
  };

  return {
    box: p.box,
    update(d, full) {
      if (full) { cols = {}; for (const k in ratios) ratios[k].set([], []); }
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
    },
    restyle() { dirty = true; },
    draw(Plotly, t) {
      if (!dirty) return;
      dirty = false;
      const layer = pick.value || layers[0];
      const c = cols[layer] || [];
      const h = c.length ? heatmap(c) : { x: [], y: [], z: [] };
      Plotly.react(heat, [{
        type: "heatmap", x: h.x, y: h.y, z: h.z, colorscale: "Viridis", showscale: false,
        hovertemplate: "step %{x}<br>weight %{y:.3g}<br>fraction %{z:.3f}<extra></extra>",
      }], baseLayout(t, { margin: { l: 52, r: 8, t: 24, b: 32 },
        title: { text: `weight histogram: ${esc(layer || "–")}`, font: { size: 11 } },
        yaxis: { title: { text: "weight" }, gridcolor: t.grid } }), CONFIG);
      const traces = layers.filter((l) => ratios[l]).map((l) => ({
        name: esc(l), x: ratios[l].x, y: ratios[l].y, type: "scatter", mode: "lines+markers",
        marker: { size: 3 },
        line: { color: layerColor(layers.indexOf(l), layers.length), width: l === layer ? 2.5 : 1 },
        hovertemplate: `${escTemplate(l)}<br>step %{x}<br>update ratio %{y:.3e}<extra></extra>`,
      }));
      Plotly.react(ratio, traces, baseLayout(t, { margin: { l: 52, r: 8, t: 24, b: 32 },
        title: { text: "update ratio ‖Δw‖/‖w‖", font: { size: 11 } },
        yaxis: { type: "log", exponentformat: "e", gridcolor: t.grid } }), CONFIG);
    },
  };
}
