// nbwatch HTML export: the same dashboard views as the live widget, fed once from the JSON
// state embedded in the page (`#nbw-state`, numeric arrays as base64 buffers), with plotly.js
// read from the page itself (`#nbw-plotly`): no network, no comm.
import { mount } from "./mount.js";
import { el, plotlyState, receivePlotly, unpack } from "./plot.js";
import * as report from "./views/report.js";

function bytes(b64) {
  const bin = atob(b64);
  const out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}

async function main() {
  const state = JSON.parse(document.getElementById("nbw-state").textContent);
  const root = el("div", "nbw-root nbw-export");
  document.getElementById("nbw-app").appendChild(root);
  let Plotly = null;
  let frame = null;
  const key = `nbwatch:xaxis:${location.pathname}`;
  let kept = null;
  try { kept = localStorage.getItem(key); } catch (e) { /* a page without storage */ }
  const ctx = {
    send: () => {}, // a snapshot: no kernel to send to
    xaxis: kept || "step",
    saveAxis: (mode) => { try { localStorage.setItem(key, mode); } catch (e) { /* none */ } },
    schedule: () => {
      if (frame === null) frame = requestAnimationFrame(() => {
        frame = null;
        if (Plotly) board.draw(Plotly);
      });
    },
  };
  const board = mount(root, ctx, { live: false });
  report.create(root, state.report || {}, root.querySelector(".nbw-header"));
  board.apply(unpack(state.panels, state.buffers.map(bytes)), true);
  const src = document.getElementById("nbw-plotly");
  const code = src.dataset.encoding === "base64" ? bytes(src.textContent) : new TextEncoder().encode(src.textContent);
  await receivePlotly(code);
  Plotly = await plotlyState().promise;
  ctx.schedule();
  await new Promise((r) => requestAnimationFrame(r));
  root.dataset.ready = "1";
}

main().catch((e) => {
  console.error("nbwatch: the export failed to render", e);
  document.getElementById("nbw-app").appendChild(el("pre", "nbw-error-msg", `nbwatch: ${e}`));
});
