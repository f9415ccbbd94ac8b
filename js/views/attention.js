// Attention: a layers × heads overview of one number per head (entropy, or largest weight)
// for a chosen probe sample of the newest eval; a click on a head opens its map large and
// square, with the sample's tokens on the axes and padded positions greyed out.
// Live, an eval brings only the overview: the open head's map is asked of the kernel
// ({type: "attention", step, sample, layer, head, module}; `receive` takes the reply), and
// again when a new eval arrives. The HTML export carries every map (`sample.maps`).
import { baseLayout, CONFIG, el, esc, escTemplate, labelMargin, panel } from "../plot.js";

const MAX_TICKS = 16; // a label every few tokens (all on hover): plotly's cost grows with the labels drawn
const KEEP = 16; // fetched maps held (a few heads, samples and evals to go back to)
const RETRY_MS = 5000; // a fetch with no reply (a busy kernel) is asked again
const MEASURES = { entropy: "entropy (nats)", peak: "largest weight", logit: "largest logit" };

export function create(root, ctx) {
  const p = panel(root, "attention", "Attention");
  const pick = el("select", "nbw-sample-pick");
  const measure = el("select", "nbw-attn-measure");
  for (const [k, label] of Object.entries(MEASURES)) {
    const o = el("option", null, label);
    o.value = k;
    measure.appendChild(o);
  }
  const info = el("span", "nbw-small");
  p.head.append(measure, pick, info);
  // Until the first maps: one line saying when they come (the kernel's `until`: at the
  // first eval, step N where the run's options tell), or why none will (the probe's `note`);
  // no empty figures, no pickers with nothing to pick.
  const empty = el("div", "nbw-small nbw-empty nbw-attn-empty", "no attention maps yet: they come with the first eval");
  const overview = el("div", "nbw-plot nbw-attn-overview");
  const map = el("div", "nbw-plot nbw-attn-map");
  overview.hidden = map.hidden = measure.hidden = pick.hidden = true;
  p.body.append(empty, overview, map);
  let data = null;
  let note = null; // the probe's reason there are no maps: it outranks `until`
  let open = { l: 0, h: 0 };
  // What to redraw: the overview (a new eval, another measure or sample, the open head's
  // frame) and the map (the same, or a fetched map arriving: the overview stays as it is).
  let dirty = false;
  let mapDirty = false;
  let clickable = false;
  const fetched = new Map(); // "step:sample:module:head" → {z: Float32Array [T, S]} or {none}
  const asked = new Map();   // the same key → when it was asked
  const redraw = () => { dirty = mapDirty = true; ctx.schedule(); };
  const keyOf = (step, i, l, h) => `${step}:${i}:${data.modules[l]}:${h}`;
  pick.onchange = redraw;
  measure.onchange = redraw;

  // The head at (layer l, head h) of sample i as rows of weights, null where padded; from
  // the sample's own maps (an export) or a map fetched from the kernel; undefined while
  // that one is on its way.
  function headMap(s, i, l, h) {
    let z;
    if (s.maps) {
      const [, H, T, S] = s.maps.shape;
      const [, t, k] = s.shapes[l];
      const base = (l * H + h) * T * S;
      z = Array.from({ length: t }, (_, q) => {
        const row = new Array(k);
        for (let j = 0; j < k; j++) row[j] = s.maps[base + q * S + j] / 255;
        return row;
      });
    } else {
      const got = fetched.get(keyOf(data.step, i, l, h));
      if (!got) { ask(i, l, h); return undefined; }
      if (!got.map) return [];
      const [t, k] = got.map.shape;
      z = Array.from({ length: t }, (_, q) => Array.from(got.map.subarray(q * k, (q + 1) * k)));
    }
    // A query row with no weight, or a key no query attends to, is padding.
    const rowLive = z.map((r) => r.some((v) => v > 0));
    const colLive = Array.from({ length: z.length ? z[0].length : 0 }, (_, j) => z.some((r) => r[j] > 0));
    return z.map((r, q) => r.map((v, j) => (rowLive[q] && colLive[j] ? v : null)));
  }

  function ask(i, l, h) {
    const key = keyOf(data.step, i, l, h);
    const now = Date.now();
    if (asked.has(key) && now - asked.get(key) < RETRY_MS) return;
    asked.set(key, now);
    ctx.send({ type: "attention", step: data.step, sample: i, layer: l, head: h, module: data.modules[l] });
    setTimeout(() => { if (!fetched.has(key)) { mapDirty = true; ctx.schedule(); } }, RETRY_MS + 50);
  }

  function drawOverview(Plotly, t, s) {
    const L = data.modules.length, H = data.heads;
    const m = measure.value;
    const vals = s[m];
    // An absolute scale (0 to the largest possible), so that heads equal to 0.001 do not
    // look apart: entropy up to ln(keys), the largest weight up to 1.
    const logits = m === "logit" ? data.logit : null; // the probe's, the same for every sample
    let top = m === "peak" ? 1 : Math.log(Math.max(2, ...s.shapes.map((sh) => sh[2])));
    if (logits) top = Math.max(1, ...Array.from(logits).filter(Number.isFinite));
    const z = Array.from({ length: L }, (_, l) => Array.from({ length: H }, (_, h) => {
      const v = logits ? logits[l * H + h] : vals ? vals[l * H + h] : NaN;
      return Number.isFinite(v) && h < s.shapes[l][0] ? v : null;
    }));
    overview.style.height = `${Math.min(Math.max(200, 16 * L + 90), 560)}px`;
    const names = data.modules.map(esc);
    const every = Math.max(1, Math.ceil(L / 40));
    const ticktext = Array.from({ length: Math.ceil(L / every) }, (_, i) => names[i * every]);
    Plotly.react(overview, [{
      type: "heatmap", z, x: Array.from({ length: H }, (_, h) => h), y: Array.from({ length: L }, (_, l) => l),
      colorscale: "Viridis", reversescale: m === "peak", xgap: 1, ygap: 1, zmin: 0, zmax: top,
      colorbar: { thickness: 10, len: 0.9, title: { text: { peak: "max w", logit: "logit", entropy: "nats" }[m], side: "right" } },
      customdata: data.modules.map((mod) => Array.from({ length: H }, () => escTemplate(mod))),
      hovertemplate: `%{customdata} head %{x}<br>${MEASURES[m]} %{z:.3f}<br>click to open<extra></extra>`,
    }], baseLayout(t, {
      margin: { l: labelMargin(ticktext, { ticks: true }), r: 8, t: 24, b: 36 },
      title: { text: `${MEASURES[m]} per head`, font: { size: 11 } },
      xaxis: { title: { text: "head" }, dtick: H > 16 ? 4 : 1, showgrid: false, zeroline: false },
      yaxis: { autorange: "reversed", automargin: true, showgrid: false, zeroline: false, tickfont: { size: 9 },
        tickvals: Array.from({ length: Math.ceil(L / every) }, (_, i) => i * every),
        ticktext },
      shapes: [{ type: "rect", x0: open.h - 0.5, x1: open.h + 0.5, y0: open.l - 0.5, y1: open.l + 0.5,
        line: { color: t.warn, width: 2 } }],
    }), CONFIG);
    if (!clickable) {
      clickable = true;
      overview.on("plotly_click", (ev) => {
        const pt = ev.points && ev.points[0];
        if (!pt) return;
        open = { l: Number(pt.y), h: Number(pt.x) };
        redraw();
      });
    }
  }

  function drawMap(Plotly, t, s, i) {
    const { l, h } = open;
    const z = headMap(s, i, l, h);
    if (z === undefined) { // asked of the kernel: the head stays marked, its map follows
      map.dataset.loading = "1";
      return;
    }
    delete map.dataset.loading;
    const T = z.length, S = z.length ? z[0].length : 0;
    const toks = s.tokens ? s.tokens.slice(0, Math.max(T, S)) : null;
    const label = (i) => (toks && i < toks.length ? esc(JSON.stringify(toks[i]).slice(1, -1)) : String(i));
    const hover = Array.from({ length: T }, (_, q) => Array.from({ length: S }, (_, k) => `${label(q)} → ${label(k)}`));
    const every = Math.max(1, Math.ceil(Math.max(T, S) / MAX_TICKS));
    const ticks = (n) => Array.from({ length: Math.ceil(n / every) }, (_, i) => i * every);
    Plotly.react(map, [{
      type: "heatmap", z, text: hover, colorscale: "Blues", reversescale: true, zmin: 0, zmax: 1,
      colorbar: { thickness: 10, len: 0.9, title: { text: "weight", side: "right" } },
      hovertemplate: `${escTemplate(data.modules[l])} head ${h}<br>%{text}<br>weight %{z:.3f}<extra></extra>`,
    }], baseLayout(t, {
      margin: { l: 8, r: 8, t: 24, b: 8 },
      uirevision: `${i}:${l}:${h}`, // another head or sample: its map unzoomed
      plot_bgcolor: t.grid, // padded positions (null cells) show through as grey
      title: { text: `${esc(data.modules[l])}, head ${h}`, font: { size: 11 } },
      xaxis: { side: "bottom", tickvals: ticks(S), ticktext: ticks(S).map(label), tickangle: -90, tickfont: { size: 9 },
        showgrid: false, zeroline: false, automargin: true, constrain: "domain", title: { text: "key" } },
      yaxis: { autorange: "reversed", tickvals: ticks(T), ticktext: ticks(T).map(label), tickfont: { size: 9 },
        showgrid: false, zeroline: false, automargin: true, scaleanchor: "x", constrain: "domain",
        title: { text: "query" } },
    }), CONFIG);
    p.box.dataset.open = `${l}:${h}`;
    p.box.dataset.mapStep = String(data.step);
  }

  return {
    box: p.box,
    update(d) {
      // the probe is off (a model without attention weights): say why, not when maps come
      if (d.note) note = d.note;
      if (!data && (note || d.until)) empty.textContent = note || d.until;
      if (!d.samples) return;
      data = d;
      empty.hidden = true;
      overview.hidden = map.hidden = measure.hidden = pick.hidden = false;
      const keep = pick.value;
      pick.replaceChildren(...d.samples.map((_, i) => {
        const o = el("option", null, `sample ${i}`);
        o.value = String(i);
        return o;
      }));
      if (keep && Number(keep) < d.samples.length) pick.value = keep;
      info.textContent = `step ${d.step}`;
      measure.querySelector('option[value="logit"]').hidden = !d.logit;
      if (!d.logit && measure.value === "logit") measure.value = "entropy";
      if (open.l >= d.modules.length || open.h >= d.heads) open = { l: 0, h: 0 };
      dirty = mapDirty = true;
    },
    restyle() { dirty = mapDirty = true; },
    draw(Plotly, t) {
      if (!(dirty || mapDirty) || !data) return;
      const i = Number(pick.value) || 0;
      const s = data.samples[i];
      if (dirty) drawOverview(Plotly, t, s);
      if (mapDirty) drawMap(Plotly, t, s, i);
      dirty = mapDirty = false; // a map asked of the kernel draws when it comes (receive)
    },
    // The kernel's reply to a fetch: {step, sample, head, module, map: Float32Array [T, S]
    // or null}; drawn if it is still the head open.
    receive(msg) {
      const key = `${msg.step}:${msg.sample}:${msg.module}:${msg.head}`;
      asked.delete(key);
      fetched.set(key, { map: msg.map || null });
      while (fetched.size > KEEP) fetched.delete(fetched.keys().next().value);
      if (data && key === keyOf(data.step, Number(pick.value) || 0, open.l, open.h)) {
        mapDirty = true;
        ctx.schedule();
      }
    },
  };
}
