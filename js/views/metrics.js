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
      // Small multiples: each picked series on its own y axis (one that fits it: a length
      // of 128, an epoch of 1 and 40k samples/s do not share one), the x axis shared, the
      // key written over its row.
      const keys = [...picked].filter((k) => series[k]);
      const n = Math.max(keys.length, 1);
      const rowPx = 78, top = 8, bottom = 32;
      const height = Math.max(280, n * rowPx + top + bottom);
      plot.style.height = `${height}px`;
      const gap = 18 / (height - top - bottom); // room for each row's label
      const layout = baseLayout(t, { margin: { l: 52, r: 8, t: top, b: bottom }, showlegend: false,
        title: { text: keys.length ? "" : "pick metrics on the left", font: { size: 11 } },
        annotations: [] });
      const traces = keys.map((k, i) => {
        const ax = i ? `y${i + 1}` : "y";
        const hi = 1 - i / n, lo = 1 - (i + 1) / n;
        layout[i ? `yaxis${i + 1}` : "yaxis"] = { domain: [lo + (i + 1 < n ? gap * 0.3 : 0), hi - gap],
          gridcolor: t.grid, zerolinecolor: t.grid, nticks: 4, tickfont: { size: 9 }, exponentformat: "SI" };
        const color = layerColor(i, Math.max(keys.length, 2));
        layout.annotations.push({ xref: "paper", yref: "paper", x: 0, y: hi, xanchor: "left", yanchor: "top",
          showarrow: false, text: esc(k), font: { color, size: 10 }, name: "row-label" });
        return {
          name: esc(k), ...t.axis.line(series[k].x, series[k].y), type: "scatter", yaxis: ax,
          mode: series[k].x.length < 60 ? "lines+markers" : "lines", marker: { size: 4 },
          line: { width: 1.5, color },
          hovertemplate: `${escTemplate(k)}<br>${t.axis.hover()}<br>%{y:.4g}<extra></extra>`,
        };
      });
      layout.xaxis = { ...layout.xaxis, anchor: n > 1 ? `y${n}` : "y" }; // ticks under the last row
      Plotly.react(plot, traces, layout, CONFIG);
    },
  };
}
