// The dashboard's DOM and views, shared by the live widget (index.js, fed by the kernel's
// messages) and the HTML export (export.js, fed by a JSON state embedded in the page).
import { theme } from "./plot.js";
import * as alerts from "./views/alerts.js";
import * as attention from "./views/attention.js";
import * as controls from "./views/controls.js";
import * as data from "./views/data.js";
import * as grads from "./views/grads.js";
import * as header from "./views/header.js";
import * as loss from "./views/loss.js";
import * as metrics from "./views/metrics.js";
import * as ranks from "./views/ranks.js";
import * as samples from "./views/samples.js";
import * as system from "./views/system.js";
import * as weights from "./views/weights.js";

export const PANELS = { loss, ranks, grads, weights, attention, system, data, metrics, alerts, samples };

// Build the header, the controls bar (when `live`) and one view per panel under `root`.
// `ctx`: {send(msg), schedule()}. Returns {apply(panels, full), draw(Plotly), restyle()}.
export function mount(root, ctx, { live }) {
  const head = header.create(root, ctx);
  const ctl = live ? controls.create(root, ctx) : null;
  const grid = document.createElement("div");
  grid.className = "nbw-grid";
  root.appendChild(grid);
  const views = {};
  for (const [name, mod] of Object.entries(PANELS)) views[name] = mod.create(grid, ctx);

  function draw(Plotly) {
    const t = theme(root);
    for (const v of Object.values(views)) {
      try {
        v.draw(Plotly, t);
      } catch (e) {
        console.error("nbwatch: a panel failed to draw", e);
      }
    }
    root.dataset.drawn = String((Number(root.dataset.drawn) || 0) + 1);
  }

  function apply(panels, full) {
    if (panels.header) {
      head.update(panels.header);
      if (ctl) ctl.setState(panels.header.state);
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
    for (const v of Object.values(views)) if (v.restyle) v.restyle();
  }

  return { ctl, views, apply, draw, restyle };
}
