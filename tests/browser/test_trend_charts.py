"""The trend charts read as TensorBoard's and W&B's do: the global gradient norm on a log y
axis where it spans decades, y refitted to the steps in view when x is zoomed, every line
derived from the train loss smoothed as the slider says, and a feed that routine best
checkpoints do not flood."""

from __future__ import annotations

import numpy as np
import pytest

from nbwatch.records import Scalars
from nbwatch.store import RunStore

from .conftest import exported_page
from .harness import dashboard_notebook, double_click, open_notebook, run_all
from .test_loss_reading import NORM, drag_zoom, tb_ema, x_range

pytestmark = pytest.mark.browser

NORM_BOX = "[data-panel=grads]"


def _norms(store: RunStore, first: int, last: int, spike_at: int | None = None) -> None:
    for s in range(first, last + 1):
        g = 1e3 if s == spike_at else 1.0 + 0.1 * np.cos(s)
        store.put(Scalars(s, {"loss/train": 3.0 * np.exp(-s / 200) + 0.05 * np.sin(s),
                              "lr": 1e-3, "grad_norm/global": g,
                              "grad_norm/blocks.0.attn": 0.5}, wall=1000.0 + s))
    store.flush()


def _finished(run_dir, steps: int, spike_at: int | None):
    store = RunStore(run_dir)
    store.set_meta("max_steps", steps)
    _norms(store, 1, steps, spike_at)
    store.set_meta("state", "finished")
    store.set_meta("step", steps)
    store.close()
    return run_dir


def y_type(page, gd: str = NORM) -> str:
    return page.evaluate(f"() => {gd}._fullLayout.yaxis.type")


def test_the_global_norm_is_on_a_log_axis_where_it_spans_decades_and_a_click_switches_it(
        browser, tmp_path):
    run = _finished(tmp_path / "spiky", 300, spike_at=150)
    with exported_page(browser, run, tmp_path / "spiky.html") as (page, errors):
        box = page.locator(NORM_BOX)
        # norms of ~1 and one of 1e3: log by itself, the toggle says so
        assert y_type(page) == "log"
        assert box.get_attribute("data-norm-scale") == "log (auto)"
        assert page.locator(".nbw-grads-logy").is_checked()
        box.scroll_into_view_if_needed()
        drag_zoom(page, 20, 100, NORM)
        zoomed = x_range(page, NORM)
        assert zoomed == pytest.approx([20, 100], abs=2)
        page.locator(".nbw-grads-logy").click()
        page.wait_for_function(f"() => {NORM}._fullLayout.yaxis.type === 'linear'")
        assert box.get_attribute("data-norm-scale") == "linear"
        assert x_range(page, NORM) == zoomed  # another scale keeps the zoom on x
        page.locator(".nbw-grads-logy").click()
        page.wait_for_function(f"() => {NORM}._fullLayout.yaxis.type === 'log'")
        assert x_range(page, NORM) == zoomed
        assert not errors, errors
    run = _finished(tmp_path / "calm", 300, spike_at=None)
    with exported_page(browser, run, tmp_path / "calm.html") as (page, errors):
        assert y_type(page) == "linear"  # within two decades: linear, as plotted before
        assert page.locator(NORM_BOX).get_attribute("data-norm-scale") == "linear (auto)"
        assert not page.locator(".nbw-grads-logy").is_checked()
        assert not errors, errors


def _has_step(gd: str, step: int) -> str:
    return f"() => {gd}?.data?.[0]?.x?.includes({step})"


def test_live_the_norm_turns_log_at_a_spike_and_a_click_holds_through_the_refreshes(
        page, lab, workdir):
    run_dir = workdir / "runs" / "norm_live"
    store = RunStore(run_dir)
    try:
        store.set_meta("state", "running")
        _norms(store, 1, 100)
        dashboard_notebook(workdir, "norm_live")
        open_notebook(page, f"{lab.url}/lab/tree/norm_live.ipynb?reset")
        run_all(page)
        page.wait_for_function(_has_step(NORM, 100), timeout=30_000)
        assert y_type(page) == "linear"
        _norms(store, 101, 140, spike_at=120)  # a spike: the chart turns log by itself
        page.wait_for_function(f"() => {NORM}._fullLayout.yaxis.type === 'log'", timeout=30_000)
        page.locator(NORM_BOX).scroll_into_view_if_needed()
        drag_zoom(page, 90, 130, NORM)
        zoomed = x_range(page, NORM)
        page.locator(".nbw-grads-logy").click()  # the user's choice: linear
        page.wait_for_function(f"() => {NORM}._fullLayout.yaxis.type === 'linear'")
        for last in (180, 220):  # the run goes on: the choice and the zoom stay
            _norms(store, last - 39, last, spike_at=last - 10)
            page.wait_for_function(_has_step(NORM, last), timeout=30_000)
            assert y_type(page) == "linear"
            assert x_range(page, NORM) == zoomed
    finally:
        store.set_meta("state", "finished")
        store.close()
        lab.shutdown_kernels()


