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

// A live dashboard keeps the page's main thread free for the notebook: one budget for the
// whole dashboard, BUDGET of the main thread (its draws, and the unpacking and folding in of
// each refresh: `charge`), not a pace per panel. Credit accrues at BUDGET ms per ms of wall
// time, up to BURST_MS; a draw's cost is taken off, into debt if need be (down to
// MAX_DEBT_MS: one very slow draw holds the rest back ≤ 5 s), and nothing budgeted draws
// until the credit is back above 0. Who draws with the credit there is: the panels with
// something new share it by weight (fair queueing: each panel's draws so far / its weight,
// the least served first; a panel idle for a while gets no back pay), the loss with
// SHARE.loss, a panel on screen 1, one out of view SHARE.off: when every panel has something
// new, the loss gets ~half the budget and the panels on screen share the other half (one
// out of view draws rarely, and at the next frame once scrolled into view).
// A frame stops drawing once FRAME_MS are spent (one panel at least): no long frame.
// Why 8%: the goal is ≤ 30 ms of main thread per refresh at ~3.6 refreshes a second (~11%);
// 8% leaves room for the draw that overshoots the credit. Where a loss draw costs ≲ 10 ms
// (its ~half of 8% at ~4 refreshes a second) it redraws at every refresh; a slower machine
// redraws every panel less often, and the page stays responsive.
// Not budgeted: what a user's click asks for (a head, log y, a metric) draws at the next
// frame, as does a panel scrolled into view; a full state (a reload) draws every panel on screen at once (in the viewport
// itself), and the others one a frame after.
const BUDGET = 0.08;
const BURST_MS = 150;
const MAX_DEBT_MS = 400;
const FRAME_MS = 16;
const SHARE = { loss: 4, on: 1, off: 0.25 };

