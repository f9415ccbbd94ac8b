"""The system panel of an exported run, in headless Chromium: a real run with one 3 s step
draws every system sample taken during that step at its own time, not one per step."""

from __future__ import annotations

import time

import numpy as np
import pytest

import nbwatch
from tests.conftest import tiny_step

from .conftest import ARTIFACTS

pytestmark = pytest.mark.browser


def test_export_draws_system_samples_against_time(browser, tiny, tmp_path):
    model, opt, batches = tiny
    span: dict[str, float] = {}

    def step_fn(m, batch):
        if mon.step == 2:
            span["start"] = time.time()
            time.sleep(3.0)
            span["end"] = time.time()
        return tiny_step(m, batch)

    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "run", system_interval=0.2)
    mon.start(step_fn, batches, max_steps=5, display=False)
    mon.wait()
    samples = nbwatch.open_run(tmp_path / "run").system()
    walls = samples.index.to_numpy()
    t0 = walls[0]
    path = nbwatch.export_html(tmp_path / "run", tmp_path / "run.html")

    ctx = browser.new_context(viewport={"width": 1400, "height": 1800})
    page = ctx.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    try:
        page.goto(path.as_uri())
        page.wait_for_selector(".nbw-root[data-ready]", timeout=30_000)
        page.wait_for_selector("[data-panel=system] .nbw-system-util .main-svg",
                               timeout=30_000)
        drawn = page.evaluate("""() => {
            const read = (cls) => {
              const gd = document.querySelector(`[data-panel=system] .${cls}`);
              return {axis: gd.layout.xaxis.title.text, traces: Object.fromEntries(
                gd.data.map((t) => [t.name, {x: Array.from(t.x), y: Array.from(t.y)}]))};
            };
            return {util: read('nbw-system-util'), mem: read('nbw-system-mem'),
                    gauges: document.querySelectorAll('[data-panel=system] .nbw-gauge').length};
        }""")
        assert drawn["gauges"] >= 2
        assert drawn["util"]["axis"] == "time since the first sample (s)"
        cpu, step = drawn["util"]["traces"]["CPU"], drawn["util"]["traces"]["step"]
        ram = drawn["mem"]["traces"]["RAM used"]
        # every sample, at its own time (to the panel's 0.01 s tick), none merged by step
        want = np.round((walls - t0) / 0.01) * 0.01
        for tr in (cpu, step, ram):
            np.testing.assert_allclose(tr["x"], want, atol=1e-4)
        np.testing.assert_allclose(cpu["y"], samples["system/cpu/util"], rtol=1e-5)
        np.testing.assert_allclose(ram["y"], samples["system/ram/used_gb"], rtol=1e-5)
        inside = (walls >= span["start"]) & (walls <= span["end"])  # the points, one each
        assert inside.sum() >= 10, f"{inside.sum()} points drawn during the 3 s step"
        assert set(np.asarray(step["y"])[inside]) == {2}  # all while the run stood at step 2
        assert not errors, errors
    finally:
        ARTIFACTS.mkdir(exist_ok=True)
        page.locator("[data-panel=system]").screenshot(path=str(ARTIFACTS / "system.png"))
        ctx.close()
