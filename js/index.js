// nbwatch dashboard: one anywidget view. The kernel sends one message per refresh with
// only what is new ("delta"), or everything it holds ("full") to a view that said "hello".
import { mount } from "./mount.js";
import { needPlotly, plotlyState, receivePlotly, unpack } from "./plot.js";

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
  const board = mount(root, ctx, { live: model.get("live") });
  const ctl = board.ctl;
  const status = document.createElement("div");
  status.className = "nbw-status";
  status.textContent = "waiting for the kernel…";
  root.appendChild(status);

  function draw() {
    frame = null;
    if (!Plotly || !alive) return;
    board.draw(Plotly);
  }

  const apply = board.apply;

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
    board.restyle();
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