LOSS = "document.querySelector('[data-panel=loss] .js-plotly-plot')"

# Each trend chart's y axis against what it shows of its lines (stacked where stacked, from 0
# where drawn from 0) inside its x window: [[panel, [lo, hi] shown, [lo, hi] of the points]].
FITS = """() => [...document.querySelectorAll('.nbw-grid .js-plotly-plot')]
  .filter((gd) => gd._fullLayout && gd._fullLayout.xaxis.title.text === 'step'
          && !gd.data.some((t) => t.type === 'heatmap'))
  .map((gd) => {
    const fl = gd._fullLayout, ya = fl.yaxis, [a, b] = fl.xaxis.range;
    const log = ya.type === 'log', f = (v) => (log ? Math.log10(v) : v);
    let lo = Infinity, hi = -Infinity;
    const stack = [];
    for (const t of gd.data) {
      if ((t.type && t.type !== 'scatter') || t.meta === 'nbw:nofit') continue;
      if (t.yaxis && t.yaxis !== 'y') continue;
      t.x.forEach((x, i) => {
        const y = t.y[i];
        if (x === null || y === null || x < a || x > b) return;
        if (t.stackgroup) { stack[i] = (stack[i] || 0) + y; return; }
        if (Number.isFinite(f(y))) { lo = Math.min(lo, f(y)); hi = Math.max(hi, f(y)); }
      });
    }
    for (const v of stack) {
      if (v !== undefined) { lo = Math.min(lo, v, 0); hi = Math.max(hi, v, 0); }
    }
    if (ya.rangemode === 'tozero') { lo = Math.min(lo, 0); hi = Math.max(hi, 0); }
    return [gd.closest('[data-panel]').dataset.panel, ya.range.slice(), [lo, hi]];
  })"""


def assert_fitted(fits) -> None:
    assert fits
    for panel, (lo, hi), (a, b) in fits:
        if a > b:
            continue  # nothing of it in view (a val metric of every 50 steps): as it was
        assert lo <= a and hi >= b, (panel, [lo, hi], [a, b])  # every point in view shows
        assert hi - lo <= 1.3 * (b - a) + 1e-6 * abs(b), (panel, [lo, hi], [a, b])  # and fills it


def _decay(run_dir, steps: int):
    store = RunStore(run_dir)
    store.set_meta("max_steps", steps)
    for s in range(1, steps + 1):
        v = {"loss/train": 3.0 * np.exp(-s / 60) + 0.05 + 0.01 * np.sin(s),
             "lr": 1e-3 * (1 - s / (steps + 1)), "grad_norm/global": 5.0 * np.exp(-s / 100) + 0.5}
        if s % 20 == 0:
            v["loss/val"] = 3.0 * np.exp(-s / 60) + 0.08
        store.put(Scalars(s, v, wall=1000.0 + s))
    store.set_meta("state", "finished")
    store.set_meta("step", steps)
    store.close()
    return run_dir


def _in_view(page, gd: str, names: list[str], axis: str = "y") -> tuple[float, float]:
    """The smallest and largest y of the named traces inside the x range shown."""
    return tuple(page.evaluate(f"""(names) => {{
        const gd = {gd}, [a, b] = gd._fullLayout.xaxis.range;
        const ys = gd.data.filter((t) => names.includes(t.name) && (t.yaxis || 'y') === '{axis}')
          .flatMap((t) => t.x.map((x, i) => (x >= a && x <= b ? t.y[i] : null)))
          .filter((v) => v !== null);
        return [Math.min(...ys), Math.max(...ys)];
    }}""", names))


