"""The README's dashboard screenshots, from runs made here: a 2-layer TinyGPT (the demo) and a
12-layer, 12-head GPT-2 under a real Trainer with one layer's gradient spiked at step 30
(tests/scripts/wide_run.py). Each run is exported to HTML and shot in headless Chromium.

    python docs/screenshots.py     # writes docs/dashboard_2layer.png, docs/dashboard_12x12.png
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


def main() -> None:
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


if __name__ == "__main__":
    main()
