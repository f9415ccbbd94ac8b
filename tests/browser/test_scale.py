"""The dashboard at the scale of a real Transformer: a 12-layer, 12-head GPT-2 trained by a
real Trainer (tests/scripts/wide_run.py), one layer's gradient ×1000 at one step. Seen in
the HTML export and live in JupyterLab, at a wide and a narrow width."""

from __future__ import annotations

import time

import nbformat
import pytest

from nbwatch.export import export_html
from tests.scripts import wide_run

from .conftest import ARTIFACTS
from .harness import click_head, grad_heat_peak, open_notebook, panels_rendered, run_all

pytestmark = pytest.mark.browser

DRAWN = ("loss", "grads", "weights", "attention", "data", "system", "alerts")


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    return wide_run.write(tmp_path_factory.mktemp("wide") / "run", steps=60)


def check_scale(page) -> None:
    """What a user of a 12 × 12 model sees: every panel drawn, the injected spike at its
    layer and step in the heat map, the attention overview opening the clicked head."""
    # every panel within 20 s: the page's redraw budget draws them in turns, later under load
    deadline = time.monotonic() + 20
    rendered = panels_rendered(page)
    while not all(rendered[p] for p in DRAWN) and time.monotonic() < deadline:
        page.wait_for_timeout(250)
        rendered = panels_rendered(page)
    assert all(rendered[p] for p in DRAWN), rendered
    # the probe pass's health figures: entropy, max logit, block RMS, output logits
    page.wait_for_function("() => document.querySelectorAll("
                           "'[data-panel=health] .main-svg').length >= 4", timeout=10_000)
    lines = page.evaluate("""() => document.querySelector('[data-panel=health] .nbw-health-rms')
        .data.map((t) => t.name)""")
    assert lines == [f"transformer.h.{i}" for i in range(12)]
    peak = grad_heat_peak(page)
    assert peak["layers"] == 2 + 12 * 6 + 1  # wte, wpe, 6 per block, ln_f: depth order
    assert peak["layer"] == wide_run.spike_layer_name()
    assert peak["step"] <= wide_run.SPIKE_STEP < peak["step"] + peak["width"]
    # The overview: one cell per head; the click opens that head's map, drawn square.
    ov = page.evaluate("""() => { const t = document.querySelector(
        '[data-panel=attention] .nbw-attn-overview').data[0];
        return [t.z.length, t.z[0].length]; }""")
    assert ov == [12, 12]
    box = page.locator("[data-panel=attention]")
    assert box.get_attribute("data-open") == "0:0"
    click_head(page, 9, 5)
    page.wait_for_function(
        "() => document.querySelector('[data-panel=attention]').dataset.open === '9:5'",
        timeout=10_000)
    title = page.evaluate("""() => document.querySelector('[data-panel=attention] .nbw-attn-map')
        ._fullLayout.title.text""")
    assert title == "transformer.h.9.attn, head 5"
    w, h = page.evaluate("""() => { const fl = document.querySelector(
        '[data-panel=attention] .nbw-attn-map')._fullLayout;
        return [fl.xaxis._length, fl.yaxis._length]; }""")
    assert abs(w - h) <= 2, (w, h)  # a 32 × 32 map keeps its aspect
    # Only the heads' maps are drawn, not a wall of 144 thumbnails.
    assert page.locator("[data-panel=attention] .js-plotly-plot").count() == 2


def test_export_of_a_12x12_model(browser, wide, tmp_path):
    path = export_html(wide, tmp_path / "wide.html")
    for width in (1400, 700):
        ctx = browser.new_context(viewport={"width": width, "height": 1200})
        page = ctx.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))  # noqa: B023
        try:
            page.goto(path.as_uri())
            page.wait_for_selector(".nbw-root[data-ready]", timeout=30_000)
            check_scale(page)
            # Nothing sticks out sideways at a narrow width; the checkpoints table wraps
            # at words, not mid-word.
            assert page.evaluate("() => document.documentElement.scrollWidth") <= width
            assert not errors, errors
        finally:
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / f"export_12x12_{width}.png"), full_page=True)
            ctx.close()


def test_lab_live_12x12_trainer(page, lab, workdir):
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {
        "name": "python3", "display_name": "Python 3", "language": "python"}})
    nb.cells = [nbformat.v4.new_code_cell(
        "import tempfile, nbwatch.hf\n"
        "from tests.scripts.wide_run import make_trainer\n"
        "run = nbwatch.hf.start(make_trainer(tempfile.mkdtemp(), steps=90, delay=0.03),\n"
        "                       run_dir='runs/wide_live')")]
    nbformat.write(nb, workdir / "wide_live.ipynb")
    try:
        open_notebook(page, f"{lab.url}/lab/tree/wide_live.ipynb?reset")
        run_all(page)
        page.wait_for_function(
            "() => document.querySelector('.nbw-root')?.dataset.state === 'finished'",
            timeout=120_000)
        page.wait_for_function(
            "() => document.querySelector('[data-panel=attention] .nbw-attn-overview')"
            "?.data && document.querySelector('[data-panel=grads] .nbw-grads-heat')?.data",
            timeout=30_000)
        # the page's redraw budget may have drawn the heat map last before the spike's step
        # (a panel redraws every ~25 s under load): the finished run's is drawn soon after
        page.wait_for_function(
            "(s) => { const x = document.querySelector('[data-panel=grads] "
            ".nbw-grads-heat').data[0].x; return x.length && x[x.length - 1] > s; }",
            arg=wide_run.SPIKE_STEP, timeout=60_000)
        check_scale(page)
    finally:
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "lab_12x12.png"), full_page=True)
        lab.shutdown_kernels()
