// Loss: train raw + smoothed (a slider sets the smoothing, as TensorBoard's does: js/smooth.js),
// val points, the val−train gap shaded, LR on a second y axis, a log-y toggle, one hover for
// every line at a step, and markers where an action or alert happened. A click on a loss spike's
// marker shows its post-mortem under the chart: the kernel's lines (diagnose()'s timeline),
// sent with the panel (`postmortems`, by step); nothing is computed here.
import { Series, apply } from "../downsample.js";
import { baseLayout, COLORS, CONFIG, el, esc, escTemplate, panel, severityColor } from "../plot.js";
import { ema, keepWeight, keptWeight, KERNEL_WEIGHT, valueAt } from "../smooth.js";
import { NOFIT, onZoom, xWindow } from "../yfit.js";

const MAX_MARKERS = 300;
const BASE_COLORS = ["#7f7f7f", "#b07aa1", "#9c755f", "#76b7b2"];

const kernelWeight = (w) => Math.abs(w - KERNEL_WEIGHT) < 1e-9;

// A baseline's train loss smoothed at weight `w`, as this run's is: the kernel's EMA at 0.9
// (over every step), else the page's of its raw train loss (≤ 1,000 points kept, min and max
// of each bucket: decayed by weight^Δstep between them, js/smooth.js).
export function baselineTrain(b, w) {
  if (!b.train || kernelWeight(w) || !b.raw || !b.raw.x.length) return b.train;
  return { x: b.raw.x, y: ema(b.raw.x, b.raw.y, w) };
}

// A baseline's traces, faded under this run's: its train loss smoothed at the slider's weight
// `w`, val points and LR, each placed by its own clock on the time axes; its config
// difference on hover.
export function baselineTraces(b, i, ax, w = KERNEL_WEIGHT) {
  const color = BASE_COLORS[i % BASE_COLORS.length];
  const name = `baseline ${b.name}`;
  const diff = (b.diff || []).map(([k, theirs, ours]) => `${escTemplate(k)}: ${escTemplate(theirs)} → ${escTemplate(ours)}`);
  const said = `${escTemplate(name)}${diff.length ? `<br>config (baseline → this run):<br>${diff.join("<br>")}` : "<br>same config"}`;
  const out = [];
  const at = (tr) => (tr ? ax.other(b, tr.x) : null);
  const train = baselineTrain(b, w);
  const tx = at(train), vx = at(b.val), lx = at(b.lr);
  if (tx) out.push({ name: esc(name), legendgroup: `b${i}`, x: tx, y: train.y, type: "scatter", mode: "lines",
    line: { color, width: 1.5, dash: "dash" }, opacity: 0.6,
    hovertemplate: `${said}<br>train (smoothed ${w.toFixed(2)}) %{y:.4f}<extra></extra>` });
  if (vx) out.push({ name: esc(`${name} val`), legendgroup: `b${i}`, showlegend: false, x: vx, y: b.val.y,
    type: "scatter", mode: "lines+markers", line: { color, width: 1, dash: "dot" }, opacity: 0.6,
    marker: { size: 6, symbol: "circle-open" },
    hovertemplate: `${escTemplate(name)} val %{y:.4f}<extra></extra>` });
  if (lx) out.push({ name: esc(`${name} LR`), legendgroup: `b${i}`, showlegend: false, x: lx, y: b.lr.y, yaxis: "y2",
    type: "scatter", mode: "lines", line: { color, width: 1, dash: "dot" }, opacity: 0.45,
    hovertemplate: `${escTemplate(name)} LR %{y:.3e}<extra></extra>` });
  return out;
}

// A constant LR would get plotly's ±0.5 around it (ticks like −0.5): show 0 to twice it.
export function flatRange(ys) {
  let lo = Infinity, hi = -Infinity;
  for (const v of ys) if (Number.isFinite(v)) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
  if (!(hi >= lo) || hi > lo) return {};
  return { range: hi > 0 ? [0, 2 * hi] : hi < 0 ? [2 * hi, 0] : [0, 1] };
}

