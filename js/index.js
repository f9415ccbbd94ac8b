// nbwatch dashboard: one anywidget view. The kernel sends one message per refresh with
// only what is new ("delta"), or everything it holds ("full") to a view that said "hello".
import { needPlotly, plotlyState, receivePlotly, theme, unpack } from "./plot.js";
import * as alerts from "./views/alerts.js";
import * as attention from "./views/attention.js";
import * as controls from "./views/controls.js";
import * as data from "./views/data.js";
import * as grads from "./views/grads.js";
import * as header from "./views/header.js";
import * as loss from "./views/loss.js";
import * as samples from "./views/samples.js";
import * as system from "./views/system.js";
import * as weights from "./views/weights.js";

const PANELS = { loss, grads, weights, attention, system, data, alerts, samples };

function render({ model, el }) {
  const viewId = Math.random().toString(36).slice(2);
  const root = document.createElement("div");
  root.className = "nbw-root";
  el.appendChild(root);
  let Plotly = null;
  let frame = null;
  let ready = false; // deltas before our "full" are already contained in it
  let alive = true;

  const ctx = {
    send: (msg) => model.send({ ...msg, view: viewId }),
    schedule: () => {
      if (frame === null && alive) frame = requestAnimationFrame(draw);
    },
  };
  const head = header.create(root, ctx);
  const ctl = model.get("live") ? controls.create(root, ctx) : null;
  const grid = document.createElement("div");
  grid.className = "nbw-grid";
  root.appendChild(grid);
  const views = {};
  for (const [name, mod] of Object.entries(PANELS)) views[name] = mod.create(grid, ctx);
  const status = document.createElement("div");
  status.className = "nbw-status";
  status.textContent = "waiting for the kernel…";
  root.appendChild(status);

  function draw() {
    frame = null;
    if (!Plotly || !alive) return;
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

  function onMsg(msg, buffers) {
    if (msg.to && msg.to !== viewId) return;
    if (msg.type === "plotly") {
      receivePlotly(buffers[0]).catch((e) => console.error("nbwatch: plotly.js failed to load", e));
    } else if (msg.type === "full") {
      ready = true;
      status.textContent = "";
      apply(unpack(msg.panels, buffers), true);
    } else if (msg.type === "delta" && ready) {
      apply(unpack(msg.panels, buffers), false);
    } else if (msg.type === "refused" && ctl) {
      ctl.refused(msg.message);
    }
  }
  model.on("msg:custom", onMsg);
  plotlyState().promise.then((P) => {
    Plotly = P;
    ctx.schedule();
  });
  // Say hello until the kernel answers: a view restored before its kernel connection is up
  // (a page reload) would otherwise wait forever for a message that was never delivered.
  let tries = 0;
  const hello = () => {
    if (ready || !alive) return;
    if (tries++ === 3) status.textContent = "waiting for the kernel… (is it running? `%nbwatch RUN_DIR` reopens a finished run)";
    model.send({ type: "hello", view: viewId, plotly: needPlotly() });
    helloTimer = setTimeout(hello, Math.min(1000 * tries, 5000));
  };
  let helloTimer = null;
  hello();
  // A theme switch (light/dark) restyles every plot.
  const observer = new MutationObserver(() => {
    for (const v of Object.values(views)) if (v.restyle) v.restyle();
    ctx.schedule();
  });
  observer.observe(document.body, { attributes: true, attributeFilter: ["data-jp-theme-name"] });

  return () => {
    alive = false;
    model.off("msg:custom", onMsg);
    observer.disconnect();
    if (frame !== null) cancelAnimationFrame(frame);
    clearTimeout(helloTimer);
    if (Plotly) for (const p of root.querySelectorAll(".js-plotly-plot")) Plotly.purge(p);
  };
}

export default { render };
