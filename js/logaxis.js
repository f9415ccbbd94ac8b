// Log y axes whose every tick label reads as its value. Plotly labels a tick between two
// decades with its leading digit alone, smaller ("5" at 0.05, "2" at 20): a gradient norm on
// a log axis read "5" where it was 0.05. Every log y axis drawn through plot.js lighten() (and
// refitted by js/yfit.js after a zoom) takes logTicks(): each label the tick's whole value
// ("0.05", "20"; "2e−4" past three decades from 1), and ticks at 1, 2 and 5 of each decade, or
// at whole decades where the axis is too short for those; never one at every digit (plotly's
// "D1"), whose labels, whole, run into one another at the top of a decade.

// Plotly 3.7 (axes.autoTicks) spaces log ticks by span / nticks, in decades: over 0.7, whole
// decades (that many, rounded up); 0.3 to 0.7, "D2" (1, 2, 5); under 0.3, "D1" (every digit);
// an axis under one decade gets linear ticks (0.2, 0.3, …), labelled whole anyway.
const D2_PX = 55; // px a decade from which 1, 2, 5 each get a label (≥ 16 px apart)
const Y_PX = 40; // px a y tick takes at least (plotly's own default)

// The tick settings of a log y axis spanning `span` decades over `length` px.
export function logTicks(span, length) {
  const out = { minorloglabels: "complete", exponentformat: "e", nticks: 0 }; // 0: plotly's own
  if (!(span >= 1) || !(length > 0)) return out;
  const d2 = Math.ceil(span / 0.7); // span / d2 in (0.3, 0.7]: 1, 2, 5
  out.nticks = length / span >= D2_PX ? d2 : Math.max(1, Math.min(d2 - 1, Math.floor(length / Y_PX) + 1));
  return out;
}

// The decades spanned by the positive y values of `data`'s traces on axis `key` ("yaxis",
// "yaxis2", …), with the ~5% plotly's autorange adds either side; 0 where there are none.
export function dataSpan(data, key) {
  let lo = Infinity, hi = -Infinity;
  for (const tr of data || []) {
    const ref = tr.yaxis && tr.yaxis !== "y" ? `yaxis${tr.yaxis.slice(1)}` : "yaxis";
    if (ref !== key || tr.visible === false || !tr.y) continue;
    for (const v of tr.y) {
      if (v > 0 && Number.isFinite(v)) { const u = Math.log10(v); if (u < lo) lo = u; if (u > hi) hi = u; }
    }
  }
  return hi >= lo ? (hi - lo) * 1.1 : 0;
}

// The length in px of `gd`'s axis `key`: as drawn last, else guessed from the div's height.
export function axisLength(gd, key, margin = {}) {
  const drawn = gd && gd._fullLayout && gd._fullLayout[key] && gd._fullLayout[key]._length;
  if (drawn > 0) return drawn;
  return ((gd && gd.clientHeight) || 240) - (margin.t ?? 8) - (margin.b ?? 32);
}

// A value as a log axis's tick reads it: whole ("0.05", "20", "1000"), or "2e−4" / "1e4" past
// three decades from 1 (plotly's "e" format, its minus sign).
export function valueLabel(v) {
  if (!(v > 0) || !Number.isFinite(v)) return String(v);
  const e = Math.floor(Math.log10(v) + 1e-9);
  if (e >= -3 && e <= 3) return String(Number(v.toPrecision(3)));
  const m = Number((v / 10 ** e).toPrecision(3));
  return `${m}e${e < 0 ? `\u2212${-e}` : e}`;
}

const BAR_PX = 14; // px between two colour bar labels at least

// The ticks of a colour bar whose z is log₁₀ of the values shown (a heat map on a log colour
// scale), z from `lo` to `hi` over `length` px: {tickvals (in z), ticktext (the values they
// stand for: 0.001, 0.01, …, not −3, −2)}. Whole decades (every k-th where they would
// crowd), with 2 and 5 where a decade is tall enough; under one decade, round values.
export function logColorTicks(lo, hi, length) {
  if (!Number.isFinite(lo) || !Number.isFinite(hi) || hi < lo) return {};
  const per = (length > 0 ? length : 100) / Math.max(hi - lo, 1e-9); // px a decade
  const inside = (u) => u >= lo - 1e-9 && u <= hi + 1e-9;
  let vals = [];
  const k = Math.max(1, Math.ceil(BAR_PX / per));
  for (let e = Math.ceil(lo - 1e-9); e <= hi + 1e-9; e++) {
    if (e % k) continue;
    for (const m of per >= D2_PX ? [1, 2, 5] : [1]) if (inside(e + Math.log10(m))) vals.push(e + Math.log10(m));
  }
  if (vals.length < 2) { // under a decade or so: round values between the ends, linearly spaced
    const a = 10 ** lo, b = 10 ** hi;
    const n = Math.max(2, Math.min(5, Math.floor(length / (2 * BAR_PX))));
    const raw = (b - a) / n;
    vals = [];
    if (raw > 0) {
      const p = 10 ** Math.floor(Math.log10(raw));
      const step = [1, 2, 5, 10].map((m) => m * p).find((s) => s >= raw);
      for (let v = Math.ceil(a / step) * step; v <= b * (1 + 1e-9); v += step) {
        const u = Math.log10(Number(v.toPrecision(12)));
        if (inside(u) && (!vals.length || (u - vals[vals.length - 1]) * per >= BAR_PX)) vals.push(u);
      }
    }
    if (vals.length < 2) vals = hi > lo ? [lo, hi] : [lo];
  }
  return { tickvals: vals, ticktext: vals.map((u) => valueLabel(10 ** u)) };
}