export function create(root, ctx) {
  const p = panel(root, "loss", "Loss");
  const logLabel = el("label", "nbw-toggle");
  const logBox = el("input");
  logBox.type = "checkbox";
  logBox.className = "nbw-logy";
  logLabel.append(logBox, document.createTextNode(" log y"));
  // Smoothing of the train loss: the kernel's EMA at its weight (0.9, over every step), else
  // the page's own EMA of the raw trace at the chosen weight; the raw trace stays faint behind.
  const smoothLabel = el("label", "nbw-toggle nbw-smooth-label", "smoothing ");
  smoothLabel.title = "exponential moving average of the train loss (TensorBoard's): 0 = raw";
  const smoothBox = el("input", "nbw-smooth");
  smoothBox.type = "range";
  smoothBox.min = "0";
  smoothBox.max = "0.99";
  smoothBox.step = "0.01";
  smoothBox.value = String(keptWeight());
  const smoothVal = el("span", "nbw-smooth-value");
  smoothLabel.append(smoothBox, smoothVal);
  // The baseline picker (a live dashboard: the runs beside this one); none in an export.
  const pick = el("select", "nbw-baseline-pick");
  pick.title = "draw another run faded under this one";
  pick.hidden = true;
  p.head.append(pick, smoothLabel, logLabel);
  const plot = el("div", "nbw-plot");
  const pm = el("div", "nbw-postmortem");
  const pmHead = el("div", "nbw-postmortem-head");
  const pmTitle = el("span", "nbw-postmortem-title");
  const pmClose = el("button", "nbw-btn nbw-postmortem-close", "×");
  pmClose.type = "button";
  pmClose.title = "close the post-mortem";
  const pmText = el("pre", "nbw-postmortem-text");
  pmHead.append(pmTitle, pmClose);
  pm.append(pmHead, pmText);
  pm.hidden = true;
  p.body.append(plot, pm);
  const s = { train: new Series(), smooth: new Series(), val: new Series(), lr: new Series() };
  let branches = {}; // rewind n → Series of the train loss it rewound over
  let gap = { x: [], y: [], top: [] };
  let markers = [];
  let baselines = []; // [{name, train, val, lr, wall, tokens, diff}], replaced whole
  let postmortems = {}; // spike step → {lines, first, lead}
  let shown = null;     // the spike step whose post-mortem is open
  let clickable = false;
  let markerTop = 1; // where the markers sit on the loss axis (the last draw's)
  let markerAxis = null; // and the x axis they were placed by
  let dirty = false;
  function showPostmortem(step) {
    shown = step;
    if (step === null) { pm.hidden = true; delete p.box.dataset.postmortem; return; }
    const got = postmortems[String(step)];
    pmTitle.textContent = `post-mortem of the loss spike at step ${step}`;
    pmText.textContent = got ? got.lines.join("\n") : "post-mortem on its way: the kernel makes it once the spike's step is read";
    pm.hidden = false;
    p.box.dataset.postmortem = String(step);
  }
  pmClose.onclick = () => showPostmortem(null);
  // The spike marker nearest a click (within a marker's reach, in pixels), or null. (The
  // hover is unified: a click's points are every line's at that x, a marker's among them
  // however far it is, so only the distance says.)
  function spikeAt(ev, ax, top) {
    const fl = plot._fullLayout, r = plot.getBoundingClientRect(), e = ev.event;
    if (!fl || !e) return null;
    let best = null, dist = 14;
    for (const m of markers) {
      if (!m.spike) continue;
      const x = r.left + fl.xaxis._offset + fl.xaxis.l2p(fl.xaxis.d2l(ax.at(m.step)));
      const y = r.top + fl.yaxis._offset + fl.yaxis.l2p(fl.yaxis.d2l(top));
      const d = Math.hypot(x - e.clientX, y - e.clientY);
      if (d < dist) { best = m.step; dist = d; }
    }
    return best;
  }
  pick.onchange = () => ctx.send({ type: "baseline", names: pick.value ? [pick.value] : [] });
  function offer(beside, picked) {
    // the runs the run itself names as baselines are drawn already: not offered again
    const named = new Set(baselines.map((b) => String(b.path).split(/[\\/]/).pop()));
    const names = beside.filter((n) => !named.has(n) || n === picked);
    pick.replaceChildren(el("option", null, "compare with…"), ...names.map((n) => {
      const o = el("option", null, `baseline: ${n}`); o.value = n; return o;
    }));
    pick.firstChild.value = "";
    pick.value = picked && names.includes(picked) ? picked : "";
    pick.hidden = !names.length;
  }
  logBox.onchange = () => { dirty = true; ctx.schedule(); };
  const weight = () => Number(smoothBox.value);
  const showWeight = () => { smoothVal.textContent = weight().toFixed(2); p.box.dataset.smoothing = smoothVal.textContent; };
  showWeight();
  smoothBox.oninput = () => { showWeight(); keepWeight(weight()); dirty = true; ctx.schedule(); };
  // The smoothed train loss as drawn: the kernel's at its weight, the page's otherwise.
  function smoothed() {
    const w = weight();
    if (kernelWeight(w) && s.smooth.x.length) return s.smooth;
    return { x: s.train.x, y: ema(s.train.x, s.train.y, w) };
  }
  // The val−train gap's lower edge: the train loss smoothed as drawn, at each eval's step
  // (the recorded loss/gap is val − the kernel's 0.9 EMA: kept at 0.9).
  function gapBase(sm) {
    if (kernelWeight(weight()) && s.smooth.x.length) return gap.y;
    return gap.x.map((x) => valueAt(sm.x, sm.y, x));
  }

  return {
    box: p.box,
    series: s,
    update(d, full) {
      if (full) { gap = { x: [], y: [], top: [] }; markers = []; branches = {}; baselines = []; postmortems = {}; for (const k in s) s[k].set([], []); }
      if (d.postmortems) {
        Object.assign(postmortems, d.postmortems);
        if (shown !== null && d.postmortems[String(shown)]) showPostmortem(shown);
      }
      if (d.baselines) { baselines = d.baselines; dirty = true; }
      if (d.beside) offer(d.beside, (d.picked || [])[0]);
      for (const [n, tr] of Object.entries(d.branches || {})) {
        dirty = apply(branches[n] || (branches[n] = new Series()), tr, full) || dirty;
      }
      for (const k of ["train", "smooth", "val", "lr"]) dirty = apply(s[k], d[k], full) || dirty;
      if (d.gap) {
        gap.x = gap.x.concat(Array.from(d.gap.x));
        gap.y = gap.y.concat(Array.from(d.gap.y));
        gap.top = gap.top.concat(Array.from(d.gap.top));
        dirty = true;
      }
      if (d.markers) { markers = markers.concat(d.markers).slice(-MAX_MARKERS); dirty = true; }
    },
    restyle() { dirty = true; },
    draw(Plotly, t) {
      if (!dirty) return;
      dirty = false;
      const ax = t.axis;
      const trainLine = ax.line(s.train.x, s.train.y), valLine = ax.line(s.val.x, s.val.y);
      // the markers sit at the top of the loss in view (x zoomed: y fits the window, js/yfit.js)
      const win = xWindow(plot, ax.active());
      let top = -Infinity;
      const over = (l) => { for (let i = 0; i < l.y.length; i++) if (l.y[i] > top && Number.isFinite(l.y[i]) && (!win || (l.x[i] >= win[0] && l.x[i] <= win[1]))) top = l.y[i]; };
      over(trainLine); over(valLine);
      if (!Number.isFinite(top)) for (const b of baselines) for (const v of (b.train || { y: [] }).y) if (v > top && Number.isFinite(v)) top = v;
      if (!Number.isFinite(top)) top = 1;
      const gx = ax.x(gap.x);
      const sm = smoothed();
      const base = gapBase(sm);
      const traces = [
        ...baselines.flatMap((b, i) => baselineTraces(b, i, ax, weight())),
        ...Object.entries(branches).map(([n, b]) => ({
          name: `rewound over (${n})`, ...ax.line(b.x, b.y), type: "scatter", mode: "lines",
          line: { color: COLORS["loss/train"], width: 1, dash: "dot" }, opacity: 0.35,
          hovertemplate: `train %{y:.4f} (rewound over, rewind ${n})<extra></extra>` })),
        { name: "train loss", ...trainLine, type: "scatter", mode: "lines",
          line: { color: COLORS["loss/train"], width: 1 }, opacity: 0.45,
          hovertemplate: "train %{y:.4f}<extra></extra>" },
        { name: "train (smoothed)", ...ax.line(sm.x, sm.y), type: "scatter", mode: "lines",
          line: { color: COLORS["loss/train_smooth"], width: 2 },
          hovertemplate: `smoothed (${weight().toFixed(2)}) %{y:.4f}<extra></extra>` },
        { name: "train at eval", showlegend: false, x: gx, y: base, type: "scatter", mode: "lines",
          line: { width: 0, color: COLORS["loss/val"] }, hoverinfo: "skip" },
        { name: "val − train gap", x: gx, y: gap.top, type: "scatter", mode: "lines",
          line: { width: 0, color: COLORS["loss/val"] }, fill: "tonexty",
          fillcolor: COLORS.gap, customdata: gap.top.map((v, i) => [v - base[i], gap.x[i]]),
          hovertemplate: `val − train gap %{customdata[0]:.4f} (step %{customdata[1]}, train smoothed ${weight().toFixed(2)})<extra></extra>` },
        { name: "val loss", ...valLine, type: "scatter", mode: "lines+markers",
          line: { color: COLORS["loss/val"], width: 1.5 }, marker: { size: 7 }, customdata: Array.from(s.val.x),
          // the hover shows the eval nearest the pointer: its own step said, not the pointer's
          hovertemplate: "val %{y:.4f} (step %{customdata})<extra></extra>" },
        { name: "LR", ...ax.line(s.lr.x, s.lr.y), type: "scatter", mode: "lines", yaxis: "y2",
          line: { color: COLORS.lr, width: 1.5, dash: "dot" },
          hovertemplate: "LR %{y:.3e}<extra></extra>" },
        // at the top of the loss axis: a third, hidden axis would cost a third of this draw
        { name: "events", meta: NOFIT, x: ax.x(markers.map((m) => m.step)), customdata: markers.map((m) => m.step), y: markers.map(() => top), cliponaxis: false,
          type: "scatter", mode: "markers",
          text: markers.map((m) => esc(m.message) + (m.spike ? "<br><i>click: its post-mortem</i>" : "")),
          marker: { symbol: "triangle-down", size: markers.map((m) => (m.spike ? 13 : 10)),
            color: markers.map((m) => severityColor(m.severity)),
            line: { width: markers.map((m) => (m.spike ? 1.5 : 0)), color: t.font } },
          hovertemplate: "step %{customdata}: %{text}<extra></extra>" },
      ];
      const layout = baseLayout(t, {
        margin: { l: 52, r: 60, t: 8, b: 32 },
        showlegend: true,
        // one hover for every line at the step under the pointer, the step as its title
        hovermode: "x unified",
        xaxis: ax.xaxis(t, { unifiedhovertitle: { text: ax.hover() } }),
        legend: { orientation: "h", y: -0.22, font: { size: 10 } },
        // a zoom on x outlives the switch to log y; one on y (in the other scale's units) not
        yaxis: { title: { text: "loss" }, type: logBox.checked ? "log" : "linear", gridcolor: t.grid,
          uirevision: `${ax.active()}:${logBox.checked ? "log" : "linear"}` },
        yaxis2: { title: { text: "LR" }, overlaying: "y", side: "right", showgrid: false, zeroline: false,
          exponentformat: "e", color: COLORS.lr, ...flatRange(s.lr.y) },
        shapes: markers.map((m) => ({ type: "line", xref: "x", yref: "paper", x0: ax.at(m.step), x1: ax.at(m.step),
          y0: 0, y1: 1, line: { color: severityColor(m.severity), width: 1, dash: "dot" } })),
      });
      Plotly.react(plot, traces, layout, CONFIG);
      markerTop = top;
      markerAxis = ax;
      if (!clickable) {
        clickable = true;
        onZoom(plot, () => { dirty = true; ctx.schedule(); }); // the markers to the top in view
        plot.on("plotly_click", (ev) => {
          const step = spikeAt(ev, markerAxis, markerTop);
          if (step !== null) showPostmortem(step);
        });
      }
    },
  };
}
