"""A click on a loss spike's marker shows its post-mortem, in the HTML export: a seeded
unstable run (the LR ramped ×1.05 a step with no warm-up, tests/test_postmortem.py), whose
post-mortem names what moved first, and how long before the spike. Live in JupyterLab: a
run folder written here, its spike's post-mortem arriving with a later refresh."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nbwatch.alerts.postmortem import timeline
from nbwatch.demo import make_demo
from nbwatch.export import export_html
from nbwatch.records import Event
from nbwatch.store import RunStore
from tests.panels.test_postmortems import ROSE, SPIKE, _steps
from tests.test_postmortem import train

from .conftest import ARTIFACTS
from .harness import dashboard_notebook, open_notebook, run_all

pytestmark = pytest.mark.browser


def click_marker(page, step: int) -> None:
    """Click the loss chart's event marker at `step`, where the page draws it."""
    x, y = page.evaluate(
        """(step) => {
            const gd = document.querySelector('[data-panel=loss] .js-plotly-plot');
            const t = gd.data.find((d) => d.name === 'events');
            const i = Array.from(t.customdata).indexOf(step);
            const fl = gd._fullLayout, r = gd.getBoundingClientRect();
            return [r.left + fl.xaxis._offset + fl.xaxis.l2p(fl.xaxis.d2l(t.x[i])),
                    r.top + fl.yaxis._offset + fl.yaxis.l2p(fl.yaxis.d2l(t.y[i]))];
        }""", step)
    page.mouse.move(x, y)
    page.mouse.click(x, y)


def test_a_click_on_a_spike_marker_shows_its_post_mortem(browser, tmp_path):
    demo = make_demo(d=64, layers=2, heads=2, ctx=64, lr=3e-3, warmup=1, max_steps=200)
    sched = torch.optim.lr_scheduler.LambdaLR(demo.optimizer, lambda s: 1.05 ** s)
    _, run = train(tmp_path, demo, sched, demo.train, 125)
    spikes = run.spikes
    assert len(spikes)
    row = spikes.iloc[0]
    spike, first, lead = int(row.step), list(row["first"]), int(row.lead)
    assert first and lead >= 1
    path = export_html(tmp_path / "r", tmp_path / "unstable.html")
    ctx = browser.new_context(viewport={"width": 1400, "height": 1400})
    page = ctx.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(path.as_uri())
        page.wait_for_selector(".nbw-root[data-ready]", timeout=30_000)
        box = page.locator("[data-panel=loss] .nbw-postmortem")
        assert box.is_hidden()
        click_marker(page, spike)
        page.wait_for_function(
            "(s) => document.querySelector('[data-panel=loss]').dataset.postmortem === String(s)",
            arg=spike, timeout=10_000)
        assert box.is_visible()
        text = box.locator(".nbw-postmortem-text").inner_text()
        more = f" and {len(first) - 3} more" if len(first) > 3 else ""
        assert text.startswith(f"loss spike at step {spike}: {', '.join(first[:3])}{more} "
                               f"moved first, {lead} steps before"), text
        assert text == timeline(row.to_dict())  # diagnose()'s lines, as the kernel made them
        assert f"step {spike}: LOSS SPIKE" in text
        ARTIFACTS.mkdir(exist_ok=True)
        page.locator("[data-panel=loss]").screenshot(path=str(ARTIFACTS / "postmortem_open.png"))
        box.locator(".nbw-postmortem-close").click()
        assert box.is_hidden()
        assert not errors, errors
    finally:
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "export_postmortem.png"), full_page=True)
        ctx.close()


def test_live_in_jupyterlab_the_marker_shows_the_post_mortem_the_kernel_sent(page, lab, workdir):
    run_dir = workdir / "runs" / "spike_live"
    store = RunStore(run_dir)
    rng = np.random.default_rng(0)
    try:
        store.set_meta("state", "running")
        _steps(store, 1, SPIKE - 1, rng)  # the alert is read before its step's scalars
        store.put(Event(SPIKE, "alert", "warning", "loss spike", {
            "rule": "loss_spike", "loss": 5.0, "median": 2.0, "z": 30.0, "batches": []}))
        store.flush()
        dashboard_notebook(workdir, "spike_live")
        open_notebook(page, f"{lab.url}/lab/tree/spike_live.ipynb?reset")
        run_all(page)
        page.wait_for_function(
            "() => document.querySelector('[data-panel=loss] .js-plotly-plot')?.data?.some("
            "(t) => t.name === 'events' && t.x.length)", timeout=30_000)
        click_marker(page, SPIKE)
        page.wait_for_function(
            "(s) => document.querySelector('[data-panel=loss]').dataset.postmortem === String(s)",
            arg=SPIKE, timeout=10_000)
        said = page.locator("[data-panel=loss] .nbw-postmortem-text")
        assert said.inner_text().startswith("post-mortem on its way")
        _steps(store, SPIKE, SPIKE + 5, rng)  # the kernel makes it, the open box shows it
        page.wait_for_function(
            "() => document.querySelector('[data-panel=loss] .nbw-postmortem-text')"
            ".textContent.startsWith('loss spike at step')", timeout=15_000)
        text = said.inner_text()
        assert text.startswith(f"loss spike at step {SPIKE}: grad_norm/blocks.1.mlp moved "
                               f"first, {SPIKE - ROSE} steps before"), text
    finally:
        store.set_meta("state", "finished")
        store.close()
        lab.shutdown_kernels()
