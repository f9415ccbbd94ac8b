// Metrics: every recorded series no other panel draws over time (a val metric, lr/group1, a
// step_fn's or log()'s own scalars, per-layer grad norms): a search box and a key list pick
// what the plot shows.
import { Series, apply } from "../downsample.js";
import { baseLayout, CONFIG, el, escTemplate, esc, layerColor, panel } from "../plot.js";

const DEFAULT_SHOWN = 4;

// The first keys a user wants: val and LR groups and their own scalars before per-layer norms.
function rank(key) {
  return key.startsWith("grad_norm/") ? 2 : key.startsWith("val/") || key.startsWith("lr") ? 0 : 1;
}

export function create(root, ctx) {
  const p = panel(root, "metrics", "Metrics");
  const search = el("input", "nbw-metric-search");
  search.type = "search";
  search.placeholder = "filter metrics…";
  p.head.appendChild(search);
  const list = el("div", "nbw-metric-list");
  const plot = el("div", "nbw-plot nbw-metric-plot");
  p.body.append(list, plot);
  p.box.hidden = true;
  const series = {};
  const picked = new Set();
  let touched = false; // the user chose: no more default picks
  let dirty = false;
  let listed = "";

  function relist() {
    const q = search.value.trim().toLowerCase();
    const keys = Object.keys(series).sort((a, b) => rank(a) - rank(b) || a.localeCompare(b));
    const shown = keys.filter((k) => !q || k.toLowerCase().includes(q));
    const sig = q + "|" + shown.join("|") + "|" + [...picked].join("|");
    if (sig === listed) return;
    listed = sig;
    list.replaceChildren(...shown.map((k) => {
      const row = el("label", "nbw-metric-item");
      const box = el("input");
      box.type = "checkbox";
      box.checked = picked.has(k);
      box.dataset.key = k;
      box.addEventListener("change", () => {
        touched = true;
        if (box.checked) picked.add(k); else picked.delete(k);
        dirty = true;
        relist();
        ctx.schedule();
      });
      row.append(box, el("span", "", k)); // a key is text, never markup
      return row;
    }));
  }
  search.addEventListener("input", relist);

  return {
    box: p.box,
    update(d, full) {
      const got = d.series || {};
      if (full) for (const k of Object.keys(series)) if (!got[k]) delete series[k];
      for (const [k, tr] of Object.entries(got)) {
        if (!series[k]) series[k] = new Series();
        dirty = apply(series[k], tr, full) || dirty;
      }
      const keys = Object.keys(series).sort((a, b) => rank(a) - rank(b) || a.localeCompare(b));
      if (!touched) for (const k of keys) if (picked.size < DEFAULT_SHOWN && rank(k) < 2) picked.add(k);
      p.box.hidden = keys.length === 0;
      relist();
    },
    restyle() { dirty = true; },
    draw(Plotly, t) {
      if (!dirty || p.box.hidden) return;
      dirty = false;
      const keys = [...picked].filter((k) => series[k]);
      Plotly.react(plot, keys.map((k, i) => ({
        name: esc(k), x: series[k].x, y: series[k].y, type: "scatter", mode: "lines+markers",
        marker: { size: 3 }, line: { width: 1.5, color: layerColor(i, Math.max(keys.length, 2)) },
        hovertemplate: `${escTemplate(k)}<br>step %{x}<br>%{y:.4g}<extra></extra>`,
      })), baseLayout(t, { margin: { l: 52, r: 8, t: 24, b: 32 },
        title: { text: keys.length ? "" : "pick metrics on the left", font: { size: 11 } },
        showlegend: true }), CONFIG);
    },
  };
}
