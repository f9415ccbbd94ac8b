// Ranks (torchrun / DDP; hidden for a one-process run): per-rank step time (busy = data +
// forward, stacked under the rest of the step) and tokens/s, medians over the recent window,
// the slowest rank outlined in the warning colour; the straggler alert; per-rank loss and
// time in nbwatch's exchange over time. One colour per rank throughout.
import { Series, apply } from "../downsample.js";
import { baseLayout, CONFIG, el, fmt, legendAbove, panel, rankColor } from "../plot.js";

const ms = (v) => (v === null || v === undefined ? null : v * 1000);

export function create(root) {
  const p = panel(root, "ranks", "Ranks");
  p.box.style.display = "none";
  const info = el("span", "nbw-small nbw-ranks-info");
  p.head.appendChild(info);
  const warn = el("div", "nbw-warn-line");
  warn.style.display = "none";
  const time = el("div", "nbw-plot nbw-half nbw-ranks-time");
  const tput = el("div", "nbw-plot nbw-half nbw-ranks-tput");
  const loss = el("div", "nbw-plot nbw-half nbw-ranks-loss");
  const sync = el("div", "nbw-plot nbw-half nbw-ranks-sync");
  p.body.append(warn, time, tput, loss, sync);
  let bars = null;
  const lines = { loss: {}, sync: {} }; // rank → Series
  let dirty = false;

  const show = () => {
    const n = Math.max(bars ? bars.ranks.length : 0, Object.keys(lines.loss).length);
    if (n < 2) return false;
    p.box.style.display = "";
    p.box.dataset.ranks = String(n);
    return true;
  };

  return {
    box: p.box,
    update(d, full) {
      if (full) {
        bars = null;
        for (const k in lines) lines[k] = {};
        warn.style.display = "none";
      }
      if (d.ranks) { bars = d; dirty = true; }
      for (const k in lines) {
        for (const [r, tr] of Object.entries(d[k] || {})) {
          const s = lines[k][r] || (lines[k][r] = new Series());
          dirty = apply(s, tr, full) || dirty;
        }
      }
      if (d.straggler) {
        warn.textContent = `step ${d.straggler.step}: ${d.straggler.message}`;
        warn.style.display = "";
      }
    },
    restyle() { dirty = true; },
    draw(Plotly, t) {
      if (!dirty || !show()) return;
      dirty = false;
      const m = { l: 52, r: 8, t: 24, b: 32 };
      if (bars) {
        const b = bars;
        const names = b.ranks.map((r) => `rank ${r}`);
        const colors = b.ranks.map(rankColor);
        const slow = b.ranks.map((r) => r === b.slowest);
        p.box.dataset.slowest = String(b.slowest);
        info.textContent = `${b.ranks.length} ranks · medians of the last ${b.window} recorded steps` +
          (b.to_step !== null && b.to_step !== undefined ? ` (to step ${b.to_step})` : "");
        // The slowest rank: outlined in the warning colour, and named above its bar.
        const outline = { color: slow.map((s) => (s ? t.warn : "rgba(0,0,0,0)")), width: slow.map((s) => (s ? 3 : 0)) };
        const i = b.ranks.indexOf(b.slowest);
        const by = b.slower_by !== null && b.slower_by !== undefined ? ` (busy +${Math.round(b.slower_by * 100)}%)` : "";
        const note = (y, text) => (i < 0 ? [] : [{
          x: names[i], y, yanchor: "bottom", showarrow: false, font: { color: t.warn, size: 11 }, text,
        }]);
        const busy = b.busy_s.map(ms);
        const step = (b.step_s || b.ranks.map(() => null)).map(ms);
        const rest = step.map((s, j) => (s === null || busy[j] === null ? null : Math.max(s - busy[j], 0)));
        const col = (k) => b.ranks.map((_, j) => (b[k] ? b[k][j] : null));
        const custom = b.ranks.map((_, j) => [fmt(ms(col("data_s")[j]), 3), fmt(ms(col("forward_s")[j]), 3),
          fmt(step[j], 3), fmt(ms(col("sync_s")[j]), 3), fmt(col("mem_gb")[j], 3)]);
        const top = Math.max(...b.ranks.map((_, j) => (busy[j] || 0) + (rest[j] || 0)));
        Plotly.react(time, [
          { name: "busy (data + forward)", type: "bar", x: names, y: busy, customdata: custom,
            marker: { color: colors, line: outline },
            hovertemplate: "%{x}<br>busy %{y:.2f} ms (data %{customdata[0]}, forward %{customdata[1]})" +
              "<br>whole step %{customdata[2]} ms<br>nbwatch exchange %{customdata[3]} ms/step" +
              "<br>GPU memory %{customdata[4]} GB<extra></extra>" },
          { name: "rest of step", type: "bar", x: names, y: rest, customdata: custom,
            marker: { color: colors, opacity: 0.35, line: outline },
            hovertemplate: "%{x}<br>rest of step %{y:.2f} ms (backward, gradient sync, optimizer)" +
              "<br>whole step %{customdata[2]} ms<extra></extra>" },
        ], baseLayout(t, { margin: m, barmode: "stack", annotations: note(top, `slowest${by}`),
          title: { text: "step time (ms): busy (solid) + rest of step (faded)", font: { size: 11 } },
          xaxis: { type: "category", gridcolor: t.grid },
          yaxis: { gridcolor: t.grid, range: [0, top * 1.18 || 1] } }), CONFIG);
        const tok = col("tokens_per_s");
        const tmax = Math.max(...tok.map((v) => v || 0));
        Plotly.react(tput, [{
          name: "tokens/s", type: "bar", x: names, y: tok, marker: { color: colors, line: outline },
          hovertemplate: "%{x}<br>%{y:,.0f} tokens/s<extra></extra>",
        }], baseLayout(t, { margin: m, annotations: note(tok[i] || 0, "slowest (by busy time)"),
          // Under DDP every rank waits for the slowest, so this follows each rank's batch size.
          title: { text: "throughput (tokens/s): own tokens ÷ whole step", font: { size: 11 } },
          xaxis: { type: "category", gridcolor: t.grid },
          yaxis: { gridcolor: t.grid, range: [0, tmax * 1.18 || 1] } }), CONFIG);
      }
      const over = (k, scale, label, fmtY) => Object.entries(lines[k]).map(([r, s]) => ({
        name: `rank ${r}`, ...t.axis.line(s.x, scale === 1 ? s.y : s.y.map((v) => v * scale)), type: "scatter",
        mode: k === "sync" ? "lines+markers" : "lines", marker: { size: 3 },
        line: { color: rankColor(Number(r)), width: 1.2 },
        hovertemplate: `rank ${r}<br>${t.axis.hover()}<br>${label} %{y:${fmtY}}<extra></extra>`,
      }));
      Plotly.react(loss, over("loss", 1, "loss", ".4f"), baseLayout(t, {
        ...legendAbove({ text: "loss per rank" }, m, loss.clientHeight) }), CONFIG);
      Plotly.react(sync, over("sync", 1000, "exchange", ".2f"), baseLayout(t, {
        ...legendAbove({ text: "time in nbwatch's exchange (ms)" }, m, sync.clientHeight),
        yaxis: { gridcolor: t.grid, rangemode: "tozero" } }), CONFIG);
    },
  };
}
