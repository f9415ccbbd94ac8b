"""Samples beyond text in a real browser: an eval's image and table samples drawn in the
samples panel of the HTML export (the same view the live dashboard uses)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

import nbwatch
from nbwatch.demo import make_demo

pytestmark = pytest.mark.browser


def test_an_image_and_a_table_sample_show_in_the_samples_panel(browser, tmp_path):
    demo = make_demo(d=32, layers=1, heads=2, ctx=32, max_steps=4)
    mon = nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler, run_dir=tmp_path / "r")
    def sample_fn(model):  # an image at the first eval, a table of predictions at the next
        if mon.step <= 2:
            return np.tile(np.arange(0, 256, 8, dtype=np.uint8), (24, 1))  # 32 × 24 ramp
        return pd.DataFrame({"prompt": ["def f(", "<b>x</b>"], "p": [0.25, 0.75]})

    mon.start(demo.step_fn, demo.train, 4, eval_every=2, sample_fn=sample_fn,
              display=False).wait()
    path = nbwatch.export_html(tmp_path / "r", tmp_path / "r.html")
    page = browser.new_page(viewport={"width": 1400, "height": 1600})
    try:
        page.goto(path.as_uri())
        page.wait_for_selector("[data-panel=samples] .nbw-sample-image", timeout=30_000)
        page.wait_for_function(
            "() => document.querySelector('[data-panel=samples] .nbw-sample-image').complete")
        size = page.evaluate("() => { const i = document.querySelector("
                             "'[data-panel=samples] .nbw-sample-image');"
                             " return [i.naturalWidth, i.naturalHeight]; }")
        assert size == [32, 24]  # the PNG decoded, pixel for pixel
        cells = page.locator("[data-panel=samples] .nbw-sample-table td").all_inner_texts()
        assert cells == ["def f(", "0.25", "<b>x</b>", "0.75"]  # a cell's HTML stays text
        assert page.locator("[data-panel=samples] .nbw-sample-table b").count() == 0
    finally:
        page.close()
