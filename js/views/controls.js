// Controls bar: Pause/Resume, Stop, Checkpoint, Clip (value + on/off), Cut LR (factor),
// Rewind (steps back, batches to skip).
// A click sends one command; what the bar shows as done is the runner's event coming back.
import { el } from "../plot.js";

export function create(root, ctx) {
  const bar = el("div", "nbw-controls");
  bar.dataset.panel = "controls";
  const button = (label, cls) => {
    const b = el("button", `nbw-btn ${cls}`, label);
    b.type = "button";
    bar.appendChild(b);
    return b;
  };
  const pause = button("Pause", "nbw-pause");
  const stop = button("Stop", "nbw-stop");
  const ckpt = button("Checkpoint", "nbw-checkpoint");
  const clipBox = el("span", "nbw-group");
  const clipOn = el("input", "nbw-clip-on");
  clipOn.type = "checkbox";
  clipOn.checked = true;
  clipOn.title = "on: clip to the value; off: no clipping";
  const clipVal = el("input", "nbw-clip-value");
  clipVal.type = "number"; clipVal.min = "0"; clipVal.step = "0.1"; clipVal.value = "1.0";
  const clip = el("button", "nbw-btn nbw-clip", "Clip");
  clip.type = "button";
  clipBox.append(clip, clipVal, clipOn, el("span", "nbw-small", "on"));
  bar.appendChild(clipBox);
  const lrBox = el("span", "nbw-group");
  const lr = el("button", "nbw-btn nbw-lr", "Cut LR");
  lr.type = "button";
  const lrVal = el("input", "nbw-lr-factor");
  lrVal.type = "number"; lrVal.min = "0"; lrVal.step = "0.05"; lrVal.value = "0.5";
  lrBox.append(lr, el("span", "nbw-small", "×"), lrVal);
  bar.appendChild(lrBox);
  const rwBox = el("span", "nbw-group");
  const rw = el("button", "nbw-btn nbw-rewind", "Rewind");
  rw.type = "button";
  rw.title = "reload the newest checkpoint at least this many steps back, and skip this many batches";
  const rwSteps = el("input", "nbw-rewind-steps");
  rwSteps.type = "number"; rwSteps.min = "1"; rwSteps.step = "10"; rwSteps.value = "100";
  const rwSkip = el("input", "nbw-rewind-skip");
  rwSkip.type = "number"; rwSkip.min = "0"; rwSkip.step = "50"; rwSkip.value = "200";
  rwBox.append(rw, rwSteps, el("span", "nbw-small", "steps, skip"), rwSkip);
  bar.appendChild(rwBox);
  const ack = el("span", "nbw-ack");
  bar.appendChild(ack);
  root.appendChild(bar);

  let state = "starting";
  let seen = 0;
  const pending = (text) => { ack.textContent = text; ack.dataset.pending = "1"; };
  pause.onclick = () => {
    const kind = state === "paused" ? "resume" : "pause";
    ctx.send({ type: "command", kind });
    pending(`${kind} sent…`);
  };
  stop.onclick = () => { ctx.send({ type: "command", kind: "stop" }); pending("stop sent…"); };
  ckpt.onclick = () => { ctx.send({ type: "command", kind: "checkpoint" }); pending("checkpoint sent…"); };
  clip.onclick = () => {
    const v = parseFloat(clipVal.value);
    const value = clipOn.checked && v > 0 ? v : null;
    ctx.send({ type: "command", kind: "clip", args: { max_norm: value } });
    pending("clip sent…");
  };
  lr.onclick = () => {
    const f = parseFloat(lrVal.value);
    ctx.send({ type: "command", kind: "scale_lr", args: { factor: f > 0 ? f : 0.5 } });
    pending("Cut LR sent…");
  };
  rw.onclick = () => {
    const steps = Math.max(1, parseInt(rwSteps.value, 10) || 100);
    const skip = Math.max(0, parseInt(rwSkip.value, 10) || 0);
    ctx.send({ type: "command", kind: "rewind", args: { steps, skip } });
    pending("rewind sent…");
  };
  const all = [pause, stop, ckpt, clip, lr, clipVal, clipOn, lrVal, rw, rwSteps, rwSkip];

  return {
    box: bar,
    setState(s, ended) {  // `ended`: the kernel's word, from nbwatch.lifecycle
      state = s;
      pause.textContent = s === "paused" ? "Resume" : "Pause";
      for (const b of all) b.disabled = !!ended;
      bar.dataset.state = s;
    },
    // Acknowledgements: the newest command outcome the runner recorded (an action or a
    // checkpoint applied, a command refused or expired, read from the event's data), not a
    // periodic checkpoint (nobody asked for it: it would hide the ack of a click).
    events(items) {
      for (const it of items) {
        const asked = it.kind === "action" || it.kind === "command"
          || (it.kind === "checkpoint" && it.reason !== "periodic");
        if (asked && it.wall >= seen) {
          seen = it.wall;
          ack.textContent = `${it.kind === "command" ? "✗" : "✓"} ${it.message}`;
          delete ack.dataset.pending;
        }
      }
    },
    refused(msg) { ack.textContent = `✗ ${msg}`; delete ack.dataset.pending; },
    update() {},
    draw() {},
  };
}
