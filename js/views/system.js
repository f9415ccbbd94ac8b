// System: a gauge per GPU (util, memory used/total, temperature, power); CPU and RAM
// when there is no GPU.
import { el, fmt, panel } from "../plot.js";

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

export function create(root) {
  const p = panel(root, "system", "System");
  const body = el("div", "nbw-gauges");
  p.body.appendChild(body);
  return {
    box: p.box,
    update(d) {
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
    draw() {},
  };
}
