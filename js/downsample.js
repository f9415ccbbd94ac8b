// Bounded, min/max-preserving downsampling on a fixed grid of steps: the same algorithm
// as nbwatch/panels/downsample.py, so folding new points in gives what the kernel holds.
export const MAX_POINTS = 5000;
export const GRAIN = 4096; // the span starts at the first step rounded down to a multiple

export function bucketWidth(last, maxPoints = MAX_POINTS, first = 0) {
  const buckets = Math.max(Math.floor(maxPoints / 2), 1);
  const start = Math.floor(Math.max(first, 0) / GRAIN) * GRAIN;
  let w = 1;
  while (Math.floor(last / w) - Math.floor(start / w) + 1 > buckets) w *= 2;
  return w;
}

// Keep the first min and first max of each bucket of `w` steps, in input order.
export function reduce(xs, ys, w) {
  const ox = [], oy = [];
  let bucket = null, lo = -1, hi = -1;
  const flush = () => {
    if (lo < 0) return;
    const a = Math.min(lo, hi), b = Math.max(lo, hi);
    ox.push(xs[a]); oy.push(ys[a]);
    if (b !== a) { ox.push(xs[b]); oy.push(ys[b]); }
  };
  for (let i = 0; i < xs.length; i++) {
    const y = ys[i];
    if (y === null || !Number.isFinite(y)) continue;
    const b = Math.floor(xs[i] / w);
    if (b !== bucket) { flush(); bucket = b; lo = hi = i; continue; }
    if (y < ys[lo]) lo = i;
    if (y > ys[hi]) hi = i;
  }
  flush();
  return { x: ox, y: oy };
}

// One series, downsampled incrementally.
export class Series {
  constructor(maxPoints = MAX_POINTS) {
    this.maxPoints = maxPoints;
    this.width = 1;
    this.first = null; // the first step seen: where the span begins
    this.x = [];
    this.y = [];
  }

  set(xs, ys) {
    this.x = []; this.y = []; this.width = 1; this.first = null;
    this.extend(xs, ys);
  }

  extend(xs, ys) {
    if (!xs.length) return;
    let last = -Infinity, low = Infinity;
    for (let i = 0; i < xs.length; i++) { last = Math.max(last, xs[i]); low = Math.min(low, xs[i]); }
    if (this.x.length) last = Math.max(last, this.x[this.x.length - 1]);
    this.first = this.first === null ? low : Math.min(this.first, low);
    const w = bucketWidth(last, this.maxPoints, this.first);
    if (w !== this.width || !this.x.length) {
      this.width = w;
      const r = reduce(this.x.concat(Array.from(xs)), this.y.concat(Array.from(ys)), w);
      this.x = r.x; this.y = r.y;
      return;
    }
    const start = Math.floor(this.x[this.x.length - 1] / w) * w;
    let i = this.x.length;
    while (i > 0 && this.x[i - 1] >= start) i--;
    const tx = this.x.slice(i), ty = this.y.slice(i);
    for (let j = 0; j < xs.length; j++) if (xs[j] >= start) { tx.push(xs[j]); ty.push(ys[j]); }
    const r = reduce(tx, ty, w);
    this.x = this.x.slice(0, i).concat(r.x);
    this.y = this.y.slice(0, i).concat(r.y);
  }
}

// A trace {x, y} from the kernel: replace (full state) or fold in (delta).
export function apply(series, trace, full) {
  if (!trace) return false;
  if (full) series.set(trace.x, trace.y);
  else series.extend(trace.x, trace.y);
  return true;
}
