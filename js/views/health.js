// Health: the probe pass's Transformer-health figures over steps: attention entropy and
// largest attention logit per module, the residual stream's RMS per block, and the output
// log-partition with the largest |logit|, drawn over the same two figures of every
// training step's batch (train_logits/*). Hidden until there is one of them. Where the
// probe could not take a figure on this model, its words (why, the line to add) stand in
// the figure's place, never empty axes; under the training batch's lines when only the
// probe's output figures are missing.
import { Series, apply } from "../downsample.js";
import { baseLayout, CONFIG, el, endLabels, escTemplate, esc, layerColor, legendAbove, panel, shortNames } from "../plot.js";
import { onZoom, userY, xWindow } from "../yfit.js";

// What stands in a figure's place when the probe pass did not take it on this model.
const NONE = {
  entropy: "attention entropy: no attention weights on this model's probe pass",
  max_logit: "largest attention logit: not measured on this model's probe pass (its attention returned weights, not logits)",
  rms: "residual stream RMS: no repeated blocks on this model (an nn.ModuleList of one block class)",
  out: "output logits: none on the probe pass (its probe event, in the alerts, says why and what to pass)",
};

const PARTS = {
  entropy: "attention entropy (nats), mean over heads",
  max_logit: "largest attention logit",
  rms: "residual stream RMS after each block",
};