def test_a_zoom_on_x_fits_y_to_the_steps_in_view_and_a_double_click_gives_the_run_back(
        browser, tmp_path):
    run = _decay(tmp_path / "run", 400)
    lines = ["train loss", "train (smoothed)", "val loss", "train at eval", "val − train gap"]
    with exported_page(browser, run, tmp_path / "run.html") as (page, errors):
        whole = page.evaluate(f"() => {LOSS}._fullLayout.yaxis.range.slice()")
        assert whole[1] > 2.5  # the run's first steps: a loss of 3
        drag_zoom(page, 300, 380)
        assert x_range(page) == pytest.approx([300, 380], abs=2)
        page.wait_for_function(f"() => {LOSS}._fullLayout.yaxis.range[1] < 1")
        lo, hi = _in_view(page, LOSS, lines)
        pad = (hi - lo) * 0.05
        # TensorBoard's: the loss late in the run fills the chart, not a flat line at its foot
        assert page.evaluate(f"() => {LOSS}._fullLayout.yaxis.range") == pytest.approx(
            [lo - pad, hi + pad], rel=1e-6)
        lr_lo, lr_hi = _in_view(page, LOSS, ["LR"], "y2")  # the LR axis too
        got = page.evaluate(f"() => {LOSS}._fullLayout.yaxis2.range")
        pad = (lr_hi - lr_lo) * 0.05
        assert got == pytest.approx([lr_lo - pad, lr_hi + pad])
        # a redraw (log y) keeps the zoom on x and fits y again, in log units
        page.click(".nbw-logy")
        page.wait_for_function(f"() => {LOSS}._fullLayout.yaxis.type === 'log'")
        assert x_range(page) == pytest.approx([300, 380], abs=2)
        got = page.evaluate(f"() => {LOSS}._fullLayout.yaxis.range")
        span = np.log10(hi) - np.log10(lo)
        assert got == pytest.approx([np.log10(lo) - span * 0.05, np.log10(hi) + span * 0.05],
                                    rel=1e-6)
        # every trend chart, the global norm included
        assert_fitted(page.evaluate(FITS))
        # a double click: the whole run, x and y
        x, y = page.evaluate(f"""() => {{ const gd = {LOSS}, r = gd.getBoundingClientRect(),
            fl = gd._fullLayout; return [r.left + fl.xaxis._offset + fl.xaxis._length / 2,
            r.top + fl.yaxis._offset + fl.yaxis._length / 2]; }}""")
        double_click(page, x, y, f"() => {LOSS}._fullLayout.xaxis.range[1] >= 399")
        page.wait_for_function(f"() => {LOSS}._fullLayout.yaxis.range[1] > Math.log10(2.5)")
        page.click(".nbw-logy")
        page.wait_for_function(f"() => {LOSS}._fullLayout.yaxis.type === 'linear'")
        assert page.evaluate(f"() => {LOSS}._fullLayout.yaxis.range") == pytest.approx(whole)
        # a box drawn on both axes is the user's own y: kept, not refitted
        box = page.evaluate(f"""() => {{ const gd = {LOSS}, r = gd.getBoundingClientRect(),
            fl = gd._fullLayout, xa = fl.xaxis, ya = fl.yaxis;
            return [r.left + xa._offset + xa.l2p(100), r.top + ya._offset + ya.l2p(2.0),
                    r.left + xa._offset + xa.l2p(200), r.top + ya._offset + ya.l2p(1.0)]; }}""")
        page.mouse.move(box[0], box[1])
        page.mouse.down()
        page.mouse.move(box[2], box[3], steps=6)
        page.mouse.up()
        page.wait_for_function(f"() => {LOSS}._fullLayout.xaxis.range[1] < 250")
        page.locator(".nbw-smooth").fill("0.5")  # a redraw
        page.wait_for_function(f"() => {LOSS}.data.find((t) => t.name === 'train (smoothed)')"
                               ".hovertemplate.includes('(0.50)')")
        assert page.evaluate(f"() => {LOSS}._fullLayout.yaxis.range") == pytest.approx(
            [1.0, 2.0], abs=0.02)
        assert not errors, errors


