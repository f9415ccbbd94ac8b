"""The dashboard's cold first draw in a bare headless Chromium page (no JupyterLab, no kernel).

    python benchmarks/first_draw.py                     # this tree, 4 cold pages
    python benchmarks/first_draw.py --rounds 6 A B      # trees A and B interleaved (A/B)

A 12-layer, 12-head GPT-2 run (tests/scripts/wide_run.py, 165 steps, an eval every 50) is
written once and its full state packed as the widget sends it (`--state` keeps or reuses
it). Each tree (a folder with js/ and nbwatch/static/, e.g. a git worktree of another
commit; bundled with this tree's js/node_modules esbuild) gets a page that mounts the live
dashboard (js/mount.js) on that state while plotly.js imports, as js/index.js does, in a
1400 × 1800 viewport. Each round opens a fresh browser per tree.
Printed per page: the first draw as js/index.js measures it (wall, ms), the renderer main
thread's CPU time of that draw (CDP `Performance.getMetrics` ThreadTime; the page waits for
the measurement before it draws) and of everything before it (the import of plotly.js
included). CPU time is what tells two variants apart on a loaded machine: wall time there
swings by 2x. benchmarks/dashboard.py --draw is the measure in JupyterLab itself.
"""

from __future__ import annotations

import argparse
import base64
import functools
import http.server
import json
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PAGE = """<!doctype html><html><head><meta charset="utf-8">
<link rel="stylesheet" href="dashboard.css">
<style>body{margin:0;font-family:sans-serif} #app{width:1080px;margin-left:300px}</style></head>
<body><div id="app"></div><script type="module" src="harness.js"></script></body></html>"""

HARNESS = """
import { mount } from "JS/mount.js";
import { plotlyState, receivePlotly, unpack } from "JS/plot.js";
const bytes = (b64) => Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
async function main() {
  const [state, plotly] = await Promise.all([fetch("state.json").then((r) => r.json()),
    fetch("plotly.js").then((r) => r.arrayBuffer())]);
  const root = document.createElement("div");
  root.className = "nbw-root";
  document.getElementById("app").appendChild(root);
  let Plotly = null, frame = null, fullAt = null, plotlyAt = null, restAt = null;
  const ctx = { send: () => {}, xaxis: "step", saveAxis: () => {},
    schedule: () => { if (frame === null) frame = requestAnimationFrame(draw); } };
  const board = mount(root, ctx, { live: true });
  function draw() {
    frame = null;
    if (!Plotly) return;
    board.draw(Plotly);
    if (fullAt !== null) {
      performance.measure("nbw:first-draw", { start: Math.max(fullAt, plotlyAt) });
      restAt = Math.max(fullAt, plotlyAt);
      fullAt = null;
      window.__first = true;
    }
    if (restAt !== null && !board.pending()) { restAt = null; window.__done = true; }
  }
  performance.mark("nbw:plotly-msg");
  receivePlotly(plotly);
  await new Promise((r) => setTimeout(r, 50)); // the state lands while plotly.js imports
  fullAt = performance.now();
  board.apply(unpack(state.msg.panels, state.buffers.map(bytes)), true);
  plotlyState().promise.then((P) => {
    window.__ready = true; // the CPU time is read here, then the draw goes
    window.__go = () => { Plotly = P; plotlyAt = performance.now(); ctx.schedule(); };
  });
}
main();
"""


def write_state(path: Path) -> None:
    """A finished 12 × 12 run's full state, packed as the widget sends it."""
    import nbwatch.hf
    from nbwatch.panels import Feed
    from nbwatch.store import RunReader
    from nbwatch.widget import pack
    from tests.scripts.wide_run import make_trainer

    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        nbwatch.hf.start(make_trainer(Path(tmp) / "out", steps=165, eval_steps=50),
                         run_dir=run, display=False).wait()
        feed = Feed(RunReader(run))
        feed.update()
        while feed.more:
            feed.update()
        panels = feed.full()
        panels["header"]["state"] = "running"  # drawn as a live run's reload is
        buffers: list = []
        msg = pack({"type": "full", "panels": panels}, buffers)
        path.write_text(json.dumps({"msg": msg, "buffers": [
            base64.b64encode(bytes(b)).decode() for b in buffers]}))
        feed.tail.reader.close()


class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


def serve(tree: Path, state: Path, www: Path) -> str:
    www.mkdir(parents=True)
    (www / "index.html").write_text(PAGE)
    (www / "state.json").write_bytes(state.read_bytes())
    for name in ("plotly.js", "dashboard.css"):
        (www / name).write_bytes((tree / "nbwatch" / "static" / name).read_bytes())
    entry = www.parent / f"{www.name}-entry.js"
    entry.write_text(HARNESS.replace("JS/", f"{tree / 'js'}/"))
    esbuild = ROOT / "js" / "node_modules" / ".bin" / "esbuild"  # this tree's: npm ci in js/
    subprocess.run([str(esbuild), str(entry), "--bundle", "--format=esm", "--minify",
                    "--target=es2020", f"--outfile={www / 'harness.js'}", "--log-level=warning"],
                   check=True)
    handler = functools.partial(Quiet, directory=str(www))
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{srv.server_address[1]}/index.html"


def one_page(pw, url: str) -> dict:
    from tests.browser.conftest import ARGS, CHROMIUM

    b = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
    try:
        page = b.new_page(viewport={"width": 1400, "height": 1800})
        cdp = page.context.new_cdp_session(page)
        cdp.send("Performance.enable")

        def cpu() -> float:
            m = {x["name"]: x["value"] for x in cdp.send("Performance.getMetrics")["metrics"]}
            return 1e3 * m["ThreadTime"]

        page.goto(url)
        page.wait_for_function("() => window.__ready", timeout=60_000)
        before = cpu()
        page.evaluate("() => window.__go()")
        page.wait_for_function("() => window.__first", timeout=60_000)
        draw_cpu = cpu() - before
        wall = page.evaluate("() => performance.getEntriesByName('nbw:first-draw')[0].duration")
        page.wait_for_function("() => window.__done", timeout=60_000)
        return {"wall_ms": round(wall), "cpu_ms": round(draw_cpu), "cpu_before_ms": round(before)}
    finally:
        b.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trees", nargs="*", type=Path, default=[ROOT])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--state", type=Path, help="the packed full state (written when missing)")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp:
        state = args.state or Path(tmp) / "state.json"
        if not state.exists():
            write_state(state)
        urls = [serve(t.resolve(), state, Path(tmp) / f"www{i}") for i, t in enumerate(args.trees)]
        rows: dict[int, list[dict]] = {i: [] for i in range(len(urls))}
        print(f"load {Path('/proc/loadavg').read_text().split()[:3]}", flush=True)
        with sync_playwright() as pw:
            for r in range(args.rounds):
                for i, url in enumerate(urls):
                    rows[i].append(one_page(pw, url))
                    print(f"round {r + 1} {args.trees[i]}: {rows[i][-1]}", flush=True)
        print(f"load {Path('/proc/loadavg').read_text().split()[:3]}")
        for i, t in enumerate(args.trees):
            med = {k: statistics.median(x[k] for x in rows[i]) for k in rows[i][0]}
            print(f"{t}: medians of {args.rounds}: first draw {med['wall_ms']:.0f} ms wall, "
                  f"{med['cpu_ms']:.0f} ms CPU; CPU before it {med['cpu_before_ms']:.0f} ms")


if __name__ == "__main__":
    main()
