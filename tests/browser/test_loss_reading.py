"""Reading the loss chart as one reads TensorBoard's: a smoothing slider (the smoothed line an
EMA of the raw one at the chosen weight, the raw kept faint behind, the choice kept), one
hover that reads every line at a step, and a zoom that outlives the redraws of a live run."""

from __future__ import annotations

import numpy as np
import pytest

from nbwatch.records import Scalars
from nbwatch.store import RunStore
from tests.export_run import write_run

from .conftest import exported_page
from .harness import dashboard_notebook, double_click, open_notebook, run_all, trace

pytestmark = pytest.mark.browser

LOSS = "document.querySelector('[data-panel=loss] .js-plotly-plot')"
NORM = "document.querySelector('[data-panel=grads] .nbw-grads-norm')"


def tb_ema(ys: list[float], weight: float) -> np.ndarray:
    """TensorBoard's smoothing, written out: a debiased EMA, one point a step."""
    out, last = [], 0.0
    for n, y in enumerate(ys, 1):
        last = last * weight + (1 - weight) * y
        out.append(last / (1 - weight ** n))
    return np.array(out)


def smoothed(page) -> np.ndarray:
    return np.array(trace(page, "loss", "train (smoothed)")["y"], dtype=float)


def test_the_smoothing_slider_draws_the_ema_of_the_raw_loss_and_is_kept(browser, tmp_path):
    run = write_run(tmp_path / "run", steps=300)
    with exported_page(browser, run, tmp_path / "run.html") as (page, errors):
        box = page.locator("[data-panel=loss]")
        raw = trace(page, "loss", "train loss")
        assert raw["x"] == list(range(1, 301))  # every step: the EMA below is exact
        ys = raw["y"]
        # the kernel's EMA (0.9, float32) by default
        assert box.get_attribute("data-smoothing") == "0.90"
        assert smoothed(page) == pytest.approx(tb_ema(ys, 0.9), rel=1e-5)
        for w in (0.6, 0.97, 0.0):
            page.locator(".nbw-smooth").fill(str(w))
            page.wait_for_function("(w) => document.querySelector('[data-panel=loss]')"
                                   ".dataset.smoothing === w", arg=f"{w:.2f}")
            page.wait_for_function(f"(w) => {LOSS}.data.find((t) => t.name === "
                                   "'train (smoothed)').hovertemplate.includes(`(${w})`)",
                                   arg=f"{w:.2f}")
            assert smoothed(page) == pytest.approx(tb_ema(ys, w), rel=1e-9)
            # the raw line stays behind it, faint, untouched
            assert trace(page, "loss", "train loss")["y"] == ys
        assert page.evaluate(f"() => {LOSS}.data.find((t) => t.name === 'train loss').opacity") < 1
        page.locator(".nbw-smooth").fill("0.8")
        page.reload()
        page.wait_for_selector(".nbw-root[data-ready]", timeout=30_000)
        assert box.get_attribute("data-smoothing") == "0.80"  # the browser kept the choice
        assert smoothed(page) == pytest.approx(tb_ema(ys, 0.8), rel=1e-9)
        assert not errors, errors


def x_pixel(page, step: float, gd: str = LOSS) -> tuple[float, float]:
    return tuple(page.evaluate(f"""(s) => {{
        const gd = {gd}, fl = gd._fullLayout, r = gd.getBoundingClientRect();
        return [r.left + fl.xaxis._offset + fl.xaxis.l2p(s),
                r.top + fl.yaxis._offset + fl.yaxis._length / 2];
    }}""", step))


def x_range(page, gd: str = LOSS) -> list[float]:
    return page.evaluate(f"() => {gd}._fullLayout.xaxis.range.slice()")


def drag_zoom(page, lo: float, hi: float, gd: str = LOSS) -> None:
    (x0, y), (x1, _) = x_pixel(page, lo, gd), x_pixel(page, hi, gd)
    page.mouse.move(x0, y)
    page.mouse.down()
    page.mouse.move(x1, y + 5, steps=6)
    page.mouse.up()