// Build the header, the controls bar (when `live`, from the kernel's command table
// `commands`) and one view per panel under `root`.
// `ctx`: {send(msg), schedule(), xaxis (the x axis to start with), saveAxis(mode) (where
// the choice is kept)}. Returns {apply(panels, full), draw(Plotly), restyle(), axis,
// charge(ms) (main-thread time spent outside draw, off the budget), pending()}.
export function mount(root, ctx, { live, commands = [] }) {
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
    unfocus();
    axis.mode = pick.value;
    root.dataset.xaxis = axis.active();
    if (ctx.saveAxis) ctx.saveAxis(axis.mode);
    restyle();
    ctx.schedule();
  };
  root.dataset.xaxis = axis.active();
  const ctl = live ? controls.create(root, ctx, commands) : null;
  const grid = document.createElement("div");
  grid.className = "nbw-grid";
  root.appendChild(grid);
  const views = {};
  const asked = {}; // view → a user's click asked it to redraw: it draws at the next frame
  const later = {}; // view → out of view at a full state's draw: it draws in a frame after
  for (const [name, mod] of Object.entries(PANELS)) {
    views[name] = mod.create(grid, { ...ctx, focus, schedule: () => { asked[name] = true; ctx.schedule(); } });
  }
  const stale = {};    // view → got something new since it last drew
  const onscreen = {}; // view → intersects the viewport (or near it)
  const seen = {};     // view → intersects the viewport itself (a full state draws these first)
  let force = true;    // the next draw draws every view (a full state, a theme switch)
  let timer = null;
  let credit = BURST_MS, creditAt = performance.now();
  if (live && typeof IntersectionObserver !== "undefined") {
    const io = new IntersectionObserver((entries) => {
      for (const e of entries) {
        const name = e.target.dataset.panel;
        // scrolled into view with something new: drawn at the next frame, like a click
        if (e.isIntersecting && onscreen[name] === false && stale[name]) asked[name] = true;
        onscreen[name] = e.isIntersecting;
      }
      ctx.schedule();
    }, { rootMargin: "200px" });
    const strict = new IntersectionObserver((entries) => {
      for (const e of entries) seen[e.target.dataset.panel] = e.isIntersecting;
    });
    for (const v of Object.values(views)) { io.observe(v.box); strict.observe(v.box); }
  }

  function refill(now) {
    credit = Math.min(BURST_MS, credit + (now - creditAt) * BUDGET);
    creditAt = now;
  }
  // Main-thread time the dashboard spent (a draw, a refresh's unpacking): off the budget.
  function charge(ms) {
    if (live) credit = Math.max(credit - ms, -MAX_DEBT_MS);
  }

  // Fair queueing: `served` is each view's budgeted drawing so far over its weight, and the
  // stale view least served draws first. `clock` is where the last one drawn stood: every
  // waiting view stands there at least, so one that turns stale after a rest gets no back
  // pay for the time it had nothing new.
  const served = {};
  let clock = 0;
  const names = Object.keys(views);
  const weight = (n) => (n === "loss" ? SHARE.loss : onscreen[n] === false ? SHARE.off : SHARE.on);
  function order() {
    const waiting = names.filter((n) => stale[n] || asked[n] || later[n]);
    for (const n of waiting) served[n] = Math.max(served[n] ?? clock, clock);
    return waiting.sort((a, b) => served[a] - served[b]);
  }

  function drawOne(name, Plotly, t, budgeted) {
    asked[name] = later[name] = stale[name] = false;
    const t0 = performance.now();
    try {
      views[name].draw(Plotly, t);
    } catch (e) {
      console.error("nbwatch: a panel failed to draw", e);
    }
    const ms = performance.now() - t0;
    if (budgeted) {
      charge(ms);
      clock = served[name] ?? clock;
      served[name] = clock + ms / weight(name);
    }
    performance.measure(`nbw:draw:${name}`, { start: t0 });
    return ms;
  }

  // A step shown in every trend chart drawn (an alert's, clicked in the feed): each x axis
  // zoomed to a window around it (±5% of the run, ≥ 10 steps), kept through the redraws as a
  // user's zoom is (uirevision), the loss brought into view. The same step again: the whole
  // run back. A trend chart is one drawn against the trend axis (its x title says so).
  let drawnWith = null; // the Plotly of the last draw
  let focused = null;
  function focus(step) {
    if (!drawnWith) return null;
    const again = focused === step;
    focused = again ? null : step;
    const w = Math.max(10, Math.round((Number(root.dataset.step) || step) * 0.05));
    const range = [axis.at(Math.max(step - w, 0)), axis.at(step + w)];
    for (const gd of grid.querySelectorAll(".js-plotly-plot")) {
      const xa = gd._fullLayout && gd._fullLayout.xaxis;
      if (!xa || !xa.title || xa.title.text !== axis.title()) continue;
      drawnWith.relayout(gd, again ? { "xaxis.autorange": true } : { "xaxis.range": range });
    }
    if (focused === null) delete root.dataset.focus;
    else {
      root.dataset.focus = String(step);
      views.loss.box.scrollIntoView({ block: "nearest" });
    }
    return focused;
  }

  // another x axis starts every range over (another uirevision): no step is shown any more
  function unfocus() { focused = null; delete root.dataset.focus; }

  let t = null; // the theme: read from the page's CSS (a forced style pass) only when it may have changed
  function draw(Plotly) {
    if (force || !t) t = theme(root);
    t.axis = axis;
    drawnWith = Plotly;
    Plotly = lighten(Plotly);
    const now = performance.now();
    refill(now);
    if (!live || force) {
      // everything now (an export), or what is on screen now and the rest one a frame after
      for (const name of names) {
        if (live && seen[name] === false) later[name] = true;
        else drawOne(name, Plotly, t, false);
      }
      force = false;
    } else {
      let spent = 0, one = false;
      for (const name of order()) {
        if (asked[name]) spent += drawOne(name, Plotly, t, true); // a click
        else if (later[name]) { // out of view at a full state: one a frame
          if (!one) { one = true; spent += drawOne(name, Plotly, t, false); }
        } else if (credit > 0 && spent < FRAME_MS) spent += drawOne(name, Plotly, t, true);
      }
    }
    // What is left draws in a frame after, or once the credit is back (a finished run's
    // held-back panels draw too: no refresh need come).
    if (names.some((n) => stale[n] || later[n] || asked[n]) && timer === null) {
      timer = setTimeout(() => { timer = null; ctx.schedule(); }, credit > 0 ? 0 : -credit / BUDGET);
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
      if (panels[name] || full) {
        v.update(panels[name] || {}, full);
        stale[name] = true;
      }
    }
    if (ctl && panels.alerts && panels.alerts.items) ctl.events(panels.alerts.items);
    ctx.schedule();
  }

  function restyle() {
    force = true;
    for (const name of names) stale[name] = true;
    for (const v of Object.values(views)) if (v.restyle) v.restyle();
  }

  // Another x axis, as the switch would (a kept choice arriving late: the widget's model).
  function setAxis(mode) {
    if (!MODES[mode] || mode === axis.mode) return;
    unfocus();
    axis.mode = mode;
    pick.value = axis.active();
    root.dataset.xaxis = axis.active();
    restyle();
    ctx.schedule();
  }

  // How many panels a full state's draw left for the frames after it.
  const pending = () => Object.values(later).filter(Boolean).length;

  return { ctl, views, apply, draw, restyle, axis, setAxis, pending, charge };
}