def test_a_click_on_an_alert_fits_y_to_its_window_in_every_trend_chart(browser, tmp_path):
    from tests.export_run import write_run

    run = write_run(tmp_path / "run", steps=400)  # an alert at step 10
    with exported_page(browser, run, tmp_path / "run.html") as (page, errors):
        alert = page.locator("[data-panel=alerts] .nbw-item[data-kind=alert]")
        alert.scroll_into_view_if_needed()
        alert.click()
        page.wait_for_function("() => document.querySelector('.nbw-root').dataset.focus === '10'")
        page.wait_for_timeout(300)  # the views that fit their own range redraw at a frame
        fits = page.evaluate(FITS)
        assert {p for p, _, _ in fits} >= {"loss", "grads", "weights", "data", "metrics"}
        assert_fitted(fits)
        alert.click()  # the whole run back, y too
        page.wait_for_function("() => !('focus' in document.querySelector('.nbw-root').dataset)")
        page.wait_for_timeout(300)
        assert page.evaluate(f"() => {LOSS}._fullLayout.yaxis.range[1]") > 4
        assert not errors, errors


def test_live_y_stays_fitted_to_a_zoom_through_the_refreshes(page, lab, workdir):
    run_dir = workdir / "runs" / "fit_live"
    store = RunStore(run_dir)
    try:
        store.set_meta("state", "running")
        _norms(store, 1, 100)
        dashboard_notebook(workdir, "fit_live")
        open_notebook(page, f"{lab.url}/lab/tree/fit_live.ipynb?reset")
        run_all(page)
        page.wait_for_function(f"() => {LOSS}?.data?.find((t) => t.name === 'train loss')"
                               "?.x.length === 100", timeout=30_000)
        whole = page.evaluate(f"() => {LOSS}._fullLayout.yaxis.range.slice()")
        drag_zoom(page, 70, 95)
        page.wait_for_function(f"() => {LOSS}._fullLayout.yaxis.range[1] < {whole[1]} - 0.5")
        fitted = page.evaluate(f"() => {LOSS}._fullLayout.yaxis.range.slice()")
        for last in (140, 180):  # the run goes on, redrawing the chart: the fit stays
            _norms(store, last - 39, last)
            page.wait_for_function(f"() => {LOSS}.data.find((t) => t.name === 'train loss')"
                                   f".x.includes({last})", timeout=30_000)
            assert page.evaluate(f"() => {LOSS}._fullLayout.yaxis.range") == pytest.approx(fitted)
        # a double click: the whole run, y too, and it follows the run again
        x, y = page.evaluate(f"""() => {{ const gd = {LOSS}, r = gd.getBoundingClientRect(),
            fl = gd._fullLayout; return [r.left + fl.xaxis._offset + fl.xaxis._length / 2,
            r.top + fl.yaxis._offset + fl.yaxis._length / 2]; }}""")
        double_click(page, x, y, f"() => {LOSS}._fullLayout.yaxis.range[1] >= {whole[1]} - 0.1")
        _norms(store, 181, 220)
        page.wait_for_function(f"() => {LOSS}._fullLayout.xaxis.range[1] >= 219", timeout=30_000)
    finally:
        store.set_meta("state", "finished")
        store.close()
        lab.shutdown_kernels()


def _noisy(run_dir, steps: int, seed: int, baselines=()):
    """A finished run whose train loss is noisy (smoothing shows), with val and the gap the
    recorder writes (val − the 0.9 EMA of the train loss) every 20 steps."""
    rng = np.random.default_rng(seed)
    raw = (2.0 * np.exp(-np.arange(1, steps + 1) / 100) + 0.3 * rng.random(steps)).astype(
        np.float32)
    kernel = tb_ema([float(v) for v in raw], 0.9)
    store = RunStore(run_dir)
    store.set_meta("max_steps", steps)
    store.set_meta("baselines", [str(b) for b in baselines])
    for s in range(1, steps + 1):
        v = {"loss/train": float(raw[s - 1]), "lr": 1e-3}
        if s % 20 == 0:
            v["loss/val"] = float(kernel[s - 1]) + 0.2
            v["loss/gap"] = 0.2
        store.put(Scalars(s, v, wall=1000.0 + s))
    store.set_meta("state", "finished")
    store.set_meta("step", steps)
    store.close()
    return raw


