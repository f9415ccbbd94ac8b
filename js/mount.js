// The dashboard's DOM and views, shared by the live widget (index.js, fed by the kernel's
// messages) and the HTML export (export.js, fed by a JSON state embedded in the page).
import { MODES, createAxis } from "./axis.js";
import { el, lighten, theme } from "./plot.js";
import * as alerts from "./views/alerts.js";
import * as attention from "./views/attention.js";
import * as controls from "./views/controls.js";
import * as data from "./views/data.js";
import * as grads from "./views/grads.js";
import * as header from "./views/header.js";
import * as health from "./views/health.js";
import * as loss from "./views/loss.js";
import * as metrics from "./views/metrics.js";
import * as ranks from "./views/ranks.js";
import * as samples from "./views/samples.js";
import * as system from "./views/system.js";
import * as weights from "./views/weights.js";

export const PANELS = { loss, ranks, grads, weights, attention, health, system, data, metrics, alerts, samples };

// A live dashboard keeps the page's main thread free for the notebook: each Plotly.react
// costs 5–60 ms (more on a loaded machine, or for a 75-layer heat map), so the panels a user
// reads as a trend redraw at most once a second (one such panel per frame, and not in a
// frame already busy), and a panel scrolled out of view at most every few seconds.
// The loss, gauges and feeds follow every refresh. A full state draws every panel: those on
// screen at once, those out of view one a frame after. And a panel waits PACE × what its last draw cost before it draws again (a trend panel
// whose draw took 40 ms: 2 s; the loss at 30 ms: 0.45 s), so that no panel, the loss
// included, takes more than a fixed share of the main thread however slow a draw gets.
// What a user's click asks for (a head, log y, a metric) draws at the next frame.
const EVERY_MS = { ranks: 1000, grads: 1000, weights: 1000, health: 1000, data: 1000, metrics: 1000, system: 1000 };
const PACE = { loss: 15, attention: 15 };
const PACE_TREND = 50;
const MAX_PACE_MS = 5000;
const OFFSCREEN_MS = 3000;
const BUSY_MS = 12; // a frame that spent this much already leaves trend panels to the next

