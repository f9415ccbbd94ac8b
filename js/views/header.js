// Header: run name, state, step/max with a progress bar and ETA, tokens/s (with the
// achieved TFLOP/s and MFU where the run records them), the spike score, elapsed.
// A failed run turns red and shows its traceback (as text). `message` (from a followed
// run: "stale: the writer has written nothing for…") is shown under the top line.
import { duration, el, fmt } from "../plot.js";

export function create(root) {
  const box = el("section", "nbw-header");
  box.dataset.panel = "header";
  const top = el("div", "nbw-header-top");
  const name = el("span", "nbw-name");
  const state = el("span", "nbw-state");
  const step = el("span", "nbw-step");
  const stats = el("span", "nbw-stats");
  const spikes = el("span", "nbw-spikes");
  spikes.title = "spike score: steps among the last 10,000 whose train loss or global " +
    "gradient norm stood > 6 SD above the mean of the 128 before (OLMo-core's definition)";
  top.append(name, state, step, stats, spikes);
  const bar = el("div", "nbw-progress");
  const fill = el("div", "nbw-progress-fill");
  bar.appendChild(fill);
  const message = el("div", "nbw-message");
  const error = el("div", "nbw-error");
  const tb = el("pre", "nbw-traceback");
  error.appendChild(tb);
  box.append(top, bar, message, error);
  root.appendChild(box);
  let last = null;

  return {
    box,
    get data() { return last; },
    update(d) {
      last = d;
      name.textContent = d.name || "run";
      name.title = name.textContent; // the whole of a name the header cuts short
      state.textContent = d.state;
      state.dataset.state = d.state;
      box.dataset.state = d.state;
      step.textContent = `step ${d.step}${d.max_steps ? ` / ${d.max_steps}` : ""}`;
      step.dataset.step = String(d.step);
      fill.style.width = `${Math.round((d.progress || 0) * 1000) / 10}%`;
      const parts = [];
      if (d.eta_s !== null && d.eta_s !== undefined) parts.push(`ETA ${duration(d.eta_s)}`);
      if (d.tokens_per_s) parts.push(`${Math.round(d.tokens_per_s).toLocaleString()} tok/s`);
      if (d.mfu !== null && d.mfu !== undefined) parts.push(`MFU ${fmt(100 * d.mfu, 3)}%`);
      if (d.tflops) parts.push(`${fmt(d.tflops, 3)} TFLOP/s`);
      if (d.steps_per_s) parts.push(`${fmt(d.steps_per_s, 3)} steps/s`);
      // nbwatch's own time on the training thread, of the newest step (time/nbwatch)
      if (d.watch_share !== null && d.watch_share !== undefined) parts.push(`watching ${fmt(100 * d.watch_share, 2)}%`);
      parts.push(`elapsed ${d.elapsed || duration(d.elapsed_s)}`); // the kernel's text: the export's summary agrees
      stats.textContent = parts.join(" · ");
      const score = d.spike_score;
      spikes.textContent = score === null || score === undefined ? "" : `spikes ${score}`;
      spikes.dataset.spikes = score ? "yes" : "no";
      message.textContent = d.message || "";
      box.classList.toggle("nbw-failed", !!d.failed);
      error.style.display = d.failed ? "block" : "none"; // over .nbw-error's display: none
      tb.textContent = d.failed ? `${d.error || ""}\n\n${d.traceback || ""}` : "";
    },
    draw() {},
  };
}
