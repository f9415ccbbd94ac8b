// plotly.js (cartesian bundle: scatter, bar, heatmap, histogram) as an ES module.
// Built to nbwatch/static/plotly.js; the widget sends it once per page, on request.
import Plotly from "plotly.js-cartesian-dist-min";
export default Plotly;
