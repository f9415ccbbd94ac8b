// Controls bar, built from the kernel's command table (nbwatch.controls.page_table()): a
// button per command, an input per argument (a checkbox beside one whose "off" sends
// null), and one button for a command and the one that stands in for it while the run is
// paused (Pause / Resume). A click sends one command, its arguments by name; what the bar
// shows as done is the runner's event coming back.
import { el } from "../plot.js";

// One argument's input (and its on/off checkbox, nbw-<command>-on), with its note.
function input(field, cmd) {
  const box = el("span", "nbw-field");
  const value = el("input", `nbw-${field.css}`);
  value.type = "number";
  value.step = String(field.step);
  value.min = String(field.least);
  value.value = String(field.value);
  value.dataset.arg = field.name;
  box.appendChild(value);
  let on = null;
  if (field.switch) {
    on = el("input", `nbw-${cmd.css}-on`);
    on.type = "checkbox";
    on.checked = true;
    on.title = `on: ${field.name} is the value; off: none`;
    box.appendChild(on);
  }
  if (field.note) box.appendChild(el("span", "nbw-small", field.note));
  // what the user typed, as typed (an empty box too): the kernel checks it and says what
  // is wrong, naming the argument
  const read = () => {
    if (on && !on.checked) return null;
    const v = field.integer ? parseInt(value.value, 10) : parseFloat(value.value);
    return Number.isFinite(v) ? v : value.value;
  };
  return { box, read, inputs: on ? [value, on] : [value] };
}

export function create(root, ctx, table) {
  const bar = el("div", "nbw-controls");
  bar.dataset.panel = "controls";
  let state = "starting";
  let seen = 0;
  const ack = el("span", "nbw-ack");
  const pending = (text) => { ack.textContent = text; ack.dataset.pending = "1"; };
  const all = [];
  const toggles = []; // [button, its command, the one it becomes while paused]
  for (const cmd of table || []) {
    if (cmd.instead_of) continue; // shown on the button it stands in for
    const b = el("button", `nbw-btn nbw-${cmd.css}`, cmd.label);
    b.type = "button";
    b.dataset.kind = cmd.kind;
    if (cmd.title) b.title = cmd.title;
    const fields = (cmd.fields || []).map((f) => input(f, cmd));
    const paused = (table || []).find((o) => o.instead_of === cmd.kind);
    if (paused) toggles.push([b, cmd, paused]);
    b.onclick = () => {
      const now = paused && state === "paused" ? paused : cmd;
      const args = {};
      (cmd.fields || []).forEach((f, i) => { args[f.name] = fields[i].read(); });
      const msg = { type: "command", kind: now.kind };
      if (fields.length) msg.args = args;
      ctx.send(msg);
      pending(`${now.label} sent…`);
    };
    all.push(b, ...fields.flatMap((f) => f.inputs));
    if (fields.length) {
      const group = el("span", "nbw-group");
      group.append(b, ...fields.map((f) => f.box));
      bar.appendChild(group);
    } else {
      bar.appendChild(b);
    }
  }
  bar.appendChild(ack);
  root.appendChild(bar);

  return {
    box: bar,
    setState(s, ended) {  // `ended`: the kernel's word, from nbwatch.lifecycle
      state = s;
      for (const [b, cmd, paused] of toggles) {
        const now = s === "paused" ? paused : cmd;
        b.textContent = now.label;
        b.title = now.title || "";
        b.dataset.kind = now.kind;
      }
      for (const b of all) b.disabled = !!ended;
      bar.dataset.state = s;
    },
    // Acknowledgements: the newest command outcome the runner recorded (an action or a
    // checkpoint applied, a command refused or expired, read from the event's data), not a
    // checkpoint nobody asked for (periodic, emergency, final: it would read as a click's).
    events(items) {
      for (const it of items) {
        const asked = it.kind === "action" || it.kind === "command"
          || (it.kind === "checkpoint" && (it.reason === "manual" || it.reason === "stop"));
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
