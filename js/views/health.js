// Health: the probe pass's Transformer-health figures over steps: attention entropy and
// largest attention logit per module, the residual stream's RMS per block, and the output
// log-partition with the largest |logit|. Hidden until a probe has run.
import { Series, apply } from "../downsample.js";
import { baseLayout, CONFIG, el, escTemplate, esc, layerColor, panel } from "../plot.js";

const PARTS = {
  entropy: "attention entropy (nats), mean over heads",
  max_logit: "largest attention logit",
  rms: "residual stream RMS after each block",
};

export function create(root, ctx) {
  const p = panel(root, "health", "Health");
  p.box.hidden = true;
  const plots = {};
  for (const k of [...Object.keys(PARTS), "out"]) {
    plots[k] = el("div", `nbw-plot nbw-half nbw-health-${k}`);
    p.body.appendChild(plots[k]);
  }
  const series = { entropy: {}, max_logit: {}, rms: {} };
  const z = new Series(), maxAbs = new Series();
  let dirty = false;

  function lines(part) {
    const names = Object.keys(series[part]);
    return names.map((n, i) => ({
      name: esc(n), x: series[part][n].x, y: series[part][n].y, type: "scatter", mode: "lines+markers",
      marker: { size: 4 }, line: { color: layerColor(i, names.length), width: 1.5 },
      hovertemplate: `${escTemplate(n)}<br>step %{x}<br>%{y:.4g}<extra></extra>`,
    }));
  }

  return {
    box: p.box,
    update(d, full) {
      if (full) { for (const part of Object.keys(series)) series[part] = {}; z.set([], []); maxAbs.set([], []); }
      for (const part of Object.keys(series)) {
        for (const [name, tr] of Object.entries(d[part] || {})) {
          const s = series[part][name] || (series[part][name] = new Series());
          dirty = apply(s, tr, full) || dirty;
        }
      }
      dirty = apply(z, d.z, full) || dirty;
      dirty = apply(maxAbs, d.max_abs, full) || dirty;
    },
    restyle() { dirty = true; },
    draw(Plotly, t) {
      if (!dirty) return;
      dirty = false;
      const any = Object.values(series).some((s) => Object.keys(s).length) || z.x.length;
      p.box.hidden = !any;
      if (!any) return;
      const m = { l: 52, r: 8, t: 24, b: 32 };
      for (const [part, title] of Object.entries(PARTS)) {
        Plotly.react(plots[part], lines(part), baseLayout(t, {
          margin: m, title: { text: title, font: { size: 11 } },
          yaxis: { gridcolor: t.grid, type: part === "max_logit" ? "log" : "linear", exponentformat: "e" },
        }), CONFIG);
      }
      Plotly.react(plots.out, [
        { name: "log Z (mean)", x: z.x, y: z.y, type: "scatter", mode: "lines+markers", marker: { size: 4 },
          line: { color: "#1f5fa8" }, hovertemplate: "step %{x}<br>log Z %{y:.4g}<extra></extra>" },
        { name: "max |logit|", x: maxAbs.x, y: maxAbs.y, type: "scatter", mode: "lines+markers", yaxis: "y2",
          marker: { size: 4 }, line: { color: "#e8740c", dash: "dot" },
          hovertemplate: "step %{x}<br>max |logit| %{y:.4g}<extra></extra>" },
      ], baseLayout(t, {
        margin: { ...m, r: 52 }, title: { text: "output logits: log-partition, max |logit|", font: { size: 11 } },
        yaxis: { title: { text: "log Z" }, gridcolor: t.grid },
        yaxis2: { title: { text: "max |logit|" }, overlaying: "y", side: "right", showgrid: false },
      }), CONFIG);
    },
  };
}
