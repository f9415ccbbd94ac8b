// Alerts: a feed of alerts, actions, checkpoints and errors, newest first, by severity. A
// click on an item shows its step in every trend chart (mount.js focus()); a second click on
// the same step gives the whole run back. Routine best checkpoints one after another are one
// item (the kernel folds those of one refresh: nbwatch/panels/alerts.py); a refresh's oldest
// one folds into the newest item shown, where that is one too.
import { el, panel } from "../plot.js";

const MAX_ITEMS = 200;

// As nbwatch/panels/alerts.py fold(): two items of routine best checkpoints → one.
function fold(older, newer) {
  const count = older.count + newer.count;
  return { ...newer, count, first: older.first, message: `best checkpoint ×${count}, last at step ${newer.step}` };
}

export function create(root, ctx) {
  const p = panel(root, "alerts", "Alerts & actions");
  const list = el("ol", "nbw-feed");
  p.body.appendChild(list);
  const empty = el("div", "nbw-small nbw-empty", "nothing yet");
  p.body.appendChild(empty);
  return {
    box: p.box,
    update(d, full) {
      if (full) list.replaceChildren();
      if (!d.items) return;
      const items = d.items.slice();
      const last = items.length - 1, top = list.firstChild;
      if (!full && items[last].routine && top && top.dataset.routine) {
        items[last] = fold({ count: Number(top.dataset.count), first: Number(top.dataset.first) }, items[last]);
        top.remove();
      }
      const rows = items.map((it) => {
        const li = el("li", "nbw-item");
        li.dataset.severity = it.severity;
        li.dataset.kind = it.kind;
        li.append(el("span", "nbw-item-step", `step ${it.step}`), el("span", "nbw-item-kind", it.kind),
          el("span", "nbw-item-msg", it.message));
        li.dataset.step = String(it.step);
        if (it.routine) Object.assign(li.dataset, { routine: "yes", count: String(it.count), first: String(it.first) });
        li.tabIndex = 0;
        li.title = `show step ${it.step} in the charts (click again: the whole run)`;
        const go = () => {
          const at = ctx.focus(it.step);
          for (const o of list.children) delete o.dataset.focused;
          if (at !== null) li.dataset.focused = "yes";
        };
        li.onclick = go;
        li.onkeydown = (e) => { if (e.key === "Enter") go(); };
        return li;
      });
      list.prepend(...rows);
      while (list.children.length > MAX_ITEMS) list.lastChild.remove();
      empty.style.display = list.children.length ? "none" : "";
    },
    draw() {},
  };
}