def test_one_hover_reads_every_line_at_a_step_and_a_zoom_outlives_a_redraw(browser, tmp_path):
    run = write_run(tmp_path / "run", steps=200, hist_every=50)
    with exported_page(browser, run, tmp_path / "run.html") as (page, errors):
        raw = dict(zip(*trace(page, "loss", "train loss").values()))
        sm = dict(zip(*trace(page, "loss", "train (smoothed)").values()))
        lr = dict(zip(*trace(page, "loss", "LR").values()))
        x, y = x_pixel(page, 100)
        page.mouse.move(x, y)
        page.wait_for_selector("[data-panel=loss] .hoverlayer .legend")
        said = page.evaluate("() => [...document.querySelectorAll("
                             "'[data-panel=loss] .hoverlayer text')].map((t) => t.textContent)")
        # the step as the title, then each line's value there (val is recorded at step 100)
        assert said[0] == "step 100", said
        assert f"train {raw[100]:.4f}" in said
        assert f"smoothed (0.90) {sm[100]:.4f}" in said
        val = dict(zip(*trace(page, "loss", "val loss").values()))
        assert f"val {val[100]:.4f} (step 100)" in said
        x, y = x_pixel(page, 103)  # the eval nearest the pointer: its own step said
        page.mouse.move(x, y)
        page.wait_for_function("() => [...document.querySelectorAll('[data-panel=loss] "
                               ".hoverlayer text')].some((t) => t.textContent === 'step 103')")
        said103 = page.evaluate("() => [...document.querySelectorAll("
                                "'[data-panel=loss] .hoverlayer text')].map((t) => t.textContent)")
        assert f"val {val[100]:.4f} (step 100)" in said103
        assert f"LR {lr[100]:.3e}".replace("e-0", "e-") in said
        # a zoom on x outlives the redraws a log y and another smoothing ask for
        page.mouse.move(0, 0)
        drag_zoom(page, 60, 120)
        zoomed = x_range(page)
        assert zoomed == pytest.approx([60, 120], abs=2)
        page.click(".nbw-logy")
        page.locator(".nbw-smooth").fill("0.5")
        page.wait_for_function("() => document.querySelector('[data-panel=loss]')"
                               ".dataset.smoothing === '0.50'")
        page.wait_for_function(f"() => {LOSS}._fullLayout.yaxis.type === 'log'")
        assert x_range(page) == zoomed
        assert not errors, errors


def _steps(store: RunStore, first: int, last: int) -> None:
    for s in range(first, last + 1):
        store.put(Scalars(s, {"loss/train": 3.0 * np.exp(-s / 200) + 0.05 * np.sin(s),
                              "lr": 1e-3, "grad_norm/global": 1.0 + 0.1 * np.cos(s),
                              "grad_norm/blocks.0.attn": 0.5}))
    store.flush()


