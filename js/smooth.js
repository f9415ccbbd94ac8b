// The loss panel's smoothing slider: TensorBoard's debiased exponential moving average, in
// steps. At every step recorded (the page holds each step until a trace passes MAX_POINTS)
// this is exactly nbwatch/panels/loss.py smooth() at the same weight; where the page holds
// a downsampled trace, a point `dx` steps after the previous one decays the average by
// weight^dx, so the smoothing still spans the same number of steps.
export const KERNEL_WEIGHT = 0.9; // the kernel's `loss/train_smooth`
const KEY = "nbwatch:smoothing";

// ema_i = d·ema + (1 − d)·y_i, d = weight^(x_i − x_{i−1}); shown as ema_i / (1 − Π d): the
// debiasing that keeps the first points from starting at 0. Non-finite values are skipped
// (they stay NaN in the output).
export function ema(xs, ys, weight) {
  const out = new Array(ys.length);
  let acc = 0, norm = 0, prev = null;
  for (let i = 0; i < ys.length; i++) {
    const y = ys[i];
    if (y === null || !Number.isFinite(y)) { out[i] = NaN; continue; }
    const d = prev === null ? weight : weight ** Math.max(xs[i] - prev, 1);
    acc = d * acc + (1 - d) * y;
    norm = d * norm + (1 - d);
    prev = xs[i];
    out[i] = norm > 0 ? acc / norm : y;
  }
  return out;
}

// A smoothed line's value at step `x`: its own where it holds that step, else the straight
// line between the points either side (the ends held flat); NaN on an empty line.
export function valueAt(xs, ys, x) {
  const n = xs.length;
  if (!n) return NaN;
  let lo = 0, hi = n - 1;
  if (x <= xs[0]) return ys[0];
  if (x >= xs[hi]) return ys[hi];
  while (hi - lo > 1) {
    const mid = (lo + hi) >> 1;
    if (xs[mid] <= x) lo = mid; else hi = mid;
  }
  if (xs[lo] === x) return ys[lo];
  return ys[lo] + ((x - xs[lo]) / (xs[hi] - xs[lo])) * (ys[hi] - ys[lo]);
}

// The weight a user chose last (kept by the browser, as TensorBoard keeps its slider's).
export function keptWeight() {
  let v = null;
  try { v = localStorage.getItem(KEY); } catch (e) { /* a page without storage */ }
  const w = v === null ? NaN : Number(v);
  return w >= 0 && w < 1 ? w : KERNEL_WEIGHT;
}

export function keepWeight(w) {
  try { localStorage.setItem(KEY, String(w)); } catch (e) { /* none */ }
}
