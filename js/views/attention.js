// Attention: a layers × heads grid of heatmaps for a chosen probe sample of the newest
// eval, with the sample's tokens on the axes.
import { baseLayout, CONFIG, el, esc, escTemplate, panel } from "../plot.js";

const MAX_TICKS = 24;

export function create(root, ctx) {
  const p = panel(root, "attention", "Attention");
  const pick = el("select", "nbw-sample-pick");
  p.head.appendChild(pick);
  const info = el("span", "nbw-small");
  p.head.appendChild(info);
  const empty = el("div", "nbw-small nbw-empty", "no probe yet: attention maps come with the first eval");
  const plot = el("div", "nbw-plot nbw-attn-plot");
  p.body.append(empty, plot);
  let data = null;
  let dirty = false;
  pick.onchange = () => { dirty = true; ctx.schedule(); };

  return {
    box: p.box,
    update(d) {
      if (!d.samples) return;
      data = d;
      empty.style.display = "none";
      const keep = pick.value;
      pick.replaceChildren(...d.samples.map((_, i) => {
        const o = el("option", null, `sample ${i}`);
        o.value = String(i);
        return o;
      }));
      if (keep && Number(keep) < d.samples.length) pick.value = keep;
      info.textContent = `step ${d.step}`;
      dirty = true;
    },
    restyle() { dirty = true; },
    draw(Plotly, t) {
      if (!dirty || !data) return;
      dirty = false;
      const s = data.samples[Number(pick.value) || 0];
      const [L, H, T, S] = s.maps.shape;
      const toks = s.tokens ? s.tokens.slice(0, Math.max(T, S)) : null;
      const label = (i) => (toks && i < toks.length ? esc(JSON.stringify(toks[i]).slice(1, -1)) : String(i));
      const hover = Array.from({ length: T }, (_, q) => Array.from({ length: S }, (_, k) => `${label(q)} → ${label(k)}`));
      const every = Math.max(1, Math.ceil(Math.max(T, S) / MAX_TICKS));
      const ticks = (n) => Array.from({ length: Math.ceil(n / every) }, (_, i) => i * every);
      const traces = [];
      const layout = baseLayout(t, {
        grid: { rows: L, columns: H, pattern: "independent", xgap: 0.04, ygap: 0.06 },
        margin: { l: 70, r: 8, t: 20, b: 40 },
        annotations: [],
      });
      for (let l = 0; l < L; l++) {
        for (let h = 0; h < H; h++) {
          const n = l * H + h + 1;
          const base = ((l * H + h) * T) * S;
          const z = Array.from({ length: T }, (_, q) => {
            const row = new Array(S);
            for (let k = 0; k < S; k++) row[k] = s.maps[base + q * S + k] / 255;
            return row;
          });
          traces.push({ type: "heatmap", z, text: hover, xaxis: `x${n}`, yaxis: `y${n}`,
            colorscale: "Blues", reversescale: true, zmin: 0, zmax: 1, showscale: false,
            hovertemplate: `${escTemplate(data.modules[l])} head ${h}<br>%{text}<br>weight %{z:.3f}<extra></extra>` });
          const ax = n === 1 ? "" : String(n);
          layout[`xaxis${ax}`] = { showticklabels: l === L - 1, tickvals: ticks(S), ticktext: ticks(S).map(label),
            tickfont: { size: 8 }, tickangle: -90, showgrid: false };
          layout[`yaxis${ax}`] = { autorange: "reversed", showticklabels: h === 0, tickvals: ticks(T),
            ticktext: ticks(T).map(label), tickfont: { size: 8 }, showgrid: false,
            title: h === 0 ? { text: esc(data.modules[l]), font: { size: 9 } } : undefined };
        }
      }
      for (let h = 0; h < H; h++) {
        layout.annotations.push({ text: `head ${h}`, showarrow: false, xref: `x${h === 0 ? "" : h + 1} domain`,
          yref: "paper", x: 0.5, y: 1.0, yanchor: "bottom", font: { size: 10 } });
      }
      plot.style.height = `${Math.max(240, 110 * L + 60)}px`;
      Plotly.react(plot, traces, layout, CONFIG);
    },
  };
}
