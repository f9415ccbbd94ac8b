// Samples: text from sample_fn at each eval, newest first, shown as text (never HTML).
import { el, panel } from "../plot.js";

const MAX_ITEMS = 50;

export function create(root) {
  const p = panel(root, "samples", "Samples");
  const list = el("div", "nbw-samples");
  p.body.appendChild(list);
  p.box.hidden = true; // until a sample_fn's first text
  return {
    box: p.box,
    update(d, full) {
      if (full) list.replaceChildren();
      if (!d.items) return;
      p.box.hidden = false;
      list.prepend(...d.items.map((it) => {
        const row = el("div", "nbw-sample");
        row.append(el("span", "nbw-item-step", `step ${it.step}`), el("pre", "nbw-sample-text", it.text));
        return row;
      }));
      while (list.children.length > MAX_ITEMS) list.lastChild.remove();
    },
    draw() {},
  };
}