def test_live_a_zoom_survives_the_refreshes_and_a_double_click_follows_the_run_again(
        page, lab, workdir):
    run_dir = workdir / "runs" / "zoom_live"
    store = RunStore(run_dir)
    try:
        store.set_meta("state", "running")
        _steps(store, 1, 100)
        dashboard_notebook(workdir, "zoom_live")
        open_notebook(page, f"{lab.url}/lab/tree/zoom_live.ipynb?reset")
        run_all(page)
        page.wait_for_function(f"() => {LOSS}?.data?.find((t) => t.name === 'train loss')"
                               "?.x.length === 100", timeout=30_000)
        drag_zoom(page, 20, 60)
        zoomed = x_range(page)
        assert zoomed == pytest.approx([20, 60], abs=2)
        page.wait_for_function(f"() => {NORM}?._fullLayout")
        drag_zoom(page, 30, 70, NORM)
        norm_zoom = x_range(page, NORM)
        assert norm_zoom == pytest.approx([30, 70], abs=2)
        # the run goes on: the chart redraws with each refresh, the zoom stays
        _steps(store, 101, 160)
        page.wait_for_function(f"() => {LOSS}.data.find((t) => t.name === 'train loss')"
                               ".x.includes(160)", timeout=30_000)
        _steps(store, 161, 200)
        page.wait_for_function(f"() => {LOSS}.data.find((t) => t.name === 'train loss')"
                               ".x.includes(200)", timeout=30_000)
        assert x_range(page) == zoomed
        page.wait_for_function(f"() => {NORM}.data[0].x.includes(200)", timeout=30_000)
        assert x_range(page, NORM) == norm_zoom  # every plot, not the loss alone
        # a double click: the whole run again, and it follows the new steps
        x, y = x_pixel(page, 40)
        double_click(page, x, y, f"() => {LOSS}._fullLayout.xaxis.range[1] >= 199")
        _steps(store, 201, 240)
        page.wait_for_function(f"() => {LOSS}._fullLayout.xaxis.range[1] >= 239",
                               timeout=30_000)
    finally:
        store.set_meta("state", "finished")
        store.close()
        lab.shutdown_kernels()


def test_a_click_on_an_alert_shows_its_step_in_every_trend_chart(browser, tmp_path):
    run = write_run(tmp_path / "run", steps=400)  # an alert at step 10, an action at 11
    with exported_page(browser, run, tmp_path / "run.html") as (page, errors):
        ranges = """() => [...document.querySelectorAll('.nbw-grid .js-plotly-plot')]
            .filter((gd) => gd._fullLayout && gd._fullLayout.xaxis.title.text === 'step')
            .map((gd) => [gd.closest('[data-panel]').dataset.panel, gd._fullLayout.xaxis.range])"""
        before = page.evaluate(ranges)
        assert {p for p, _ in before} >= {"loss", "grads", "weights", "data", "metrics"}
        alert = page.locator("[data-panel=alerts] .nbw-item[data-kind=alert]")
        alert.scroll_into_view_if_needed()
        alert.click()
        page.wait_for_function("() => document.querySelector('.nbw-root').dataset.focus === '10'")
        # ±5% of the run (20 steps), from 0: step 10 in every chart against steps
        shown = page.evaluate(ranges)
        assert len(shown) == len(before)
        for panel, r in shown:
            assert r == pytest.approx([0, 30]), panel
        assert alert.get_attribute("data-focused") == "yes"
        # the loss brought into view, the bars and histograms (not against steps) untouched
        assert page.locator("[data-panel=loss]").evaluate(
            "(b) => b.getBoundingClientRect().bottom > 0"
            " && b.getBoundingClientRect().top < innerHeight")
        # kept through a redraw, as a zoom of one's own is (a live run redraws all the time)
        page.click(".nbw-logy")
        page.wait_for_function(f"() => {LOSS}._fullLayout.yaxis.type === 'log'")
        assert page.evaluate(ranges)[0] == ["loss", pytest.approx([0, 30])]
        bars = "document.querySelector('[data-panel=grads] .nbw-grads-bars')._fullLayout.xaxis"
        assert page.evaluate(f"() => {bars}.title.text") == "grad norm"
        assert page.evaluate(f"() => {bars}.autorange") is True
        # another item: its step; the same one again: the whole run back
        page.locator("[data-panel=alerts] .nbw-item[data-kind=action]").click()
        page.wait_for_function("() => document.querySelector('.nbw-root').dataset.focus === '11'")
        assert page.evaluate(ranges)[0][1] == pytest.approx([0, 31])
        page.locator("[data-panel=alerts] .nbw-item[data-kind=action]").click()
        page.wait_for_function("() => !('focus' in document.querySelector('.nbw-root').dataset)")
        assert page.evaluate(ranges) == before
        assert not errors, errors
