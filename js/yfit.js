// A zoom on x refits y to the points in view, as TensorBoard does: a late, small loss is not
// a flat line under the range of the whole run. Every plot drawn through plot.js lighten()
// gets it: at each redraw while x is zoomed (kept by uirevision), each y axis of its line
// traces takes the range of their points inside the x window (stacked lines stacked; an axis
// drawn `rangemode: "tozero"` keeps its 0), so the fit outlives the live redraws as the zoom
// does. A zoom on both axes (a box drawn in 2D, a pan) or on y alone is the user's own y and
// stays through the redraws, x zoomed or not; a double click gives the whole run back. An
// axis whose view sets its range itself (end labels) is the view's: it reads the window with
// xWindow() and the user's y with userY(), and redraws on a zoom of either (onZoom()).
import { axisLength, dataSpan, logTicks } from "./logaxis.js";

export const NOFIT = "nbw:nofit"; // a trace's `meta`: not a figure (markers at the top)
const PAD = 0.05; // of the span, either side

const axisKey = (ref) => (ref && ref !== "y" ? `yaxis${ref.slice(1)}` : "yaxis");
const state = (gd) => gd.__nbwFit || (gd.__nbwFit = { userY: false, rev: null, owned: new Set(), fitted: new Set(), redraw: null });

// The x window shown, in the axis's own numbers ([lo, hi]), or null where x shows everything
// (or the next draw, of another uirevision `rev`, starts x over).
export function xWindow(gd, rev) {
  const fl = gd && gd._fullLayout, xa = fl && fl.xaxis;
  if (!xa || xa.autorange !== false || !xa.range || (rev !== undefined && fl.uirevision !== rev)) return null;
  if (xa.type === "category") return null;
  const a = xa.r2l(xa.range[0]), b = xa.r2l(xa.range[1]);
  return Number.isFinite(a) && Number.isFinite(b) ? [Math.min(a, b), Math.max(a, b)] : null;
}

// The y range the user set with a zoom on y (plotly's units: log10 on a log axis), or null.
export function userY(gd, key = "yaxis") {
  const st = gd && gd.__nbwFit, ya = gd && gd._fullLayout && gd._fullLayout[key];
  return st && st.userY && ya && ya.range ? ya.range.slice() : null;
}

// `redraw()` after a zoom or pan (and its undoing): for a view that draws what depends
// on the window itself. Once per plot, after its first draw.
export function onZoom(gd, redraw) { state(gd).redraw = redraw; }

// {yaxis key: [lo, hi]}: each axis's range over the points of `data` with x in `win`.
// `types`: axis key → "log" | "linear" | …; `tozero`: the keys drawn from 0.
export function fitRanges(data, win, { types = {}, tozero = new Set(), skip = new Set(), toX = Number } = {}) {
  const lo = {}, hi = {}, stacks = {};
  const see = (k, v) => {
    const u = types[k] === "log" ? (v > 0 ? Math.log10(v) : NaN) : v;
    if (!Number.isFinite(u)) return;
    if (!(u >= lo[k])) lo[k] = u;
    if (!(u <= hi[k])) hi[k] = u;
  };
  for (const tr of data) {
    if ((tr.type && tr.type !== "scatter") || tr.meta === NOFIT || tr.visible === false || !tr.y || !tr.x) continue;
    const k = axisKey(tr.yaxis);
    if (skip.has(k) || types[k] === "category" || types[k] === "date") continue;
    const stack = tr.stackgroup ? (stacks[`${k}:${tr.stackgroup}`] ||= { k, sum: [] }) : null;
    const n = Math.min(tr.x.length, tr.y.length);
    for (let i = 0; i < n; i++) {
      const x = tr.x[i], y = tr.y[i];
      if (x === null || y === null) continue;
      const xv = toX(x);
      if (!(xv >= win[0] && xv <= win[1])) continue;
      if (stack) stack.sum[i] = (stack.sum[i] || 0) + (Number.isFinite(y) ? y : 0);
      else see(k, y);
    }
  }
  for (const { k, sum } of Object.values(stacks)) { for (const v of sum) if (v !== undefined) see(k, v); tozero.add(k); }
  const out = {};
  for (const k of Object.keys(lo)) {
    let a = lo[k], b = hi[k];
    if (tozero.has(k) && types[k] !== "log") { a = Math.min(a, 0); b = Math.max(b, 0); }
    if (!(b > a)) { const d = types[k] === "log" ? 0.5 : Math.abs(a) * 0.1 || 1; a -= d; b += d; }
    const pad = (b - a) * PAD;
    out[k] = [a - pad, b + pad];
  }
  return out;
}