export function create(root, ctx) {
  const p = panel(root, "health", "Health");
  p.box.hidden = true;
  const why = el("div", "nbw-small nbw-health-why");
  why.hidden = true;
  why.style.padding = "4px 12px";
  p.body.appendChild(why);
  const plots = {}, notes = {};
  for (const k of [...Object.keys(PARTS), "out"]) {
    plots[k] = el("div", `nbw-plot nbw-half nbw-health-${k}`);
    notes[k] = el("div", `nbw-half nbw-small nbw-health-none nbw-health-none-${k}`);
    notes[k].hidden = true;
    notes[k].style.padding = "24px 12px 0";
    p.body.appendChild(plots[k]);
    p.body.appendChild(notes[k]);
  }
  const series = { entropy: {}, max_logit: {}, rms: {} };
  const z = new Series(), maxAbs = new Series(), trainZ = new Series(), trainMax = new Series();
  let said = {}; // {"logits" | "probe": message}: the probe events' words
  let dirty = false;
  const redraw = () => { dirty = true; ctx.schedule(); };

  function lines(part, ax) {
    const names = Object.keys(series[part]);
    return names.map((n, i) => ({
      name: esc(n), ...ax.line(series[part][n].x, series[part][n].y), type: "scatter", mode: "lines+markers",
      marker: { size: 4 }, line: { color: layerColor(i, names.length), width: 1.5 },
      hovertemplate: `${escTemplate(n)}<br>${ax.hover()}<br>%{y:.4g}<extra></extra>`,
    }));
  }

  return {
    box: p.box,
    update(d, full) {
      if (full) {
        for (const part of Object.keys(series)) series[part] = {};
        for (const s of [z, maxAbs, trainZ, trainMax]) s.set([], []);
        said = {};
      }
      if (d.notes) { said = { ...said, ...d.notes }; dirty = true; }
      for (const part of Object.keys(series)) {
        for (const [name, tr] of Object.entries(d[part] || {})) {
          const s = series[part][name] || (series[part][name] = new Series());
          dirty = apply(s, tr, full) || dirty;
        }
      }
      dirty = apply(z, d.z, full) || dirty;
      dirty = apply(maxAbs, d.max_abs, full) || dirty;
      dirty = apply(trainZ, d.train_z, full) || dirty;
      dirty = apply(trainMax, d.train_max_abs, full) || dirty;
    },
    restyle() { dirty = true; },
    draw(Plotly, t) {
      if (!dirty) return;
      dirty = false;
      const has = {};
      for (const part of Object.keys(series)) has[part] = Object.keys(series[part]).length > 0;
      const probeOut = z.x.length > 0 || maxAbs.x.length > 0;
      const trained = trainZ.x.length > 0 || trainMax.x.length > 0;
      has.out = probeOut || trained;
      // the probe pass has run and is on: a figure it could not take says why in its place
      const probed = !said.probe && (has.entropy || has.max_logit || has.rms || probeOut || !!said.logits);
      p.box.hidden = !Object.values(has).some(Boolean) && !Object.keys(said).length;
      if (p.box.hidden) return;
      why.textContent = said.probe || "";
      why.hidden = !said.probe;
      for (const k of Object.keys(plots)) {
        plots[k].hidden = !has[k];
        const missing = k === "out" ? !probeOut : !has[k];
        notes[k].hidden = !(probed && missing); // the probe off altogether: its one line says why
        notes[k].textContent = (k === "out" && said.logits) || NONE[k];
      }
      // beside the training batch's lines, the probe's missing output figures are a caption
      notes.out.classList.toggle("nbw-half", !has.out);
      notes.out.style.padding = has.out ? "2px 12px" : "24px 12px 0";
      notes.out.style.flexBasis = has.out ? "100%" : "";
      const m = { l: 52, r: 8, t: 24, b: 32 };
      for (const [part, title] of Object.entries(PARTS)) {
        if (!has[part]) continue;
        const traces = lines(part, t.axis);
        const labels = shortNames(Object.keys(series[part]));
        const log = part === "max_logit";
        // zoomed on x: the range and the labels fit the steps in view
        const end = endLabels(traces.map((tr, i) => ({ label: labels[i], color: tr.line.color, x: tr.x, y: tr.y })),
          { log, height: plots[part].clientHeight || 240, top: m.t, bottom: m.b,
            win: xWindow(plots[part], t.axis.active()), y: userY(plots[part]) });
        Plotly.react(plots[part], traces, baseLayout(t, {
          margin: { ...m, r: end.r }, title: { text: title, font: { size: 11 } }, annotations: end.annotations,
          yaxis: { gridcolor: t.grid, type: log ? "log" : "linear", exponentformat: "e", ...end.yaxis },
        }), CONFIG);
        onZoom(plots[part], redraw);
      }
      if (!has.out) return;
      const out = [];
      // every step's training batch: thin lines under the probe's points. The legend has one
      // short entry a figure (a click shows or hides both its lines), the training batch's where
      // it is drawn: four entries took two rows at half width, out of the plot's height. The
      // title says what the dots are.
      if (trainZ.x.length) out.push({ name: "log Z", legendgroup: "z", ...t.axis.line(trainZ.x, trainZ.y), type: "scatter",
        mode: "lines", line: { color: "#1f5fa8", width: 1 }, opacity: 0.45,
        hovertemplate: `${t.axis.hover()}<br>log Z (training batch) %{y:.4g}<extra></extra>` });
      if (trainMax.x.length) out.push({ name: "max |logit|", legendgroup: "max", ...t.axis.line(trainMax.x, trainMax.y),
        type: "scatter", mode: "lines", yaxis: "y2", line: { color: "#e8740c", width: 1, dash: "dot" }, opacity: 0.45,
        hovertemplate: `${t.axis.hover()}<br>max |logit| (training batch) %{y:.4g}<extra></extra>` });
      if (z.x.length) out.push({ name: "log Z, probe", legendgroup: "z", showlegend: !trainZ.x.length, ...t.axis.line(z.x, z.y),
        type: "scatter", mode: "lines+markers", marker: { size: 4 }, line: { color: "#1f5fa8" },
        hovertemplate: `${t.axis.hover()}<br>log Z (probe) %{y:.4g}<extra></extra>` });
      if (maxAbs.x.length) out.push({ name: "max |logit|, probe", legendgroup: "max", showlegend: !trainMax.x.length,
        ...t.axis.line(maxAbs.x, maxAbs.y), type: "scatter", mode: "lines+markers", yaxis: "y2", marker: { size: 4 },
        line: { color: "#e8740c", dash: "dot" }, hovertemplate: `${t.axis.hover()}<br>max |logit| (probe) %{y:.4g}<extra></extra>` });
      const title = trained && probeOut ? "output logits, every step; dots: probe pass" : "output logits: log-partition, max |logit|";
      Plotly.react(plots.out, out, baseLayout(t, {
        // the legend above the lines, not over their start (the run's first steps)
        ...legendAbove({ text: title }, { ...m, r: 52 }, plots.out.clientHeight),
        yaxis: { title: { text: "log Z" }, gridcolor: t.grid },
        yaxis2: { title: { text: "max |logit|" }, overlaying: "y", side: "right", showgrid: false },
      }), CONFIG);
    },
  };
}
