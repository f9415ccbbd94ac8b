"""The README's dashboard screenshots, from runs made here.

Exported: a 2-layer TinyGPT (the demo) and a 12-layer, 12-head GPT-2 under a real Trainer with
one layer's gradient spiked at step 30 (tests/scripts/wide_run.py). Each run is exported to
HTML and shot in headless Chromium.

Live: the demo started from a notebook in a real JupyterLab on 127.0.0.1 (the browser tests'
server and page helpers, tests/browser/), its dashboard in the cell's output; at step ~120 the
page's Clip button is clicked with 0.05, at step ~140 Cut LR with ×0.5, and at step ~400 (eight
evals done) the dashboard's header, controls, Loss, Gradients and Weights are shot. About a
minute on 2 cores; no request leaves 127.0.0.1.

    python docs/screenshots.py        # writes docs/dashboard_2layer.png, docs/dashboard_12x12.png
    python docs/screenshots.py live   # writes docs/dashboard.png
    python docs/screenshots.py all    # all three
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def demo_run(run_dir: Path) -> Path:
    import torch

    import nbwatch
    from nbwatch.demo import make_demo

    torch.set_num_threads(1)
    demo = make_demo(d=64, layers=2, heads=2, ctx=64, max_steps=400)
    mon = nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler, run_dir=run_dir,
                          config=demo.config, name="tinygpt-2layer")
    mon.start(max_steps=400, eval_every=100, display=False, **demo.start_kwargs()).wait()
    return run_dir


def shoot(html: Path, png: Path, width: int = 1400) -> None:
    from playwright.sync_api import sync_playwright

    from tests.browser.conftest import ARGS, CHROMIUM

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = b.new_page(viewport={"width": width, "height": 1000}, device_scale_factor=1)
        page.goto(html.as_uri())
        page.wait_for_selector(".nbw-root[data-ready]", timeout=60_000)
        page.wait_for_timeout(500)
        # the dashboard, without the export's tables below it
        box = page.evaluate("""() => {
            const r = document.querySelector('.nbw-root').getBoundingClientRect();
            const end = document.querySelector('[data-panel=alerts]').getBoundingClientRect();
            return {x: r.x, y: r.y + window.scrollY, width: r.width,
                    height: end.bottom + window.scrollY - r.y};
        }""")
        page.screenshot(path=str(png), clip=box, full_page=True)
        b.close()


# The live run's notebook: the quickstart's cells with a 2-layer demo and its own run folder.
LIVE_CELLS = [
    "%load_ext nbwatch\n"
    "import torch\n"
    "import nbwatch\n"
    "from nbwatch.demo import make_demo\n"
    "torch.set_num_threads(1)  # the browser keeps a core",
    "steps = 600\n"
    "demo = make_demo(layers=2, heads=2, max_steps=steps)",
    "mon = nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler, config=demo.config,\n"
    "                      run_dir='runs/tinygpt-2layer')\n"
    "mon.start(max_steps=steps, eval_every=50, **demo.start_kwargs())",
]
CLIP_AT, LR_AT, SHOT_AT = 120, 140, 400


def live(png: Path, width: int = 1492, height: int = 2000) -> None:
    """Run the demo live in JupyterLab, steer it through the dashboard, shoot the dashboard."""
    import nbformat
    from playwright.sync_api import sync_playwright

    from tests.browser.conftest import ARGS, CHROMIUM, Server
    from tests.browser.harness import (
        ack,
        kernel_json,
        local_only,
        open_notebook,
        panels_rendered,
        run_all,
        trace,
        wait_step,
    )

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "root").mkdir()
        (tmp / "home").mkdir()
        nb = nbformat.v4.new_notebook(metadata={"kernelspec": {
            "name": "python3", "display_name": "Python 3", "language": "python"}})
        nb.cells = [nbformat.v4.new_code_cell(c) for c in LIVE_CELLS]
        nbformat.write(nb, tmp / "root" / "quickstart.ipynb")
        srv = Server("lab", tmp / "root", tmp / "home")
        try:
            with sync_playwright() as pw:
                b = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
                ctx = b.new_context(viewport={"width": width, "height": height},
                                    device_scale_factor=1)
                blocked = local_only(ctx)  # as the browser tests': nothing leaves 127.0.0.1
                page = ctx.new_page()
                errors: list[str] = []
                page.on("pageerror", lambda e: errors.append(str(e)))
                open_notebook(page, f"{srv.url}/lab/tree/quickstart.ipynb?reset")
                run_all(page)
                wait_step(page, CLIP_AT, timeout=180)
                page.fill(".nbw-clip-value", "0.05")
                page.click(".nbw-clip")
                print("clip:", ack(page, "clipping"))
                wait_step(page, LR_AT, timeout=60)
                page.fill(".nbw-lr-factor", "0.5")
                page.click(".nbw-lr")
                print("cut LR:", ack(page, "LR scaled ×0.5"))
                wait_step(page, SHOT_AT, timeout=180)
                page.wait_for_function(
                    "() => document.querySelector('[data-panel=loss] .js-plotly-plot')"
                    "?.data?.some((t) => t.name === 'val loss' && t.x.length > 0)",
                    timeout=30_000)
                # the panels draw within the page's main-thread budget: let them catch up
                root = page.locator(".nbw-root").first
                root.evaluate("(e) => e.scrollIntoView({block: 'start'})")
                page.mouse.move(width - 1, height - 1)  # no hover: no plotly mode bar
                page.wait_for_timeout(1500)
                drawn = panels_rendered(page)
                assert all(drawn[p] for p in ("header", "loss", "grads", "weights")), drawn
                box = page.evaluate("""() => {
                    const r = document.querySelector('.nbw-root').getBoundingClientRect();
                    const end = document.querySelector('[data-panel=weights]')
                      .getBoundingClientRect();
                    return {x: r.x, y: r.y, width: r.width, height: end.bottom + 1 - r.y};
                }""")
                assert box["y"] >= 0 and box["y"] + box["height"] <= height, box
                step = int(root.get_attribute("data-step") or 0)
                page.screenshot(path=str(png), clip=box)
                evals = len(trace(page, "loss", "val loss")["x"])
                print(f"shot at step {step} ({evals} evals), {box['width']:.0f} × "
                      f"{box['height']:.0f} px; kernel at step {kernel_json(page, 'mon.step')}")
                if errors or blocked:
                    print("page errors:", errors, "blocked:", blocked)
                ctx.close()
                b.close()
        finally:
            srv.shutdown_kernels()
            srv.stop()


def exported() -> None:
    import nbwatch
    from tests.scripts import wide_run

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name, make in (("2layer", demo_run), ("12x12", wide_run.write)):
            run = make(tmp / name)
            html = nbwatch.export_html(run, tmp / f"{name}.html")
            out = ROOT / "docs" / f"dashboard_{name}.png"
            shoot(html, out)
            print(out)


def main(argv: list[str]) -> None:
    what = argv[0] if argv else "exported"
    if what not in ("exported", "live", "all") or len(argv) > 1:
        sys.exit("usage: python docs/screenshots.py [live | all]")
    if what in ("exported", "all"):
        exported()
    if what in ("live", "all"):
        out = ROOT / "docs" / "dashboard.png"
        live(out)
        print(out)


if __name__ == "__main__":
    main(sys.argv[1:])