function fitOf(gd, data, layout, win) {
  const fl = gd._fullLayout, st = state(gd), types = {}, tozero = new Set();
  for (const tr of data) {
    const k = axisKey(tr.yaxis);
    const given = layout[k] || {}, full = fl[k] || {};
    types[k] = given.type || full.type || "linear";
    if ((given.rangemode || full.rangemode) === "tozero") tozero.add(k);
  }
  const xa = fl.xaxis;
  const toX = xa.type === "date" ? (v) => xa.d2l(v) : Number;
  return fitRanges(data, win, { types, tozero, skip: st.owned, toX });
}

// Before a redraw (`layout` is the view's, copied: changed here): x zoomed and kept, each
// y axis not the view's own gets the range of what is in view (the user's own y, if set).
export function fitInto(gd, data, layout) {
  const st = state(gd);
  const keys = Object.keys(layout).filter((k) => /^yaxis\d*$/.test(k));
  st.owned = new Set(keys.filter((k) => layout[k] && Array.isArray(layout[k].range)));
  const rev = JSON.stringify([layout.uirevision, ...keys.map((k) => layout[k] && layout[k].uirevision)]);
  if (rev !== st.rev) { st.rev = rev; st.userY = false; } // another axis, another scale: y starts over
  st.fitted = new Set();
  const win = gd._fullLayout ? xWindow(gd, layout.uirevision) : null;
  if (!win) return; // x shows everything: y is plotly's autorange, or the user's (uirevision)
  const ranges = st.userY ? Object.fromEntries(["yaxis", ...keys].filter((k) => !st.owned.has(k) && gd._fullLayout[k])
    .map((k) => [k, gd._fullLayout[k].range.slice()])) : fitOf(gd, data, layout, win);
  for (const [k, range] of Object.entries(ranges)) {
    if (st.owned.has(k)) continue;
    layout[k] = { ...layout[k], range, autorange: false };
    st.fitted.add(k);
  }
}

// After a plot's first draw: its zooms on x refit y (or ask the view to redraw).
export function watch(Plotly, gd) {
  if (gd.__nbwWatched || !gd.on) return;
  gd.__nbwWatched = true;
  gd.on("plotly_relayout", (ev) => {
    const keys = Object.keys(ev || {});
    const st = state(gd);
    const onX = keys.some((k) => /^xaxis\.(range|autorange)/.test(k));
    // plotly's own y edits name `range[0]`; the fit's relayout names `range` (not a user's)
    const byUser = keys.some((k) => /^yaxis\d*\.range\[/.test(k));
    // y alone given back (a double click on its axis): y follows x's window again
    const yBack = !byUser && keys.some((k) => /^yaxis\d*\.autorange$/.test(k) && ev[k] === true);
    if (!onX && !byUser && !yBack) return;
    const whole = ev["xaxis.autorange"] === true;
    // a box on both axes, a pan, a zoom of y alone: the user's y, kept whether x is zoomed
    // or not, until a double click gives the whole run back
    st.userY = !whole && byUser;
    // a view that sets y itself reads userY() and xWindow(); its labels follow the new ranges
    if (st.redraw) { st.redraw(); return; }
    const fl = gd._fullLayout, upd = {};
    // a log axis's ticks for its new span (js/logaxis.js): the user's own range, else the fit's
    const ticks = (k, span) => {
      if (!fl[k] || fl[k].type !== "log") return;
      const n = logTicks(span, axisLength(gd, k)).nticks;
      if (n !== (fl[k].nticks || 0)) upd[`${k}.nticks`] = n;
    };
    if (st.userY) {
      for (const k of Object.keys(fl).filter((k) => /^yaxis\d*$/.test(k))) ticks(k, Math.abs(fl[k].range[1] - fl[k].range[0]));
      if (Object.keys(upd).length) Plotly.relayout(gd, upd);
      return;
    }
    const win = whole ? null : xWindow(gd);
    const fitted = new Set();
    if (!win) for (const k of st.fitted) { upd[`${k}.autorange`] = true; ticks(k, dataSpan(gd.data, k)); }
    else {
      for (const [k, r] of Object.entries(fitOf(gd, gd.data, gd.layout, win))) {
        upd[`${k}.range`] = r;
        fitted.add(k);
        ticks(k, Math.abs(r[1] - r[0]));
      }
    }
    st.fitted = fitted;
    if (Object.keys(upd).length) Plotly.relayout(gd, upd);
  });
}
