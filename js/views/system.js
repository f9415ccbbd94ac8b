// System: a gauge per GPU (util, memory used/total, temperature, power); CPU and RAM
// when there is no GPU. Below them the sampler's readings against wall time (a long step
// holds many samples): utilisation (%) with the step reached, and memory in use (GB).
import { Series, apply } from "../downsample.js";
import { baseLayout, CONFIG, el, fmt, legendAbove, panel } from "../plot.js";

function gauge(label, value, max, text) {
  const row = el("div", "nbw-gauge");
  row.appendChild(el("span", "nbw-gauge-label", label));
  const bar = el("span", "nbw-gauge-bar");
  const fill = el("span", "nbw-gauge-fill");
  const frac = value !== null && value !== undefined && max ? Math.min(Math.max(value / max, 0), 1) : 0;
  fill.style.width = `${Math.round(frac * 100)}%`;
  fill.dataset.level = frac > 0.9 ? "high" : frac > 0.7 ? "mid" : "low";
  bar.appendChild(fill);
  row.append(bar, el("span", "nbw-gauge-text", text));
  return row;
}

// Which chart a key goes to, its label and colour (a GPU's hue follows its index).
const GPU_HUES = [210, 30, 120, 280, 0, 170, 60, 320];
function describe(key) {
  if (key === "system/cpu/util") return { chart: "util", label: "CPU", color: "#1f5fa8" };
  if (key === "system/ram/used_gb") return { chart: "mem", label: "RAM used", color: "#1f5fa8" };
  if (key === "system/proc/rss_gb") return { chart: "mem", label: "process RSS", color: "#17becf", dash: "dot" };
  const m = /^system\/gpu(\d+)\/(util|mem_used_gb|max_allocated_gb)$/.exec(key);
  if (!m) return null;
  const hue = GPU_HUES[Number(m[1]) % GPU_HUES.length];
  if (m[2] === "util") return { chart: "util", label: `GPU ${m[1]}`, color: `hsl(${hue}, 75%, 45%)` };
  if (m[2] === "mem_used_gb") return { chart: "mem", label: `GPU ${m[1]} memory`, color: `hsl(${hue}, 75%, 45%)` };
  return { chart: "mem", label: `GPU ${m[1]} peak allocated`, color: `hsl(${hue}, 75%, 45%)`, dash: "dash" };
}

// Seconds, minutes or hours, from the span the charts cover.
function unitFor(seconds) {
  if (seconds < 600) return { div: 1, name: "s" };
  if (seconds < 36000) return { div: 60, name: "min" };
  return { div: 3600, name: "h" };
}

export function create(root) {
  const p = panel(root, "system", "System");
  const body = el("div", "nbw-gauges");
  const util = el("div", "nbw-plot nbw-half nbw-system-util");
  const mem = el("div", "nbw-plot nbw-half nbw-system-mem");
  util.hidden = mem.hidden = true;
  p.body.append(body, util, mem);
  let series = {}; // key → Series of (ticks since t0, value); "step" too
  let tick = 0.01; // s per x unit: the kernel says (`tick`)
  let dirty = false;

  function lines(chart, scale, unit) {
    const out = [];
    for (const [key, s] of Object.entries(series)) {
      const d = describe(key);
      if (!d || d.chart !== chart || !s.x.length) continue;
      const suffix = chart === "util" ? " %" : " GB";
      out.push({
        name: d.label, x: s.x.map((v) => v * scale), y: s.y, type: "scatter", mode: "lines",
        line: { color: d.color, width: 1.5, dash: d.dash || "solid" },
        hovertemplate: `${d.label}<br>t %{x:.4g} ${unit}<br>%{y:.3g}${suffix}<extra></extra>`,
      });
    }
    return out;
  }

  return {
    box: p.box,
    series: () => series,
    update(d, full) {
      if (full) series = {};
      if (d.tick) tick = d.tick;
      for (const [key, tr] of Object.entries(d.series || {})) {
        dirty = apply(series[key] || (series[key] = new Series()), tr, full) || dirty;
      }
      if (!d || (!d.gpus && d.cpu_util === undefined)) return;
      const rows = [];
      for (const g of d.gpus || []) {
        rows.push(el("div", "nbw-gauge-head", `GPU ${g.index}`));
        rows.push(gauge("util", g.util, 100, `${fmt(g.util, 3)} %`));
        rows.push(gauge("memory", g.mem_used_gb, g.mem_total_gb, `${fmt(g.mem_used_gb, 3)} / ${fmt(g.mem_total_gb, 3)} GB`));
        rows.push(gauge("temp", g.temp_c, 100, `${fmt(g.temp_c, 3)} °C`));
        rows.push(gauge("power", g.power_w, 700, `${fmt(g.power_w, 3)} W`));
      }
      if (!(d.gpus || []).length) {
        rows.push(el("div", "nbw-gauge-head", "CPU (no GPU)"));
        rows.push(gauge("CPU", d.cpu_util, 100, `${fmt(d.cpu_util, 3)} %`));
        rows.push(gauge("RAM", d.ram_used_gb, d.ram_total_gb, `${fmt(d.ram_used_gb, 3)} / ${fmt(d.ram_total_gb, 3)} GB`));
      }
      body.replaceChildren(...rows);
    },
    restyle() { dirty = true; },
    draw(Plotly, t) {
      if (!dirty) return;
      dirty = false;
      let last = 0;
      for (const s of Object.values(series)) if (s.x.length) last = Math.max(last, s.x[s.x.length - 1]);
      const unit = unitFor(last * tick);
      const scale = tick / unit.div;
      const m = { l: 48, r: 40, t: 28, b: 40 };
      const xaxis = { title: { text: `time since the first sample (${unit.name})` }, gridcolor: t.grid, zerolinecolor: t.grid };
      const u = lines("util", scale, unit.name), g = lines("mem", scale, unit.name);
      util.hidden = !u.length;
      mem.hidden = !g.length;
      const steps = series.step;
      if (!util.hidden) {
        if (steps && steps.x.length) u.push({
          name: "step", x: steps.x.map((v) => v * scale), y: steps.y, yaxis: "y2", type: "scatter",
          mode: "lines", line: { color: t.muted, width: 1, dash: "dot", shape: "hv" },
          hovertemplate: `t %{x:.4g} ${unit.name}<br>step %{y}<extra></extra>`,
        });
        Plotly.react(util, u, baseLayout(t, {
          ...legendAbove({ text: "utilisation (%), step reached", x: 0, xanchor: "left" }, m, util.clientHeight), xaxis,
          yaxis: { range: [0, 105], gridcolor: t.grid, zerolinecolor: t.grid },
          yaxis2: { overlaying: "y", side: "right", showgrid: false, rangemode: "tozero", tickformat: "d" },
        }), CONFIG);
      }
      if (!mem.hidden) Plotly.react(mem, g, baseLayout(t, {
        ...legendAbove({ text: "memory in use (GB)", x: 0, xanchor: "left" }, m, mem.clientHeight), xaxis,
        yaxis: { rangemode: "tozero", gridcolor: t.grid, zerolinecolor: t.grid },
      }), CONFIG);
    },
  };
}