// Build the header, the controls bar (when `live`) and one view per panel under `root`.
// `ctx`: {send(msg), schedule(), xaxis (the x axis to start with), saveAxis(mode) (where
// the choice is kept)}. Returns {apply(panels, full), draw(Plotly), restyle(), axis}.
export function mount(root, ctx, { live }) {
  const head = header.create(root, ctx);
  // One x axis switch for every trend panel (step, relative or wall time, tokens seen).
  const axis = createAxis(ctx.xaxis || "step");
  const pick = el("select", "nbw-xaxis");
  pick.title = "x axis of the trend panels";
  const pickLabel = el("label", "nbw-xaxis-label", "x: ");
  pickLabel.appendChild(pick);
  head.box.querySelector(".nbw-header-top").appendChild(pickLabel);
  let offered = "";
  function relistAxis() {
    const modes = axis.modes();
    if (modes.join() === offered) return;
    offered = modes.join();
    pick.replaceChildren(...modes.map((m) => { const o = el("option", null, MODES[m]); o.value = m; return o; }));
    pick.value = axis.active();
  }
  relistAxis();
  pick.onchange = () => {
    axis.mode = pick.value;
    root.dataset.xaxis = axis.active();
    if (ctx.saveAxis) ctx.saveAxis(axis.mode);
    restyle();
    ctx.schedule();
  };
  root.dataset.xaxis = axis.active();
  const ctl = live ? controls.create(root, ctx) : null;
  const grid = document.createElement("div");
  grid.className = "nbw-grid";
  root.appendChild(grid);
  const views = {};
  const asked = {}; // view → a user's click asked it to redraw: it draws at the next frame
  const later = {}; // view → out of view at a full state's draw: it draws in a frame after
  for (const [name, mod] of Object.entries(PANELS)) {
    views[name] = mod.create(grid, { ...ctx, schedule: () => { asked[name] = true; ctx.schedule(); } });
  }
  const last = {};     // view → when it last drew
  const cost = {};     // view → what its last draw cost (ms)
  const onscreen = {}; // view → intersects the viewport (or near it)
  let force = true;    // the next draw draws every view (a full state, a theme switch)
  let timer = null;
  if (live && typeof IntersectionObserver !== "undefined") {
    const io = new IntersectionObserver((entries) => {
      for (const e of entries) onscreen[e.target.dataset.panel] = e.isIntersecting;
      ctx.schedule();
    }, { rootMargin: "200px" });
    for (const v of Object.values(views)) io.observe(v.box);
  }

  // Whether a view may draw now; when not, when it may (ms from now).
  function due(name, now, busy) {
    if (!live) return 0;
    // A full state (a reload) draws what is on screen first; the panels out of view follow,
    // one a frame, in the frames after.
    if (force) return onscreen[name] === false ? 1 : 0;
    if (asked[name]) return 0;
    if (later[name]) return busy ? 40 : 0;
    const off = onscreen[name] === false;
    const pace = Math.min((cost[name] || 0) * (PACE[name] || (EVERY_MS[name] ? PACE_TREND : 0)), MAX_PACE_MS);
    const every = Math.max(off ? OFFSCREEN_MS : EVERY_MS[name] || 0, pace);
    if (!every) return 0;
    const wait = (last[name] || -Infinity) + every - now;
    if (wait > 0) return wait;
    return busy && (off || EVERY_MS[name]) ? 40 : 0;
  }

  // Views that follow every refresh first, then the trend panels.
  // Among the trend panels, the one that has waited longest goes first: one per frame in a
  // fixed order starves the last ones when frames are slow (a loaded machine), round robin
  // does not.
  const names = Object.keys(views);
  const order = () => names.slice().sort((a, b) => (EVERY_MS[a] || 0) - (EVERY_MS[b] || 0)
    || (EVERY_MS[a] ? (last[a] ?? -1) - (last[b] ?? -1) : 0));

  let t = null; // the theme: read from the page's CSS (a forced style pass) only when it may have changed
  function draw(Plotly) {
    if (force || !t) t = theme(root);
    t.axis = axis;
    Plotly = lighten(Plotly);
    const now = performance.now();
    let throttled = false, next = Infinity;
    for (const name of order()) {
      const v = views[name];
      const wait = due(name, now, throttled || performance.now() - now > BUSY_MS);
      if (wait > 0) {
        if (force) later[name] = true;
        next = Math.min(next, wait);
        continue;
      }
      const paced = EVERY_MS[name] || onscreen[name] === false;
      asked[name] = later[name] = false;
      const before = last[name];
      last[name] = now;
      const t0 = performance.now();
      try {
        v.draw(Plotly, t);
        const ms = performance.now() - t0;
        if (ms > 1) { // it drew (a view with nothing new returns at once)
          if (paced) throttled = true;
          if (!force) cost[name] = ms; // a full state's first draws cost more than the next
        } else if (!paced) last[name] = before; // the loss: its pace counts from its last draw
        performance.measure(`nbw:draw:${name}`, { start: t0 });
      } catch (e) {
        console.error("nbwatch: a panel failed to draw", e);
      }
    }
    force = false;
    // A view that was held back draws later even when no refresh comes (a finished run).
    if (next < Infinity && timer === null) {
      timer = setTimeout(() => { timer = null; ctx.schedule(); }, next);
    }
    root.dataset.drawn = String((Number(root.dataset.drawn) || 0) + 1);
  }

  function apply(panels, full) {
    if (full) force = true;
    if (panels.clock || full) {
      axis.update(panels.clock, full);
      relistAxis();
      root.dataset.xaxis = axis.active();
    }
    if (panels.header) {
      head.update(panels.header);
      if (ctl) ctl.setState(panels.header.state, panels.header.ended);
      root.dataset.step = String(panels.header.step);
      root.dataset.state = panels.header.state;
    }
    for (const [name, v] of Object.entries(views)) {
      if (panels[name] || full) v.update(panels[name] || {}, full);
    }
    if (ctl && panels.alerts && panels.alerts.items) ctl.events(panels.alerts.items);
    ctx.schedule();
  }

  function restyle() {
    force = true;
    for (const v of Object.values(views)) if (v.restyle) v.restyle();
  }

  // Another x axis, as the switch would (a kept choice arriving late: the widget's model).
  function setAxis(mode) {
    if (!MODES[mode] || mode === axis.mode) return;
    axis.mode = mode;
    pick.value = axis.active();
    root.dataset.xaxis = axis.active();
    restyle();
    ctx.schedule();
  }

  // How many panels a full state's draw left for the frames after it.
  const pending = () => Object.values(later).filter(Boolean).length;

  return { ctl, views, apply, draw, restyle, axis, setAxis, pending };
}
