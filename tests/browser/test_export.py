"""The HTML export opened from file:// in headless Chromium: every panel draws, nothing is
requested from anywhere, and hostile strings in the run stay text."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from nbwatch.export import export_html
from nbwatch.store import RunReader
from tests.export_run import IMG, SCRIPT, write_run

from .conftest import ARTIFACTS, ROOT, exported_page
from .harness import click_head, panels_rendered

pytestmark = pytest.mark.browser

PLOTS = ("loss", "grads", "weights", "attention", "data", "metrics")
TABLES = ("events", "checkpoints", "config", "environment")


def test_export_draws_offline_and_runs_no_injected_script(browser, tmp_path):
    path = export_html(write_run(tmp_path / "run", steps=300), tmp_path / "run.html")
    ctx = browser.new_context(viewport={"width": 1400, "height": 1800})
    left: list[str] = []

    def route(r):
        if r.request.url.startswith("file://"):
            r.continue_()
        else:  # anything else would leave the file: record it, and let it fail
            left.append(r.request.url)
            r.abort()

    ctx.route("**/*", route)
    page = ctx.new_page()
    errors: list[str] = []
    dialogs: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    try:
        page.goto(path.as_uri())
        page.wait_for_selector(".nbw-root[data-ready]", timeout=30_000)
        page.wait_for_function(
            "(ps) => ps.every((p) => document.querySelector(`[data-panel=${p}] .main-svg`))",
            arg=list(PLOTS), timeout=30_000)

        rendered = panels_rendered(page)
        assert all(rendered.values()), rendered
        assert not page.locator("[data-panel=ranks]").is_visible()  # one process: no ranks
        svgs = page.evaluate(
            "(ps) => ps.map((p) => document.querySelectorAll(`[data-panel=${p}] .main-svg`)"
            ".length)", list(PLOTS))
        assert all(n > 0 for n in svgs), dict(zip(PLOTS, svgs))
        rows = page.evaluate(
            "(ts) => ts.map((t) => document.querySelectorAll(`[data-panel=${t}] tbody tr`)"
            ".length)", list(TABLES))
        assert all(n > 0 for n in rows), dict(zip(TABLES, rows))
        # The export has no kernel: it carries the newest eval's maps, and a head opened
        # draws its own (the store's weights to 1/255).
        click_head(page, 1, 1)
        page.wait_for_function(
            "() => document.querySelector('[data-panel=attention]').dataset.open === '1:1'",
            timeout=10_000)
        z = page.evaluate("""() => document.querySelector('[data-panel=attention] .nbw-attn-map')
            .data[0].z""")
        stored = RunReader(path.parent / "run").attention(300)["blocks.1.mlp"][1]
        want = np.rint(stored.astype(np.float32) * 255).astype(np.uint8) / 255
        np.testing.assert_allclose(np.array(z, dtype=np.float64), want, rtol=0, atol=1e-12)
        summary = page.locator("[data-panel=summary]").inner_text()
        assert "best val loss" in summary and "tokens seen" in summary

        # The hostile strings are on the page as text, and none of them ran.
        assert page.locator(".nbw-name").text_content() == f"run {SCRIPT}"
        assert SCRIPT in page.locator("[data-panel=samples]").inner_text()
        assert IMG in page.locator("[data-panel=config]").inner_text()
        assert IMG in page.locator("[data-panel=alerts]").inner_text()
        assert page.evaluate("() => window.__xss") is None
        assert page.evaluate("() => document.querySelectorAll('img').length") == 0
        assert page.evaluate("() => document.scripts.length") == 3  # the page's own
        # The metrics panel draws a val metric by default, and lists the user's own scalar
        # (named with markup) as text; picking it draws it, still inert.
        listed = page.locator("[data-panel=metrics] .nbw-metric-list").inner_text()
        assert "val/accuracy" in listed and f"train/evil{IMG}%{{x}}" in listed
        assert page.locator('[data-panel=metrics] input[data-key="val/accuracy"]').is_checked()
        page.locator("[data-panel=metrics] .nbw-metric-search").fill("evil")
        page.locator("[data-panel=metrics] .nbw-metric-list input").first.check()
        page.wait_for_timeout(300)
        # each picked series has its row, the key written over it (plotly's annotation)
        labels = " ".join(page.locator("[data-panel=metrics] .annotation").all_text_contents())
        assert f"evil{IMG}" in labels
        # The layer picker offers the hostile layer name; choosing it redraws, still inert.
        page.select_option(".nbw-layer-pick", f"evil{IMG}")
        page.wait_for_timeout(300)
        assert page.evaluate("() => window.__xss") is None
        assert not dialogs, dialogs
        assert not left, left
        assert not errors, errors
    finally:
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "export.png"), full_page=True)
        ctx.close()


def test_export_of_a_torchrun_job_draws_the_ranks_panel(browser, tmp_path):
    """A real 2-rank gloo job (rank 1 sleeps twice as long each step): the ranks panel shows
    both ranks, rank 1 outlined as the slowest, and the straggler warning."""
    run = tmp_path / "ddp"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc_per_node=2", str(ROOT / "tests/scripts/ddp_train.py"), str(run),
                    "300"], cwd=tmp_path, env=env, check=True, timeout=180,
                   capture_output=True)
    path = export_html(run, tmp_path / "ddp.html")
    ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = ctx.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    try:
        page.goto(path.as_uri())
        page.wait_for_selector(".nbw-root[data-ready]", timeout=30_000)
        box = page.locator("[data-panel=ranks]")
        box.locator(".nbw-ranks-sync .main-svg").first.wait_for(timeout=30_000)
        assert box.is_visible()
        assert box.get_attribute("data-ranks") == "2"
        assert box.get_attribute("data-slowest") == "1"
        assert box.locator(".nbw-warn-line").inner_text().startswith(
            "step ")  # "step N: straggler: rank 1 is …% slower …"
        assert "straggler: rank 1 is" in box.locator(".nbw-warn-line").inner_text()
        plots = box.evaluate("""(b) => [...b.querySelectorAll('.js-plotly-plot')].map((gd) => ({
            cls: gd.className, traces: gd.data.map((t) => ({
              x: Array.from(t.x || []).length, y: Array.from(t.y || []),
              color: t.marker && t.marker.color, line: t.marker && t.marker.line
                && Array.from(t.marker.line.width || [])})),
            notes: (gd.layout.annotations || []).map((a) => a.text)}))""")
        time_plot, tput_plot, loss_plot, sync_plot = plots
        busy = time_plot["traces"][0]
        assert busy["x"] == 2 and busy["line"] == [0, 3]  # rank 1 outlined, rank 0 not
        assert busy["y"][1] > 1.5 * busy["y"][0]  # rank 1 sleeps twice as long
        assert busy["color"][0] != busy["color"][1]
        assert tput_plot["traces"][0]["line"] == [0, 3]
        assert any(n.startswith("slowest") for n in time_plot["notes"])
        # One colour per rank across the panel: the loss lines use the bars' colours.
        loss_colors = box.evaluate("""(b) => b.querySelector('.nbw-ranks-loss').data
            .map((t) => t.line.color)""")
        assert loss_colors == busy["color"]
        assert [t["x"] for t in loss_plot["traces"]] == [300, 300]
        assert len(sync_plot["traces"]) == 2 and all(t["x"] > 0 for t in sync_plot["traces"])
        assert not errors, errors
    finally:
        ARTIFACTS.mkdir(exist_ok=True)
        page.locator("[data-panel=ranks]").screenshot(path=str(ARTIFACTS / "export_ranks.png"))
        page.screenshot(path=str(ARTIFACTS / "export_ddp.png"), full_page=True)
        ctx.close()


def test_export_x_axis_switch_baseline_and_labels(browser, tmp_path):
    """The export: a baseline's loss is on the loss chart, the Health and Metrics plots
    are labelled, and the x axis switch redraws every trend panel against time, an eval
    stall showing as a gap."""
    import time as _time

    from nbwatch.alerts.health import ENTROPY
    from nbwatch.records import Scalars
    from nbwatch.store import RunStore

    from .harness import NOT_TREND, TREND, choose_x_axis, plots_of

    t0 = _time.time() - 100
    for name, lr, baselines in (("exp0", 1e-3, []), ("exp1", 3e-4, [tmp_path / "exp0"])):
        store = RunStore(tmp_path / name)
        store.set_meta("name", name)
        store.set_meta("config", {"lr": lr})
        store.set_meta("started", t0)
        store.set_meta("baselines", [str(b) for b in baselines])
        for s in range(1, 81):
            v = {"loss/train": 3 - s / 80, "lr": lr, "grad_norm/global": 1.0,
                 "data/padding_ratio": 0.1, "tokens/real": 64.0, "data/seq_len_max": 128.0,
                 "epoch": float(s > 40), "grad_norm/blocks.0.attn": 0.5,
                 "update_ratio/blocks.0.attn": 1e-3, "update_ratio/blocks.1.attn": 2e-3}
            if s % 20 == 0:
                v |= {"loss/val": 2.9 - s / 80, f"{ENTROPY}blocks.0.attn": 2.0,
                      f"{ENTROPY}blocks.1.attn": 2.5}
            # step 41 waited 30 s (an eval): a gap on the time axes
            store.put(Scalars(s, v, wall=t0 + 0.2 * s + (30.0 if s > 40 else 0.0)))
        store.set_meta("state", "finished")
        store.close()
    path = export_html(tmp_path / "exp1", tmp_path / "exp1.html")
    page = browser.new_page(viewport={"width": 1400, "height": 1800})
    try:
        page.goto(path.as_uri())
        page.wait_for_selector(".nbw-root[data-ready]", timeout=30_000)
        page.wait_for_function("() => document.querySelector('[data-panel=health] .main-svg')")
        plots = plots_of(page, TREND)
        loss = [p for p in plots if p["panel"] == "loss"][0]
        assert "baseline exp0" in loss["traces"] and loss["legend"]
        health = [p for p in plots if "nbw-health-entropy" in p["cls"]][0]
        assert sorted(health["labels"]) == ["0.attn", "1.attn"]  # at each line's end
        metrics = [p for p in plots if p["panel"] == "metrics"][0]
        assert {"data/seq_len_max", "epoch"} <= set(metrics["labels"])  # a row each
        ratio = [p for p in plots if p["panel"] == "weights" and p["labels"]][0]
        assert len(ratio["labels"]) == 2

        choose_x_axis(page, "relative")
        page.wait_for_timeout(500)
        trend = [p for p in plots_of(page, TREND) if not any(c in p["cls"] for c in NOT_TREND)]
        # loss, the grads' heat map and norm, the update ratios (this run has no weight
        # histogram: a note stands there), health, data and metrics
        assert len(trend) >= 7 and {"loss", "grads", "weights", "health", "data",
                                    "metrics"} <= {p["panel"] for p in trend}, trend
        assert all(p["x"] == "time since the start (s)" for p in trend), trend
        train = page.evaluate("""() => {
            const gd = document.querySelector('[data-panel=loss] .js-plotly-plot');
            const t = gd.data.find((t) => t.name === 'train loss');
            return Array.from(t.x); }""")
        gap = train.index(None)
        assert train[gap + 1] - train[gap - 1] == pytest.approx(30.2, abs=0.05)
        assert train[0] == pytest.approx(0.2, abs=0.01) and train[-1] == pytest.approx(46, abs=0.1)
        # the baseline is drawn by its own clock
        base = page.evaluate("""() => {
            const gd = document.querySelector('[data-panel=loss] .js-plotly-plot');
            return Array.from(gd.data.find((t) => t.name === 'baseline exp0').x).slice(-1); }""")
        assert base[0] == pytest.approx(46, abs=0.5)
        choose_x_axis(page, "wall")
        page.wait_for_timeout(300)
        assert {p["xtype"] for p in plots_of(page, ["loss", "metrics"])} == {"date"}
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "export_x_axis.png"), full_page=True)
    finally:
        page.close()


def test_export_of_a_model_without_attention_says_why_there_are_no_maps(browser, tmp_path):
    """An LSTM through start() with a probe batch and three evals: the exported page's
    Attention panel says the probe saw no attention weights (it said "no probe yet")."""
    import itertools

    import torch

    import nbwatch

    class Lstm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(32, 16)
            self.rnn = torch.nn.LSTM(16, 16, batch_first=True)
            self.head = torch.nn.Linear(16, 32)

        def forward(self, ids):
            return self.head(self.rnn(self.emb(ids))[0])

    torch.manual_seed(0)
    model = Lstm()
    ids = torch.randint(0, 32, (4, 12))
    mon = nbwatch.Monitor(model, torch.optim.SGD(model.parameters(), lr=0.1),
                          run_dir=tmp_path / "r", display=False)
    mon.start(lambda m, b: torch.nn.functional.cross_entropy(m(b).flatten(0, 1), b.flatten()),
              itertools.repeat(ids), max_steps=6, eval_every=2, probe_batch=ids,
              display=False).wait()
    path = export_html(tmp_path / "r", tmp_path / "lstm.html")
    page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
    try:
        page.goto(path.as_uri())
        page.wait_for_selector(".nbw-root[data-ready]", timeout=30_000)
        said = page.locator("[data-panel=attention] .nbw-empty").text_content()
        assert "saw no attention weights" in said and "no probe yet" not in said, said
    finally:
        page.context.close()


def test_export_of_a_failed_run_shows_its_error_and_traceback(browser, tmp_path):
    """The header turned red, but the error and its traceback stayed hidden (a CSS rule
    won over the style that was to show them), live and in the export alike."""
    import itertools

    import torch

    import nbwatch

    def step_fn(m, x):
        if step_fn.calls == 3:
            raise ValueError("raised on purpose at step 4")
        step_fn.calls += 1
        return m(x).square().mean()

    step_fn.calls = 0
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    mon = nbwatch.Monitor(model, torch.optim.SGD(model.parameters(), lr=0.1),
                          run_dir=tmp_path / "r", display=False)
    mon.start(step_fn, itertools.repeat(torch.randn(2, 4)), max_steps=10, display=False)
    with pytest.raises(ValueError):
        mon.wait()
    path = export_html(tmp_path / "r", tmp_path / "failed.html")
    page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
    try:
        page.goto(path.as_uri())
        page.wait_for_selector(".nbw-header.nbw-failed", timeout=30_000)
        tb = page.locator(".nbw-traceback")
        assert tb.is_visible() and "raised on purpose at step 4" in tb.inner_text()
    finally:
        page.context.close()


# What the dashboard is given at narrow widths: (page width, the dashboard's own width or None
# for the page's). JupyterLab 4 with its file browser open gives a cell's output 232, 332 and
# 368 px of a 600, 700 and 800 px page (measured); 930 px puts the Data panel's three figures
# beside the Metrics panel, a third of 440 px each.
NARROW = [(480, None), (600, None), (700, None), (800, None), (930, None), (1200, None),
          (600, 232), (700, 332), (800, 368)]

LAYOUT = """() => {
    const box = (e) => { const r = e.getBoundingClientRect();
      return {l: r.left, t: r.top, r: r.right, b: r.bottom}; };
    const titles = {};
    for (const p of document.querySelectorAll('[data-panel]')) {
      if (p.hidden || !p.offsetParent) continue;
      titles[p.dataset.panel] = [...p.querySelectorAll('.js-plotly-plot .gtitle')]
        .filter((t) => !t.closest('.js-plotly-plot').hidden && t.textContent)
        .map((t) => ({text: t.textContent, ...box(t)}));
    }
    const w = document.querySelector('[data-panel=weights]');
    const pick = w.querySelector('.nbw-layer-pick');
    const c = box(pick);
    const atCentre = document.elementFromPoint((c.l + c.r) / 2, (c.t + c.b) / 2);
    return {titles, panel: box(w), pick: c, search: box(w.querySelector('.nbw-layer-search')),
            pickOnTop: atCentre === pick || pick.contains(atCentre),
            view: document.documentElement.clientWidth};
}"""


def _layout(page, wide: int, own: int | None) -> dict:
    page.set_viewport_size({"width": wide, "height": 1000})
    page.evaluate("""(w) => { const r = document.querySelector('.nbw-root');
        r.style.maxWidth = w ? w + 'px' : ''; window.dispatchEvent(new Event('resize')); }""", own)
    page.locator("[data-panel=weights] .nbw-layer-pick").scroll_into_view_if_needed()
    seen = None  # plotly redraws a resized figure ~0.1 s after the resize: until it is still
    for _ in range(20):
        page.wait_for_timeout(150)
        now = page.evaluate(LAYOUT)
        if now == seen:
            break
        seen = now
    return seen


def test_export_narrow_titles_apart_and_layer_picker_inside(browser, tmp_path):
    """At every narrow width the figures' titles of a panel do not run into each other (the
    Data panel's three, side by side, did at 930 px) and the Weights panel's layer picker and
    filter lie inside the panel and the page, on top (in a cell beside JupyterLab's file
    browser the picker stuck out of the panel, cut off)."""
    def hit(a, b):
        return a["l"] < b["r"] and b["l"] < a["r"] and a["t"] < b["b"] and b["t"] < a["b"]

    run = write_run(tmp_path / "run", steps=300)
    with exported_page(browser, run, tmp_path / "run.html") as (page, errors):
        page.wait_for_function("() => document.querySelectorAll("
                               "'[data-panel=data] .main-svg').length >= 3", timeout=20_000)
        bad = []
        for wide, own in NARROW:
            g = _layout(page, wide, own)
            at = f"{wide} px page" + (f", {own} px dashboard" if own else "")
            assert len(g["titles"]["data"]) == 3, (at, g["titles"]["data"])
            for panel, ts in g["titles"].items():
                bad += [f"{at}: {panel} titles {a['text']!r} and {b['text']!r} overlap"
                        for i, a in enumerate(ts) for b in ts[i + 1:] if hit(a, b)]
            for name in ("pick", "search"):
                b, p = g[name], g["panel"]
                if not (p["l"] <= b["l"] and b["r"] <= p["r"] and b["l"] >= 0
                        and b["r"] <= g["view"]):
                    bad.append(f"{at}: the layer {name} {b} outside the panel {p}")
            if not g["pickOnTop"]:
                bad.append(f"{at}: the layer picker is covered")
            if own == 368:
                ARTIFACTS.mkdir(exist_ok=True)
                page.screenshot(path=str(ARTIFACTS / "export_narrow_368.png"))
        assert not bad, "\n".join(bad)
        # the picker still picks: the histogram shows the layer chosen
        page.select_option("[data-panel=weights] .nbw-layer-pick", "blocks.1.mlp")
        page.wait_for_function("() => document.querySelector('[data-panel=weights] .gtitle')"
                               ".textContent.endsWith('blocks.1.mlp')", timeout=10_000)
        assert not errors, errors
