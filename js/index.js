// nbwatch dashboard: one anywidget view. The kernel sends one message per refresh with
// only what is new ("delta"), or everything it holds ("full") to a view that said "hello".
import { mount } from "./mount.js";
import { needPlotly, plotlyState, receivePlotly, unpack } from "./plot.js";

const G = globalThis;

function render({ model, el }) {
  const viewId = Math.random().toString(36).slice(2);
  const root = document.createElement("div");
  root.className = "nbw-root";
  el.appendChild(root);
  let Plotly = null;
  let frame = null;
  let ready = false; // deltas before our "full" are already contained in it
  let alive = true;

  // The kernel speaks at least every 5 s while the run is live (a "tick" when nothing is
  // new): silence for SILENT_MS means it was restarted or shut down, and the page says so
  // rather than show "running" with an ETA and buttons that reach nothing.
  const SILENT_MS = 15000;
  const reopen = `\`%nbwatch ${model.get("run_dir") || "RUN_DIR"}\``;
  const GONE = `no word from the kernel: it was restarted or shut down (the run folder says how the run ended: ${reopen} reopens it), or it is overloaded`;
  // No kernel has answered this view yet: a cell still running holds its messages, or the
  // notebook was reopened with its widget state saved and the kernel that ran it is gone.
  const UNANSWERED = `waiting for the kernel… (a running cell holds it; or this notebook was reopened after its kernel ended: ${reopen} shows the run again)`;
  let heard = performance.now();
  let ended = true; // until the kernel says the run is live
  let runState = null;
  let silent = false;
  let done = false; // the kernel's poll ended (the run ended, or its writer was killed)
  function hush(text) {
    silent = true;
    status.textContent = text;
    root.dataset.silent = "yes";
    if (ctl) ctl.setState(runState, true);
  }
  const ctx = {
    send: (msg) => {
      try {
        model.send({ ...msg, view: viewId });
      } catch (e) { // the comm is closed: its kernel is gone
        hush(GONE);
      }
    },
    // the x axis switch is kept in the widget's model: per notebook (the kernel keeps the
    // last choice for the next dashboard; the saved notebook keeps this one's)
    xaxis: model.get("xaxis") || "step",
    saveAxis: (mode) => { model.set("xaxis", mode); model.save_changes(); },
    schedule: () => {
      if (frame === null && alive) frame = requestAnimationFrame(draw);
    },
  };
  const board = mount(root, ctx, { live: model.get("live"), commands: model.get("commands") });
  const ctl = board.ctl;
  // no button until the kernel speaks: what it would reach and the run's state are unknown
  if (ctl) ctl.setState("starting", true);
  const status = document.createElement("div");
  status.className = "nbw-status";
  status.textContent = "waiting for the kernel…";
  root.insertBefore(status, root.firstChild); // above the header: what the page cannot show

  // Main-thread time of each draw, and of the first full draw after a "full" state, as
  // Performance API measures ("nbw:draw", "nbw:first-draw": the panels on screen;
  // "nbw:full-draw": until the panels out of view are drawn too, one a frame after it, so
  // wall time, the frames between included): benchmarks/dashboard.py reads them. Marks
  // "nbw:plotly-msg", "nbw:plotly" and "nbw:full" place plotly.js's arrival, its module
  // ready and the full state on the same timeline (where a first draw's time goes).
  let fullAt = null;
  let plotlyAt = null;
  let restAt = null;
  function draw() {
    frame = null;
    if (!Plotly || !alive) return;
    const t0 = performance.now();
    board.draw(Plotly);
    performance.measure("nbw:draw", { start: t0 });
    if (fullAt !== null) {
      performance.measure("nbw:first-draw", { start: Math.max(fullAt, plotlyAt) });
      restAt = Math.max(fullAt, plotlyAt);
      fullAt = null;
    }
    if (restAt !== null && !board.pending()) { // the panels out of view drawn too
      performance.measure("nbw:full-draw", { start: restAt });
      restAt = null;
    }
  }

  const apply = board.apply;

  function onMsg(msg, buffers) {
    if (msg.to && msg.to !== viewId) return;
    const t0 = performance.now();
    heard = t0;
    if (msg.type === "tick" && msg.last) done = true; // nothing more will come: no watch
    if (silent) { // it speaks again: the controls as its last word left them
      silent = false;
      status.textContent = "";
      delete root.dataset.silent;
      if (ctl) ctl.setState(runState, ended);
    }
    if (G.__nbwatchBytes && (msg.type === "delta" || msg.type === "full")) {
      let n = JSON.stringify(msg).length;
      for (const b of buffers) n += b.byteLength;
      G.__nbwatchBytes.push([msg.type, n]); // opt-in, for benchmarks: bytes per message
    }
    if (msg.type === "plotly") {
      performance.mark("nbw:plotly-msg");
      receivePlotly(buffers[0]).catch((e) => console.error("nbwatch: plotly.js failed to load", e));
    } else if (msg.type === "full") {
      ready = true;
      status.textContent = "";
      fullAt = t0;
      performance.mark("nbw:full");
      apply(heed(unpack(msg.panels, buffers)), true);
      performance.measure("nbw:apply", { start: t0 });
    } else if (msg.type === "delta" && ready) {
      apply(heed(unpack(msg.panels, buffers)), false);
      board.charge(performance.measure("nbw:apply", { start: t0 }).duration);
    } else if (msg.type === "attention") { // a head's map the attention view asked for
      board.views.attention.receive(unpack(msg, buffers));
    } else if (msg.type === "refused" && ctl) {
      ctl.refused(msg.message);
    }
  }
  function heed(panels) { // the run's state, for the silence watch
    if (panels && panels.header && panels.header.state !== undefined) {
      runState = panels.header.state;
      ended = !!panels.header.ended;
    }
    return panels;
  }
  model.on("msg:custom", onMsg);
  const watch = setInterval(() => {
    if (ready && !ended && !done && !silent && performance.now() - heard > SILENT_MS) hush(GONE);
  }, 2000);
  const onAxis = () => board.setAxis(model.get("xaxis"));
  model.on("change:xaxis", onAxis);
  plotlyState().promise.then((P) => {
    Plotly = P;
    plotlyAt = performance.now();
    performance.mark("nbw:plotly");
    ctx.schedule();
  });
  // Say hello until the kernel answers: a view restored before its kernel connection is up
  // (a page reload) would otherwise wait forever for a message that was never delivered.
  let tries = 0;
  const hello = () => {
    if (ready || !alive) return;
    if (tries++ === 3) status.textContent = UNANSWERED;
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
    model.off("change:xaxis", onAxis);
    observer.disconnect();
    if (frame !== null) cancelAnimationFrame(frame);
    clearTimeout(helloTimer);
    clearInterval(watch);
    if (Plotly) for (const p of root.querySelectorAll(".js-plotly-plot")) Plotly.purge(p);
  };
}

export default { render };
