// The export's extra sections: a summary under the header, then tables of alerts and
// actions, checkpoints, config and environment. Every cell is text (textContent), never HTML.
import { el, panel } from "../plot.js";

function table(columns, rows) {
  const t = el("table", "nbw-table");
  const head = el("tr");
  for (const c of columns) head.appendChild(el("th", null, c));
  t.appendChild(el("thead")).appendChild(head);
  const body = el("tbody");
  for (const r of rows) {
    const tr = el("tr");
    r.forEach((v, i) => {
      const td = el("td", null, v === null || v === undefined ? "–" : String(v));
      td.dataset.col = columns[i];
      tr.appendChild(td);
    });
    body.appendChild(tr);
  }
  t.appendChild(body);
  return t;
}

// A section with a table; `more` rows beyond those shown are said in a note.
function section(root, name, title, columns, rows, total) {
  const p = panel(root, name, title);
  p.head.appendChild(el("span", "nbw-small", `${total ?? rows.length} rows`));
  if (!rows.length) p.body.appendChild(el("div", "nbw-small nbw-empty", "none"));
  else p.body.appendChild(table(columns, rows));
  if (total > rows.length) {
    p.body.appendChild(el("div", "nbw-small", `the newest ${rows.length} of ${total} shown; the run folder holds them all`));
  }
  return p.box;
}

// `report`: {summary: [[k, v]], events: {rows, total}, spikes: {rows, total} (each loss
// spike's post-mortem), checkpoints: {rows, total},
// config: [[k, v]], environment: [[k, v]]}. The summary goes under `after`, tables at the end.
export function create(root, report, after) {
  const summary = el("section", "nbw-summary");
  summary.dataset.panel = "summary";
  for (const [k, v] of report.summary || []) {
    const item = el("div", "nbw-summary-item");
    item.append(el("span", "nbw-small", k), el("span", "nbw-summary-value", String(v)));
    summary.appendChild(item);
  }
  after.after(summary);
  const grid = el("div", "nbw-grid nbw-report");
  root.appendChild(grid);
  const ev = report.events || { rows: [], total: 0 };
  section(grid, "events", "Alerts & actions (table)", ["step", "kind", "severity", "message"], ev.rows, ev.total);
  const sp = report.spikes || { rows: [], total: 0 };
  section(grid, "spikes", "Loss spikes: what moved first", ["step", "loss", "z", "moved first", "lead (steps)", "timeline"], sp.rows, sp.total);
  const ck = report.checkpoints || { rows: [], total: 0 };
  section(grid, "checkpoints", "Checkpoints", ["step", "file", "size", "seconds", "best", "reason", "kept"], ck.rows, ck.total);
  section(grid, "config", "Config", ["key", "value"], report.config || []);
  section(grid, "environment", "Environment", ["key", "value"], report.environment || []);
  return summary;
}
