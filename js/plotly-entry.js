// plotly.js (cartesian bundle: scatter, bar, heatmap, histogram) as an ES module.
// Built to nbwatch/static/plotly.js; the widget sends it once per page, on request.
// The build puts `//# allFunctionsCalledOnLoad` first (package.json, esbuild's banner): V8's
// explicit compile hint (Chromium ≥ 136) compiles every function when the module loads,
// instead of each at its first call, most of them during the first draw. Measured in a cold
// headless Chromium page drawing a 12 x 12 GPT-2 state: the main thread's CPU until the draw
// ~1.0 s -> ~0.68 s, the first draw's ~650 -> ~580 ms. Other browsers ignore the comment.
import Plotly from "plotly.js-cartesian-dist-min";
export default Plotly;
