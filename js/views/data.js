// Data: padding ratio over time, the sequence-length histogram, and step time split into
// data wait and compute.
import { Series, apply } from "../downsample.js";
import { baseLayout, COLORS, CONFIG, el, fitTitle, panel } from "../plot.js";

export function create(root) {
  const p = panel(root, "data", "Data");
  const pad = el("div", "nbw-plot nbw-third");
  const hist = el("div", "nbw-plot nbw-third nbw-data-hist");
  const time = el("div", "nbw-plot nbw-third");
  p.body.append(pad, hist, time);
  const s = { padding: new Series(), time_data: new Series(), time_compute: new Series() };
  let seq = null;
  let dirty = false;
  const m = { l: 48, r: 8, t: 24, b: 32 };
  return {
    box: p.box,
    update(d, full) {
      for (const k in s) dirty = apply(s[k], d[k], full) || dirty;
      if (d.seq_len) { seq = d.seq_len; dirty = true; }
    },
    restyle() { dirty = true; },
    draw(Plotly, t) {
      if (!dirty) return;
      dirty = false;
      // A figure the run does not record is not drawn as empty axes: the others take its room.
      pad.hidden = !s.padding.x.length;
      hist.hidden = !seq;
      time.hidden = !s.time_data.x.length && !s.time_compute.x.length;
      p.box.hidden = pad.hidden && hist.hidden && time.hidden;
      const titles = { pad: "padding ratio", hist: seq ? `sequence lengths (to step ${seq.step})` : "sequence lengths",
        time: "step time (ms): data + compute" };
      fitTitle(pad, titles.pad); fitTitle(hist, titles.hist); fitTitle(time, titles.time);
      if (!pad.hidden) Plotly.react(pad, [{ ...t.axis.line(s.padding.x, s.padding.y), type: "scatter", mode: "lines",
        line: { color: COLORS["data/padding_ratio"] }, hovertemplate: `${t.axis.hover()}<br>padding %{y:.1%}<extra></extra>` }],
      baseLayout(t, { margin: m, title: { text: titles.pad, font: { size: 11 } },
        yaxis: { tickformat: ".0%", gridcolor: t.grid, rangemode: "tozero" } }), CONFIG);
      const centres = [], widths = [];
      if (seq) for (let i = 0; i < seq.counts.length; i++) {
        centres.push((seq.edges[i] + seq.edges[i + 1]) / 2); widths.push(seq.edges[i + 1] - seq.edges[i]);
      }
      if (!hist.hidden) Plotly.react(hist, [{ type: "bar", x: centres, y: seq ? Array.from(seq.counts) : [], width: widths,
        marker: { color: COLORS["data/seq_len"] }, hovertemplate: "length ≈ %{x:.0f}<br>%{y} samples<extra></extra>" }],
      baseLayout(t, { margin: m, title: { text: titles.hist, font: { size: 11 } },
        xaxis: { title: { text: "tokens" }, gridcolor: t.grid }, bargap: 0 }), CONFIG);
      if (!time.hidden) Plotly.react(time, [
        { name: "data wait", x: t.axis.x(s.time_data.x), y: s.time_data.y.map((v) => v * 1000), type: "scatter", mode: "lines",
          stackgroup: "t", line: { color: COLORS["time/data"], width: 0.5 }, hovertemplate: `${t.axis.hover()}<br>data %{y:.1f} ms<extra></extra>` },
        { name: "compute", x: t.axis.x(s.time_compute.x), y: s.time_compute.y.map((v) => v * 1000), type: "scatter", mode: "lines",
          stackgroup: "t", line: { color: COLORS["time/compute"], width: 0.5 }, hovertemplate: `${t.axis.hover()}<br>compute %{y:.1f} ms<extra></extra>` },
      ], baseLayout(t, { margin: m, title: { text: titles.time, font: { size: 11 } } }), CONFIG);
    },
  };
}
