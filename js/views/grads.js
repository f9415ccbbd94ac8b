// Grads: per-layer grad-norm bars for the latest step in depth order; the global norm over
// time with the post-clip norm and the clip threshold line.
import { Series, apply } from "../downsample.js";
import { baseLayout, COLORS, CONFIG, el, esc, layerColor, panel } from "../plot.js";

export function create(root, ctx) {
  const p = panel(root, "grads", "Gradients");
  const bars = el("div", "nbw-plot nbw-half");
  const line = el("div", "nbw-plot nbw-half");
  p.body.append(bars, line);
  const g = new Series(), c = new Series();
  let layers = [], norms = [], step = null, clip = [];
  let dirty = false;

  return {
    box: p.box,
    series: { global: g, clipped: c },
    update(d, full) {
      if (full) { g.set([], []); c.set([], []); clip = []; }
      dirty = apply(g, d["grad_norm/global"], full) || dirty;
      dirty = apply(c, d["grad_norm/clipped"], full) || dirty;
      if (d.layers) { layers = d.layers; norms = d.norms; step = d.step; dirty = true; }
      if (d.clip) { clip = clip.concat(d.clip); dirty = true; }
    },
    restyle() { dirty = true; },
    draw(Plotly, t) {
      if (!dirty) return;
      dirty = false;
      Plotly.react(bars, [{
        type: "bar", x: layers.map(esc), y: norms, marker: { color: layers.map((_, i) => layerColor(i, layers.length)) },
        hovertemplate: `%{x}<br>grad norm %{y:.4g}<br>step ${step}<extra></extra>`,
      }], baseLayout(t, {
        margin: { l: 48, r: 8, t: 24, b: 90 },
        title: { text: step === null ? "per layer" : `per layer, step ${step}`, font: { size: 11 } },
        xaxis: { tickangle: -45, automargin: true, tickfont: { size: 9 }, gridcolor: t.grid },
        yaxis: { title: { text: "grad norm" }, gridcolor: t.grid },
      }), CONFIG);
      // The clip threshold as a step function of the controls' clip events.
      const last = g.x.length ? g.x[g.x.length - 1] : 0;
      const cx = [], cy = [];
      clip.forEach((e, i) => {
        const end = i + 1 < clip.length ? clip[i + 1].step : last;
        cx.push(e.step, end, null); cy.push(e.value, e.value, null);
      });
      Plotly.react(line, [
        { name: "global norm", x: g.x, y: g.y, type: "scatter", mode: "lines",
          line: { color: COLORS["grad_norm/global"], width: 1.2 },
          hovertemplate: "step %{x}<br>global norm %{y:.4g}<extra></extra>" },
        { name: "after clipping", x: c.x, y: c.y, type: "scatter", mode: "lines",
          line: { color: COLORS["grad_norm/clipped"], width: 1 },
          hovertemplate: "step %{x}<br>after clip %{y:.4g}<extra></extra>" },
        { name: "clip threshold", x: cx, y: cy, type: "scatter", mode: "lines",
          line: { color: COLORS.clip, width: 2, dash: "dash" },
          hovertemplate: "step %{x}<br>clip at %{y:.4g}<extra></extra>" },
      ], baseLayout(t, { margin: { l: 48, r: 8, t: 24, b: 32 }, title: { text: "global norm", font: { size: 11 } } }), CONFIG);
    },
  };
}
