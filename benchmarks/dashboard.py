"""Dashboard traffic and latency.

    python benchmarks/dashboard.py            # bytes and CPU per refresh at 1k/100k/1M steps
    python benchmarks/dashboard.py --latency  # + recorded step → page latency, notebook growth
    python benchmarks/dashboard.py --draw     # + page main-thread time: 2-layer demo vs 12 × 12
    python benchmarks/dashboard.py --sizes= --attention  # bytes of an eval's attention

Traffic: a synthetic run is written straight through `RunStore` (20 scalars a step, an eval
every 100 steps, 16 weight histograms every 1,000), the dashboard's `Feed` reads it all,
then each refresh appends 10 steps (40 steps/s at 4 refreshes/s) and measures what
`Dashboard.refresh` does: read what is new, build the panels, pack the message. Bytes =
JSON content + binary buffers. Latency needs JupyterLab and /usr/bin/chromium (the browser
test harness): a real Monitor trains the demo at ~20 steps/s; the page records when each
step arrives; the store holds when each step was recorded.

Draw: the same JupyterLab + Chromium, a live run of the 2-layer demo and of a 12-layer,
12-head GPT-2 under a real Trainer (tests/scripts/wide_run.py). The page's own Performance
API measures (js/index.js): main-thread time of each refresh (unpack + fold in + draw), the
first full draw after a page reload (from when the page has both the state and plotly.js:
the panels on screen; then until the panels out of view, drawn one a frame after, are drawn),
and the bytes of each message.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nbwatch.panels import Feed  # noqa: E402
from nbwatch.panels import attention as attention_panel  # noqa: E402
from nbwatch.records import Attention, Event, Histogram, Scalars  # noqa: E402
from nbwatch.store import RunReader, RunStore  # noqa: E402
from nbwatch.widget import pack  # noqa: E402

LAYERS = [f"blocks.{i}.{m}" for i in range(4)
          for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")]


def step_values(step: int, rng: np.random.Generator) -> dict[str, float]:
    v = {"loss/train": 3.0 / (1 + step / 5e4) + 0.05 * rng.standard_normal(),
         "lr": 3e-4, "grad_norm/global": 1 + 0.1 * rng.standard_normal(),
         "grad_norm/clipped": 1.0, "throughput/tokens_per_s": 5e4, "time/step": 0.1,
         "time/data": 0.01, "time/compute": 0.09, "data/padding_ratio": 0.2,
         "data/seq_len_mean": 90.0}
    v.update({f"grad_norm/{n}": float(x) for n, x in zip(LAYERS[:10], rng.random(10))})
    return v


def write(store: RunStore, first: int, last: int, rng: np.random.Generator) -> None:
    for step in range(first, last + 1):
        store.put(Scalars(step, step_values(step, rng), wall=time.time()))
        if step % 100 == 0:
            store.put(Scalars(step, {"loss/val": 2.5, "loss/gap": 0.1}))
        if step % 1000 == 0:
            edges, counts = np.linspace(-0.1, 0.1, 65), rng.integers(0, 1000, 64)
            for n in LAYERS:
                store.put(Histogram(step, f"weight/{n}", edges, counts))
        if step % 20_000 == 0:
            store.put(Event(step, "checkpoint", "info", f"periodic checkpoint at step {step}"))
        if step % 50_000 == 0:
            store.flush()
    store.flush()


def message_bytes(panels: dict, kind: str = "delta") -> int:
    buffers: list = []
    content = pack({"type": kind, "panels": panels}, buffers)
    return len(json.dumps(content)) + sum(b.nbytes for b in buffers)


def traffic(sizes: list[int], refreshes: int = 40) -> list[dict]:
    rows = []
    for n in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            rng = np.random.default_rng(0)
            store = RunStore(tmp)
            for k, v in {"name": "bench", "state": "running", "max_steps": 2 * n,
                         "started": time.time()}.items():
                store.set_meta(k, v)
            t0 = time.perf_counter()
            write(store, 1, n, rng)
            t_write = time.perf_counter() - t0
            feed = Feed(RunReader(tmp))
            t0 = time.perf_counter()
            feed.update()
            while feed.more:
                feed.update()
            t_catch = time.perf_counter() - t0
            full = message_bytes(feed.full(), "full")
            sizes_b, cpu = [], []
            step = n
            for _ in range(refreshes):
                write(store, step + 1, step + 10, rng)
                step += 10
                c0 = time.process_time()
                upd = feed.update()
                b = message_bytes(upd) if upd else 0
                cpu.append(time.process_time() - c0)
                sizes_b.append(b)
            store.close()
            feed.tail.reader.close()
            rows.append({"steps": n, "write_s": t_write, "catch_up_s": t_catch, "full_bytes": full,
                         "delta_bytes_median": float(np.median(sizes_b)),
                         "delta_bytes_max": max(sizes_b),
                         "cpu_ms_median": 1e3 * float(np.median(cpu)),
                         "cpu_ms_p95": 1e3 * float(np.percentile(cpu, 95))})
            r = rows[-1]
            print(f"{n:>9,d} steps | write {t_write:6.1f}s | catch-up {t_catch:6.1f}s | "
                  f"replay {full / 1e3:8.1f} kB | "
                  f"per refresh {r['delta_bytes_median'] / 1e3:6.2f} kB "
                  f"(max {r['delta_bytes_max'] / 1e3:6.2f}) | CPU {r['cpu_ms_median']:5.2f} ms "
                  f"(p95 {r['cpu_ms_p95']:5.2f})", flush=True)
    return rows


def attention_bytes(shapes: list[tuple[int, int]], tokens: int = 64, samples: int = 2
                    ) -> list[dict]:
    """Bytes of the refresh an eval sends (its attention panel) at layers × heads, with
    every head's map (what the export embeds; what every eval sent before issue 24) and
    with the overview alone (what an eval sends now), and of one head's map as the page
    fetches it (float32 [T, T]). `samples` probe samples of `tokens` tokens (the
    Monitor's default: 2)."""
    rows = []
    rng = np.random.default_rng(0)
    for layers, heads in shapes:
        with tempfile.TemporaryDirectory() as tmp:
            store = RunStore(tmp)
            store.set_meta("state", "running")
            for i in range(samples):
                for layer in range(layers):
                    a = rng.random((heads, tokens, tokens)).astype(np.float32)
                    store.put(Attention(100, f"h.{layer}.attn", i, a / a.sum(-1, keepdims=True),
                                        tuple(f"t{j}" for j in range(tokens))))
            store.close()
            feed = Feed(RunReader(tmp))
            upd = feed.update() or {}
            overview = message_bytes({"attention": upd["attention"]})
            full = message_bytes({"attention": attention_panel.build(
                feed.attention, feed.latest, maps=True)})
            one = attention_panel.head_map(RunReader(tmp).attention(100, 0), "h.0.attn", 0)
            fetch = message_bytes({"map": one}, "attention")
        rows.append({"layers": layers, "heads": heads, "tokens": tokens, "samples": samples,
                     "with_maps_bytes": full, "overview_bytes": overview,
                     "one_head_fetch_bytes": fetch})
        print(f"{layers:>3} layers × {heads:>3} heads, {samples} samples of {tokens} tokens: "
              f"eval message with every map {full / 1e6:8.3f} MB | overview only "
              f"{overview / 1e3:7.1f} kB | one head fetched {fetch / 1e3:5.1f} kB", flush=True)
    return rows


@contextmanager
def lab_page(name: str, write: Callable[[Path], object]) -> Iterator[tuple[Any, Path]]:
    """A real JupyterLab on a temporary folder, in which `write(root)` put `name`.ipynb, and
    a headless Chromium page with that notebook open (no request leaves 127.0.0.1)."""
    from playwright.sync_api import sync_playwright

    from tests.browser.conftest import ARGS, CHROMIUM, Server
    from tests.browser.harness import open_notebook

    with tempfile.TemporaryDirectory() as tmp:
        root, home = Path(tmp) / "root", Path(tmp) / "home"
        root.mkdir()
        home.mkdir()
        write(root)
        srv = Server("lab", root, home)
        try:
            with sync_playwright() as pw:
                b = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
                try:
                    page = b.new_page(viewport={"width": 1400, "height": 1800})
                    page.route("**/*", lambda r: r.continue_() if r.request.url.startswith(
                        ("http://127.0.0.1", "ws://127.0.0.1", "blob:", "data:")) else r.abort())
                    open_notebook(page, f"{srv.url}/lab/tree/{name}.ipynb?reset")
                    yield page, root
                finally:
                    b.close()
        finally:
            srv.shutdown_kernels()
            srv.stop()


def latency(seconds: float = 25.0) -> dict:
    """Recorded step → page latency in a real JupyterLab + headless Chromium."""
    from tests.browser.conftest import write_notebook
    from tests.browser.harness import kernel_json, run_all, wait_step

    def write(root: Path) -> None:
        write_notebook(root, "latency", steps=100_000, sleep=0.04)

    with lab_page("latency", write) as (page, root):
        path = root / "latency.ipynb"
        size0 = path.stat().st_size
        run_all(page)
        wait_step(page, 5)
        page.evaluate("""() => {
            window.__arrivals = [];
            const root = document.querySelector('.nbw-root');
            new MutationObserver(() => window.__arrivals.push(
                [Date.now() / 1000, Number(root.dataset.step)])
            ).observe(root, {attributes: true, attributeFilter: ['data-step']});
        }""")
        time.sleep(seconds)
        arrivals = page.evaluate("() => window.__arrivals")
        walls = kernel_json(page, "{int(k): float(v) for k, v in "
                                  "nbwatch.open_run(mon.run_dir).reader.walls().items()}")
        rate = kernel_json(page, "mon.step") / max(seconds, 1)
        page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
        time.sleep(1.5)
        kernel_json(page, "mon.stop()")
        size1 = path.stat().st_size
    lat, prev = [], None
    for t, step in arrivals:
        if prev is not None:
            lat += [t - walls[str(s)] for s in range(prev + 1, step + 1) if str(s) in walls]
        prev = step
    lat = np.array(lat)
    out = {"steps_measured": len(lat), "p50_s": float(np.median(lat)),
           "p95_s": float(np.percentile(lat, 95)), "max_s": float(lat.max()),
           "updates_per_s": len(arrivals) / seconds, "train_steps_per_s": rate,
           "notebook_growth_bytes": size1 - size0}
    print(f"latency recorded step → page: p50 {out['p50_s']:.3f}s  p95 {out['p95_s']:.3f}s  "
          f"max {out['max_s']:.3f}s over {len(lat)} steps; {out['updates_per_s']:.1f} updates/s; "
          f"saved notebook grew by {out['notebook_growth_bytes'] / 1e3:.1f} kB", flush=True)
    return out


WIDE_CELL = """\
import tempfile, torch, nbwatch.hf
from tests.scripts.wide_run import make_trainer
mon = nbwatch.hf.start(make_trainer(tempfile.mkdtemp(), steps=100_000, delay=0.04, eval_steps=50),
                       run_dir='runs/draw')
"""


def _page_figures(page) -> dict:
    return page.evaluate("""() => {
        const d = (n) => performance.getEntriesByName(n).map((e) => e.duration);
        const panels = {};
        for (const e of performance.getEntriesByType('measure')) {
          if (!e.name.startsWith('nbw:draw:')) continue;
          const k = e.name.slice(9);
          (panels[k] = panels[k] || []).push(e.duration);
        }
        return {draw: d('nbw:draw'), apply: d('nbw:apply'), first: d('nbw:first-draw'),
                full: d('nbw:full-draw'),
                bytes: window.__nbwatchBytes || [], panels};
    }""")


def draw_timings(model: str, seconds: float = 30.0) -> dict:
    """Main-thread time per refresh and of the first full draw, in a real JupyterLab."""
    import nbformat

    from tests.browser.conftest import write_notebook
    from tests.browser.harness import kernel_json, run_all, wait_step

    def write(root: Path) -> None:
        if model == "demo":
            write_notebook(root, "draw", steps=100_000, sleep=0.04)
            return
        nb = nbformat.v4.new_notebook(metadata={"kernelspec": {
            "name": "python3", "display_name": "Python 3", "language": "python"}})
        nb.cells = [nbformat.v4.new_code_cell(WIDE_CELL)]
        nbformat.write(nb, root / "draw.ipynb")

    with lab_page("draw", write) as (page, root):
        page.evaluate("() => { window.__nbwatchBytes = []; }")
        run_all(page)
        wait_step(page, 60, timeout=120)  # past the first eval: attention drawn
        page.evaluate("() => performance.clearMeasures()")
        page.evaluate("() => { window.__nbwatchBytes = []; }")
        time.sleep(seconds)
        live = _page_figures(page)
        steps = kernel_json(page, "mon.step")
        saved = (root / "draw.ipynb").stat().st_mtime_ns
        page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
        deadline = time.monotonic() + 30  # the reloaded page shows the saved outputs
        while (root / "draw.ipynb").stat().st_mtime_ns == saved:
            if time.monotonic() > deadline:
                raise TimeoutError("JupyterLab did not save the notebook")
            time.sleep(0.1)
        page.reload()
        page.wait_for_selector(".nbw-root[data-drawn]", timeout=90_000)
        page.wait_for_function(
            "() => performance.getEntriesByName('nbw:first-draw').length", timeout=30_000)
        # the panels out of view, drawn in the frames after the first draw (older code:
        # no such measure)
        with contextlib.suppress(Exception):
            page.wait_for_function(
                "() => performance.getEntriesByName('nbw:full-draw').length", timeout=30_000)
        after = _page_figures(page)
        first, full = after["first"], after["full"]
        kernel_json(page, "mon.stop()")
    n_refresh = sum(1 for kind, _ in live["bytes"] if kind == "delta")
    per_refresh = (sum(live["apply"]) + sum(live["draw"])) / max(n_refresh, 1)
    per = live["draw"]  # each frame's drawing: the longest task a refresh puts on the page
    busiest = sorted(((float(np.sum(v)) / max(n_refresh, 1), k)
                      for k, v in live["panels"].items()), reverse=True)[:4]
    # how often a panel redrew (a draw under 1 ms is a view with nothing new)
    redraws = {k: sum(1 for ms in v if ms > 1) / seconds for k, v in live["panels"].items()}
    others = float(np.median([v for k, v in redraws.items() if k != "loss" and v] or [0]))
    print(f"{model:>6}: per refresh, unpack + fold in {sum(live['apply']) / max(n_refresh, 1):.1f}"
          f" ms; drawing, by panel: " + ", ".join(
        f"{k} {ms:.1f} ms" for ms, k in busiest) + f" | redraws/s: loss "
          f"{redraws.get('loss', 0):.2f}, the others {others:.2f} (median); "
          f"{n_refresh / seconds:.1f} refreshes/s", flush=True)
    deltas = [n for kind, n in live["bytes"] if kind == "delta"]
    third = max(len(deltas) // 3, 1)
    out = {"model": model, "refreshes": n_refresh, "steps": steps,
           "refresh_ms_mean": per_refresh,
           "frame_ms_p50": float(np.median(per)), "frame_ms_p95": float(np.percentile(per, 95)),
           "frame_ms_max": float(max(per)), "first_draw_ms": float(first[0]),
           "loss_redraws_per_s": redraws.get("loss", 0.0),
           "full_draw_ms": float(full[0]) if full else float("nan"),
           "delta_kb_first_third": float(np.median(deltas[:third])) / 1e3,
           "delta_kb_last_third": float(np.median(deltas[-third:])) / 1e3}
    print(f"{model:>6}: first full draw {out['first_draw_ms']:6.0f} ms (on screen; every "
          f"panel drawn {out['full_draw_ms']:6.0f} ms) | main thread per "
          f"refresh {out['refresh_ms_mean']:5.1f} ms; per frame p50 {out['frame_ms_p50']:5.1f} "
          f"p95 {out['frame_ms_p95']:5.1f} max {out['frame_ms_max']:5.1f} ms "
          f"({out['refreshes']} refreshes, to step {steps}) | "
          f"delta {out['delta_kb_first_third']:.2f} kB → {out['delta_kb_last_third']:.2f} kB",
          flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000,100000,1000000")
    ap.add_argument("--latency", action="store_true")
    ap.add_argument("--draw", action="store_true")
    ap.add_argument("--attention", action="store_true")
    ap.add_argument("--models", default="demo,12x12")
    ap.add_argument("--seconds", type=float, default=25.0)
    args = ap.parse_args()
    if args.sizes:
        traffic([int(s) for s in args.sizes.split(",")])
    if args.attention:
        attention_bytes([(12, 12), (32, 32)])
    if args.latency:
        latency(args.seconds)
    if args.draw:
        rows = [draw_timings(m, args.seconds) for m in args.models.split(",")]
        if len(rows) == 2:
            a, b = rows
            print(f"{b['model']} / {a['model']}: first draw "
                  f"{b['first_draw_ms'] / a['first_draw_ms']:.2f}×, refresh p50 "
                  f"{b['refresh_ms_mean'] / a['refresh_ms_mean']:.2f}×")


if __name__ == "__main__":
    main()
