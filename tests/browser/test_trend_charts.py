"""The trend charts read as TensorBoard's and W&B's do: the global gradient norm on a log y
axis where it spans decades, y refitted to the steps in view when x is zoomed, every line
derived from the train loss smoothed as the slider says, and a feed that routine best
checkpoints do not flood."""

from __future__ import annotations

import nbformat
import numpy as np
import pytest

from nbwatch.records import Scalars
from nbwatch.store import RunStore

from .conftest import exported_page
from .harness import open_notebook, run_all
from .test_loss_reading import NORM, drag_zoom, x_range

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


def _notebook(workdir, name: str) -> None:
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {
        "name": "python3", "display_name": "Python 3", "language": "python"}})
    nb.cells = [nbformat.v4.new_code_cell(
        f"from nbwatch.widget import Dashboard\nDashboard.for_run('runs/{name}')")]
    nbformat.write(nb, workdir / f"{name}.ipynb")


def _has_step(gd: str, step: int) -> str:
    return f"() => {gd}?.data?.[0]?.x?.includes({step})"


def test_live_the_norm_turns_log_at_a_spike_and_a_click_holds_through_the_refreshes(
        page, lab, workdir):
    run_dir = workdir / "runs" / "norm_live"
    store = RunStore(run_dir)
    try:
        store.set_meta("state", "running")
        _norms(store, 1, 100)
        _notebook(workdir, "norm_live")
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
