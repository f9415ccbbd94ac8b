// Samples: what sample_fn returned at each eval, newest first: text (never HTML), an image
// (its PNG, drawn pixel for pixel) or a small table (cells as text).
import { el, panel } from "../plot.js";

const MAX_ITEMS = 50;

function image(c) {
  const img = el("img", "nbw-sample-image");
  img.width = c.width;
  img.height = c.height;
  img.alt = `sample image ${c.width}×${c.height}`;
  img.src = `data:image/png;base64,${c.png}`;
  return img;
}

function table(c) {
  const t = el("table", "nbw-sample-table");
  const head = el("tr");
  for (const name of c.columns) head.appendChild(el("th", "", String(name)));
  t.appendChild(el("thead")).appendChild(head);
  const body = t.appendChild(el("tbody"));
  for (const row of c.rows) {
    const tr = body.appendChild(el("tr"));
    for (const v of row) {
      const td = el("td", "", v === null ? "" : typeof v === "number" ? String(+v.toPrecision(6)) : String(v));
      if (typeof v === "number") td.className = "nbw-num";
      tr.appendChild(td);
    }
  }
  return t;
}

export function create(root) {
  const p = panel(root, "samples", "Samples");
  const list = el("div", "nbw-samples");
  p.body.appendChild(list);
  p.box.hidden = true; // until a sample_fn's first sample
  return {
    box: p.box,
    update(d, full) {
      if (full) list.replaceChildren();
      if (!d.items) return;
      p.box.hidden = false;
      list.prepend(...d.items.map((it) => {
        const row = el("div", "nbw-sample");
        row.dataset.kind = it.content ? it.content.kind : "text";
        row.append(el("span", "nbw-item-step", `step ${it.step}`));
        if (it.content && it.content.kind === "image") {
          row.append(el("span", "nbw-sample-caption", it.text), image(it.content));
        } else if (it.content && it.content.kind === "table") {
          row.append(el("span", "nbw-sample-caption", it.text), table(it.content));
        } else {
          row.append(el("pre", "nbw-sample-text", it.text));
        }
        return row;
      }));
      while (list.children.length > MAX_ITEMS) list.lastChild.remove();
    },
    draw() {},
  };
}
