// The trend panels' x axis: step, relative time (since the run started), wall time (the
// clock), or tokens seen — one switch for every trend panel. The kernel's "clock" panel
// maps steps onto seconds and tokens; a step stalled by a compile or an eval shows on the
// time axes as a gap in each line, not a long straight segment.
import { Series, apply } from "./downsample.js";

export const MODES = { step: "step", relative: "relative time", wall: "wall time", tokens: "tokens seen" };
const GAP_FACTOR = 10; // a segment this many times slower than the median step is a stall
const GAP_MIN_S = 2;

function unitFor(seconds) {
  if (seconds < 600) return { div: 1, name: "s" };
  if (seconds < 36000) return { div: 60, name: "min" };
  return { div: 3600, name: "h" };
}

// Linear interpolation of sorted (xs, ys) at v; ends held flat.
function interp(xs, ys, v) {
  const n = xs.length;
  if (!n) return NaN;
  if (v <= xs[0]) return ys[0];
  if (v >= xs[n - 1]) return ys[n - 1];
  let lo = 0, hi = n - 1;
  while (hi - lo > 1) {
    const mid = (lo + hi) >> 1;
    if (xs[mid] <= v) lo = mid; else hi = mid;
  }
  const f = (v - xs[lo]) / (xs[hi] - xs[lo] || 1);
  return ys[lo] + f * (ys[hi] - ys[lo]);
}

export function createAxis(mode = "step") {
  const wall = new Series(), tokens = new Series();
  let t0 = null;
  let perStep = null; // median seconds per step: what a stall is measured against
  const ax = {
    mode: MODES[mode] ? mode : "step",
    update(d, full) {
      if (full) { wall.set([], []); tokens.set([], []); }
      if (!d) return false;
      if (d.t0 !== undefined && d.t0 !== null) t0 = d.t0;
      const moved = apply(wall, d.wall, full);
      apply(tokens, d.tokens, full);
      if (moved) perStep = null;
      return moved;
    },
    // Which modes this run can draw.
    modes() {
      const out = ["step"];
      if (wall.x.length && t0 !== null) out.push("relative", "wall");
      if (tokens.x.length) out.push("tokens");
      return out;
    },
    active() { return ax.modes().includes(ax.mode) ? ax.mode : "step"; },
    timed() { const m = ax.active(); return m === "relative" || m === "wall"; },
    // One step → the chosen x.
    at(step) {
      const m = ax.active();
      if (m === "step") return step;
      if (m === "tokens") return interp(tokens.x, tokens.y, step);
      const s = interp(wall.x, wall.y, step);
      if (m === "relative") return s / unit().div;
      return (t0 + s) * 1000 - new Date((t0 + s) * 1000).getTimezoneOffset() * 60000; // local clock
    },
    x(steps) {
      if (ax.active() === "step") return steps;
      return Array.from(steps, (s) => (s === null ? null : ax.at(s)));
    },
    // A line {x, y} on the chosen axis, broken (a null) where the time between two points
    // is a stall: ≥ GAP_FACTOR × the median step time, and ≥ GAP_MIN_S.
    line(steps, ys) {
      if (!ax.timed()) return { x: ax.x(steps), y: ys };
      const m = median();
      const x = [], y = [];
      let prev = null, prevT = null;
      for (let i = 0; i < steps.length; i++) {
        const s = steps[i];
        const t = interp(wall.x, wall.y, s);
        if (prev !== null && m !== null) {
          const dt = t - prevT;
          if (dt > Math.max(GAP_FACTOR * m * Math.max(s - prev, 1), GAP_MIN_S)) { x.push(null); y.push(null); }
        }
        x.push(ax.at(s)); y.push(ys[i]);
        prev = s; prevT = t;
      }
      return { x, y };
    },
    // Another run's steps (a baseline's) by its own clock {wall, tokens}; null where this
    // axis cannot place them (wall time: another run ran at another time).
    other(clock, steps) {
      const m = ax.active();
      if (m === "step") return steps;
      const c = m === "tokens" ? clock.tokens : m === "relative" ? clock.wall : null;
      if (!c || !c.x || !c.x.length) return null;
      return Array.from(steps, (s) => (m === "relative" ? interp(c.x, c.y, s) / unit().div : interp(c.x, c.y, s)));
    },
    title() {
      const m = ax.active();
      if (m === "relative") return `time since the start (${unit().name})`;
      if (m === "wall") return "wall time";
      return m === "tokens" ? "tokens seen" : "step";
    },
    // The x axis of a layout, and the hover text of x ("step %{x}", "t %{x}").
    xaxis(t, extra = {}) {
      const m = ax.active();
      return { gridcolor: t.grid, zerolinecolor: t.grid, title: { text: ax.title() },
        ...(m === "wall" ? { type: "date" } : { type: "linear" }),
        ...(m === "tokens" ? { exponentformat: "SI" } : {}), ...extra };
    },
    hover() {
      const m = ax.active();
      if (m === "relative") return `t %{x:.4g} ${unit().name}`;
      if (m === "wall") return "%{x|%H:%M:%S}";
      return m === "tokens" ? "tokens %{x:.4s}" : "step %{x}";
    },
  };
  function unit() {
    const n = wall.y.length;
    return unitFor(n ? wall.y[n - 1] : 0);
  }
  function median() {
    if (perStep !== null) return perStep;
    const r = [];
    for (let i = 1; i < wall.x.length; i++) {
      const ds = wall.x[i] - wall.x[i - 1];
      if (ds > 0) r.push((wall.y[i] - wall.y[i - 1]) / ds);
    }
    if (!r.length) return null;
    r.sort((a, b) => a - b);
    perStep = r[r.length >> 1];
    return perStep;
  }
  return ax;
}