def test_the_smoothing_slider_smooths_the_gap_and_the_baselines_as_the_train_loss(
        browser, tmp_path):
    from .harness import trace
    from .test_loss_reading import smoothed

    base_raw = _noisy(tmp_path / "runs" / "base", 300, seed=1)
    _noisy(tmp_path / "runs" / "exp", 300, seed=2, baselines=[tmp_path / "runs" / "base"])
    with exported_page(browser, tmp_path / "runs" / "exp", tmp_path / "exp.html") as (page,
                                                                                     errors):
        raw = trace(page, "loss", "train loss")["y"]
        val = dict(zip(*trace(page, "loss", "val loss").values()))
        for w in (0.9, 0.6, 0.0, 0.97):
            if w != 0.9:
                page.locator(".nbw-smooth").fill(str(w))
                page.wait_for_function(f"(w) => {LOSS}.data.find((t) => t.name === "
                                       "'train (smoothed)').hovertemplate.includes(`(${w})`)",
                                       arg=f"{w:.2f}")
            ours = tb_ema(raw, w)
            assert smoothed(page) == pytest.approx(ours, rel=1e-5)
            # the gap's lower edge: this train loss smoothed the same, at each eval's step
            at_eval = trace(page, "loss", "train at eval")
            assert at_eval["x"] == list(range(20, 301, 20))
            assert at_eval["y"] == pytest.approx([ours[s - 1] for s in at_eval["x"]], rel=1e-5)
            said = page.evaluate(f"() => {LOSS}.data.find((t) => t.name === 'val − train gap')"
                                 ".customdata.map((c) => c[0])")
            assert said == pytest.approx([val[s] - ours[s - 1] for s in at_eval["x"]],
                                         rel=1e-4, abs=1e-6)
            # the baseline's faded train loss: its own raw loss, smoothed the same
            base = trace(page, "loss", "baseline base")
            assert base["x"] == list(range(1, 301))
            assert base["y"] == pytest.approx(tb_ema([float(v) for v in base_raw], w), rel=1e-5)
        assert not errors, errors


ITEMS = ("[...document.querySelectorAll('[data-panel=alerts] .nbw-item')]"
         ".map((li) => [li.dataset.kind, li.querySelector('.nbw-item-msg').textContent])")
FEED = f"() => {ITEMS}"


def _best(store: RunStore, step: int) -> None:
    from nbwatch.records import Event

    store.put(Event(step, "checkpoint", "info",
                    f"periodic (Trainer) checkpoint at step {step}: checkpoint-{step}, "
                    "1.0 MiB (best)", {"reason": "periodic (Trainer)", "best": True,
                                       "path": f"/o/checkpoint-{step}"}))


def test_live_routine_best_checkpoints_are_one_feed_line_across_the_refreshes(
        page, lab, workdir):
    from nbwatch.records import Event

    run_dir = workdir / "runs" / "best_live"
    store = RunStore(run_dir)
    try:
        store.set_meta("state", "running")
        _best(store, 10)
        _best(store, 20)
        _norms(store, 1, 50)
        dashboard_notebook(workdir, "best_live")
        open_notebook(page, f"{lab.url}/lab/tree/best_live.ipynb?reset")
        run_all(page)
        page.wait_for_function(f"() => {ITEMS}.length === 1", timeout=30_000)
        assert page.evaluate(FEED) == [["checkpoint", "best checkpoint ×2, last at step 20"]]
        _best(store, 60)  # a later refresh: folded into the line above, not a new one
        _norms(store, 51, 60)
        page.wait_for_function(f"() => {ITEMS}[0][1].endsWith('step 60')", timeout=30_000)
        assert page.evaluate(FEED) == [["checkpoint", "best checkpoint ×3, last at step 60"]]
        # an alert between them is its own item; the saves after it start a line of their own
        store.put(Event(70, "alert", "warning", "loss spike at step 70", {}))
        _best(store, 80)
        _norms(store, 61, 80)
        page.wait_for_function(f"() => {ITEMS}.length === 3", timeout=30_000)
        _best(store, 90)
        store.put(Event(95, "checkpoint", "info", "manual checkpoint at step 95: step_95.pt",
                        {"reason": "manual", "best": True}))  # asked for: its own item
        _norms(store, 81, 95)
        page.wait_for_function(f"() => {ITEMS}.length === 4", timeout=30_000)
        assert page.evaluate(FEED) == [
            ["checkpoint", "manual checkpoint at step 95: step_95.pt"],
            ["checkpoint", "best checkpoint ×2, last at step 90"],
            ["alert", "loss spike at step 70"],
            ["checkpoint", "best checkpoint ×3, last at step 60"]]
        # a click on the line shows its last save's step
        page.locator("[data-panel=alerts] .nbw-item[data-count='3']").click()
        page.wait_for_function("() => document.querySelector('.nbw-root').dataset.focus === '60'")
    finally:
        store.set_meta("state", "finished")
        store.close()
        lab.shutdown_kernels()
