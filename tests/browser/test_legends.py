"""What a reader sees of the dashboard in JupyterLab, on one finished run drawn once:
every legend stays off the data and off its figure's title (the Health panel's output
logits, whose legend sat inside the plot at the top left over the run's first steps; the
per-rank loss and exchange time of a job of many ranks; the system figures of a machine of
many GPUs; the global grad norm; the loss); each tick label of a log axis reads as the value
at its place (plotly labelled 0.05 "5" and 20 "2"); the header keeps its x axis switch
beside its label, on the row of the step counter, at the widths a notebook cell has; the
output logits' legend is one row at half width; the grad heat map's colour bar reads in norms
(it read −2 for 0.01); and a panel with nothing to draw yet (no attention map, no weight
histogram) is one line saying so, not a blank box or empty axes."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from nbwatch.records import Scalars, SystemSample
from nbwatch.store import RunStore

from .conftest import ARTIFACTS
from .harness import dashboard_notebook, local_only, open_notebook, run_all
from .test_loss_reading import NORM, drag_zoom

pytestmark = pytest.mark.browser

RANKS, GPUS = 8, 8
# the figures that show a legend, by a CSS selector of their plotly div
LEGENDS = ("[data-panel=health] .nbw-health-out", "[data-panel=ranks] .nbw-ranks-loss",
           "[data-panel=ranks] .nbw-ranks-sync", "[data-panel=system] .nbw-system-util",
           "[data-panel=system] .nbw-system-mem", "[data-panel=grads] .nbw-grads-norm",
           "[data-panel=loss] .js-plotly-plot")
WIDE = 1400  # the page's width but where a test says otherwise


def _run(run_dir) -> None:
    """A finished run with every figure that has a legend: output logits (probe and every
    training batch), a job of RANKS ranks, a machine of GPUS GPUs; with the rates and the
    spike score a header shows; per-layer grad norms from 1 down to 5e-4 (the heat map's
    log colour); and four log y axes: the global grad norm (10 down to 0.01,
    log by itself), the update ratios, the largest attention logit and, its box ticked, the
    loss (3 down to 0.04)."""
    store = RunStore(run_dir)
    t0 = time.time() - 100
    store.set_meta("name", "tinygpt-2layer")
    for s in range(1, 101):
        up = 1.0 + s / 50
        norm = 10.0 * 1e-3 ** ((s - 1) / 99)
        v = {"loss/train": 3.0 * np.exp(-s / 20) + 0.02, "lr": 1e-3, "grad_norm/global": norm,
             "grad_norm/clipped": min(norm, 1.5), "train_logits/log_z": 2.0 * up,
             "train_logits/max_abs": 10.0 * up, "throughput/tokens_per_s": 123456.0,
             "throughput/tflops": 312.5, "throughput/mfu": 0.4123, "spike/score": 3.0,
             "update_ratio/blocks.0.attn": 3e-3 * np.exp(-s / 30),
             "update_ratio/blocks.1.attn": 1e-3 * np.exp(-s / 40),
             "grad_norm/blocks.0.attn": norm / 10, "grad_norm/blocks.1.attn": norm / 20}
        if s % 10 == 0:
            v.update({"loss/val": 3.1 * np.exp(-s / 20) + 0.03, "logits/z_mean": 2.0 * up + 0.05,
                      "logits/max_abs": 10.0 * up + 0.5})
            for b in range(2):
                v.update({f"attn/max_logit/blocks.{b}.attn": (2.0 + b) * 1.03 ** s,
                          f"attn/entropy/blocks.{b}.attn": 2.0 - s / 200 - b / 4,
                          f"act/rms/blocks.{b}": 1.0 + s / 100 + b / 2})
        for r in range(RANKS):
            v.update({f"rank{r}/loss": v["loss/train"] + 0.01 * r, f"rank{r}/time/sync": 1e-3,
                      f"rank{r}/time/step": 0.1, f"rank{r}/time/busy": 0.05 + 0.001 * r})
        store.put(Scalars(s, v, wall=t0 + s))
        store.put(SystemSample({"system/cpu/util": 50.0, "system/ram/used_gb": 2.0,
                                **{f"system/gpu{g}/{k}": 30.0 + g for g in range(GPUS)
                                   for k in ("util", "mem_used_gb")}}, step=s, wall=t0 + s))
    store.set_meta("state", "finished")
    store.set_meta("step", 100)
    store.close()


@pytest.fixture(scope="module")
def drawn(browser, lab, workdir):
    """The run's dashboard drawn once in JupyterLab (its file browser open, as `?reset`
    leaves it), for every test here; at the end, as the `page` fixture's, a screenshot and no
    page error of nbwatch's or plotly's."""
    _run(workdir / "runs" / "legends")
    dashboard_notebook(workdir, "legends")
    ctx = browser.new_context(viewport={"width": WIDE, "height": 1800})
    local_only(ctx)
    page = ctx.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        open_notebook(page, f"{lab.url}/lab/tree/legends.ipynb?reset")
        run_all(page)
        for sel in LEGENDS:
            page.wait_for_function("(sel) => document.querySelector(sel)?.querySelector("
                                   "'.legend .traces')", arg=sel, timeout=30_000)
        page.wait_for_timeout(500)  # a margin pushed by a legend: plotly's second draw
        yield page
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "legends_and_ticks.png"))
    finally:
        ctx.close()
        lab.shutdown_kernels()
    assert not [e for e in errors if "nbwatch" in e or "plotly" in e.lower()], errors


def _resize(page, width: int, settle: int = 300) -> None:
    """The page `width` px wide, every figure redrawn to its new width (and `settle` ms more:
    a margin pushed by a legend is plotly's second draw)."""
    page.set_viewport_size({"width": width, "height": 1800})
    # JupyterLab lays its panels out a moment after the window's resize: the dashboard's
    # width the same at two readings 100 ms apart, and every figure drawn at its div's width
    seen = None
    for _ in range(50):
        now = page.evaluate("""() => [document.querySelector('.nbw-root').clientWidth,
            [...document.querySelectorAll('.nbw-root .js-plotly-plot')]
              .filter((gd) => gd.offsetParent && gd._fullLayout)
              .every((gd) => Math.abs(gd._fullLayout.width - gd.clientWidth) < 1)]""")
        if now == seen and now[1]:
            break
        seen = now
        page.wait_for_timeout(100)
    page.wait_for_timeout(settle)


def _boxes(page, sel: str) -> dict[str, list[float] | None]:
    """Page boxes [left, top, right, bottom] of the figure, its legend, its plot area (the
    drag rectangle of its x-y subplot) and its title."""
    return page.evaluate("""(sel) => { const gd = document.querySelector(sel);
        const box = (e) => { if (!e) return null; const r = e.getBoundingClientRect();
          return [r.left, r.top, r.right, r.bottom]; };
        return {div: box(gd), legend: box(gd.querySelector('.legend')),
                plot: box(gd.querySelector('.draglayer .xy .nsewdrag')),
                title: box(gd.querySelector('.g-gtitle .gtitle'))}; }""", sel)


def _overlap(a: list[float], b: list[float]) -> bool:
    return a[0] < b[2] - 0.5 and b[0] < a[2] - 0.5 and a[1] < b[3] - 0.5 and b[1] < a[3] - 0.5


def test_legends_stay_off_the_data_and_the_titles(drawn):
    page = drawn
    _resize(page, WIDE)
    bad = []
    for sel in LEGENDS:
        b = _boxes(page, sel)
        legend, plot, div = b["legend"], b["plot"], b["div"]
        if not (legend[2] - legend[0] > 20 and legend[3] - legend[1] > 5):
            bad.append(f"{sel}: no legend drawn {b}")
        if not (div[0] - 0.5 <= legend[0] and legend[2] <= div[2] + 0.5
                and div[1] - 0.5 <= legend[1] and legend[3] <= div[3] + 0.5):
            bad.append(f"{sel}: the legend outside its figure {b}")
        if not (plot[2] - plot[0] > 100 and plot[3] - plot[1] > 60):
            bad.append(f"{sel}: a plot area too small {b}")
        if _overlap(legend, plot):
            bad.append(f"{sel}: the legend over the data {b}")
        if b["title"] is not None and _overlap(legend, b["title"]):
            bad.append(f"{sel}: the legend over the title {b}")
    assert not bad, "\n".join(bad)


NORM_SEL = "[data-panel=grads] .nbw-grads-norm .draglayer .nsewdrag"
# Every log y axis drawn: its tick labels, their page boxes, and where the axis puts a value.
LOG_TICKS = """() => [...document.querySelectorAll('.nbw-root .js-plotly-plot')]
    .filter((gd) => gd.offsetParent && gd._fullLayout)
    .flatMap((gd) => Object.keys(gd._fullLayout)
      .filter((k) => /^yaxis\\d*$/.test(k) && gd._fullLayout[k].type === 'log')
      .map((k) => { const ax = gd._fullLayout[k], top = gd.getBoundingClientRect().top;
        return {figure: gd.closest('[data-panel]').dataset.panel + ' ' + gd.className, axis: k,
                range: ax.range.slice(), top: top + ax._offset, length: ax._length,
                ticks: [...gd.querySelectorAll(`.${ax._id}tick text`)].map((t) => {
                  const r = t.getBoundingClientRect();
                  return {text: t.textContent, top: r.top, bottom: r.bottom}; })}; }))"""


def _misread(axes: list[dict]) -> list[str]:
    """Each tick label that does not read as the value at its place (within 4 px), and each
    that runs into the next."""
    bad = []
    for a in axes:
        ticks = sorted(a["ticks"], key=lambda t: t["top"])
        if len(ticks) < 2:
            bad.append(f"{a['figure']} {a['axis']}: {len(ticks)} tick labels")
        lo, hi = a["range"]
        for t in ticks:
            try:
                v = float(t["text"].replace("\u2212", "-"))
            except ValueError:
                bad.append(f"{a['figure']} {a['axis']}: {t['text']!r} is no number")
                continue
            at = a["top"] + a["length"] * (hi - math.log10(v)) / (hi - lo) if v > 0 else math.nan
            mid = (t["top"] + t["bottom"]) / 2
            if not abs(mid - at) <= 4:
                bad.append(f"{a['figure']} {a['axis']}: {t['text']!r} drawn at {mid:.0f} px, "
                           f"where the axis has {v:g} at {at:.0f} px")
        bad += [f"{a['figure']} {a['axis']}: {p['text']!r} runs into {n['text']!r}"
                for p, n in zip(ticks, ticks[1:]) if n["top"] < p["bottom"] - 1]
    return bad


def test_every_log_axis_labels_its_ticks_with_their_values(drawn):
    """Plotly labels a log axis's ticks between decades with their leading digit alone: the
    grad norm's 0.05 read "5", the largest attention logit's 20 read "2". Every tick label of
    every log axis drawn parses as the number at its place (the loss's tick at 0.05 reads
    0.05), none runs into the next, also once a zoom on x has refitted y."""
    page = drawn
    _resize(page, WIDE)
    page.locator("[data-panel=loss] .nbw-logy").check()
    page.wait_for_function("() => document.querySelector('[data-panel=loss] .js-plotly-plot')"
                           "._fullLayout.yaxis.type === 'log'", timeout=10_000)
    page.wait_for_timeout(300)
    try:
        axes = page.evaluate(LOG_TICKS)
        drawn_on = {a["figure"].split()[0] + " " + a["axis"] for a in axes}
        assert {"loss yaxis", "grads yaxis", "weights yaxis", "health yaxis"} <= drawn_on, axes
        assert not _misread(axes), "\n".join(_misread(axes))
        loss = next(a for a in axes if a["figure"].startswith("loss"))
        assert "0.05" in [t["text"] for t in loss["ticks"]], loss["ticks"]
        # steps 30 to 70 of the norm: one decade, not three; y refitted, its ticks chosen anew
        page.locator(NORM_SEL).scroll_into_view_if_needed()
        drag_zoom(page, 30, 70, NORM)
        page.wait_for_function(f"() => {NORM}._fullLayout.yaxis.range[1] < 0.5", timeout=10_000)
        page.wait_for_timeout(300)
        norm = [a for a in page.evaluate(LOG_TICKS) if "nbw-grads-norm" in a["figure"]]
        assert len(norm) == 1 and not _misread(norm), "\n".join(_misread(norm))
    finally:
        page.locator("[data-panel=loss] .nbw-logy").uncheck()
        page.locator(NORM_SEL).dblclick()

def _dashboard_at(page, own: int, settle: int = 300) -> None:
    """The page as wide as puts the dashboard (a cell's output) at `own` px: JupyterLab's
    file browser and margins beside it keep their width."""
    root = "() => document.querySelector('.nbw-root').getBoundingClientRect().width"
    beside = page.evaluate("() => window.innerWidth") - page.evaluate(root)
    _resize(page, round(beside + own), settle)
    assert page.evaluate(root) == pytest.approx(own, abs=2)


def _one_row(a: list[float], b: list[float]) -> bool:
    """Boxes side by side: on one line, one's top above the other's bottom."""
    return a[1] < b[3] - 1 and b[1] < a[3] - 1


HEADER = """() => { const box = (s) => { const r = document.querySelector('.nbw-header ' + s)
      .getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
    return Object.fromEntries(['.nbw-header-top', '.nbw-name', '.nbw-state', '.nbw-step',
      '.nbw-stats', '.nbw-spikes', '.nbw-xaxis-label', '.nbw-xaxis'].map((s) => [s, box(s)])); }"""


def test_the_header_keeps_its_x_axis_switch_on_its_row_at_1060_and_900_px(drawn):
    """The header's x axis switch went onto a line of its own under the rates at a 1,060 px
    page. At a page of 1,060 and 900 px (the file browser open: a cell of ~630 and ~470 px)
    and at a cell of 1,060 and 900 px, the switch sits beside its "x:", inside the header,
    on the step counter's row, over no other text; in a cell of 900 px or more the run's
    name and state are on that row too."""
    page = drawn
    bad = []
    for page_px, own in ((1060, None), (900, None), (None, 1060), (None, 900)):
        if own:
            _dashboard_at(page, own, settle=0)
        else:
            _resize(page, page_px, settle=0)
        at = f"a {page_px} px page" if page_px else f"a {own} px dashboard"
        h = page.evaluate(HEADER)
        top, label, pick = h[".nbw-header-top"], h[".nbw-xaxis-label"], h[".nbw-xaxis"]
        if not (label[3] - label[1] < (pick[3] - pick[1]) + 6 and _one_row(label, pick)
                and label[0] < pick[0]):
            bad.append(f"{at}: the switch not on one line with its label {label} {pick}")
        if not (top[0] - 0.5 <= pick[0] and pick[2] <= top[2] + 0.5):
            bad.append(f"{at}: the switch outside the header {pick} {top}")
        if not _one_row(pick, h[".nbw-step"]):
            bad.append(f"{at}: the switch not on the step's row {pick} {h['.nbw-step']}")
        bad += [f"{at}: the switch over {s} {h[s]}" for s in (".nbw-name", ".nbw-state",
                ".nbw-step", ".nbw-stats", ".nbw-spikes") if _overlap(h[s], label)]
        if (own or 0) >= 900:
            bad += [f"{at}: {s} not on the switch's row" for s in (".nbw-name", ".nbw-state")
                    if not _one_row(h[s], pick)]
    assert not bad, "\n".join(bad)


def _width(a: list[float]) -> float:
    return a[2] - a[0]


def test_the_output_logits_legend_is_one_row_at_half_width(drawn):
    """The Health panel's output-logits figure is half its panel wide: its legend of four
    entries took two rows there (at a 1,100 px dashboard, the panel beside the System panel),
    out of the plot's height. One entry a figure now, on one row, off the data."""
    page = drawn
    sel = "[data-panel=health] .nbw-health-out"
    # the panel beside the System panel, at its narrowest; the panel alone in its row
    for own in (1100, 800):
        _dashboard_at(page, own)
        g = page.evaluate("""(sel) => { const gd = document.querySelector(sel);
            const box = (e) => { const r = e.getBoundingClientRect();
              return [r.left, r.top, r.right, r.bottom]; };
            return {panel: box(gd.closest('[data-panel]')), fig: box(gd),
                    entries: [...gd.querySelectorAll('.legend .traces')].map(box)}; }""", sel)
        b = _boxes(page, sel)
        if own == 1100:
            assert _width(g["panel"]) < 0.7 * own, g  # beside the System panel
        assert _width(g["fig"]) < 0.6 * _width(g["panel"]), g  # half the panel
        tops = sorted(e[1] for e in g["entries"])
        assert len(tops) == 2 and tops[-1] - tops[0] < 1, (own, g)
        assert not _overlap(b["legend"], b["plot"]), (own, b)
        assert b["plot"][3] - b["plot"][1] > 140, (own, b)  # no row of legend taken from it


HEAT = "[data-panel=grads] .nbw-grads-heat"
# The grads heat map's colour bar: its tick labels and their page places, the z (log₁₀ of the
# norm) at its fill's top and bottom, its title.
HEAT_BAR = """(sel) => { const gd = document.querySelector(sel), tr = gd._fullData[0];
    const fill = gd.querySelector('.colorbar .cbfill').getBoundingClientRect();
    return {zmin: tr.zmin, zmax: tr.zmax, top: fill.top, bottom: fill.bottom,
            title: gd.querySelector('.colorbar .cbtitle')?.textContent,
            ticks: [...gd.querySelectorAll('.colorbar .cbaxis text')].map((t) => {
              const r = t.getBoundingClientRect();
              return {text: t.textContent, mid: (r.top + r.bottom) / 2}; })}; }"""


def test_the_grad_heat_map_colour_bar_reads_in_norms(drawn):
    """The per-layer grad norm heat map's colour (log₁₀ of the norm) had its bar labelled
    with exponents (−3, −2, −1, 0) under "log₁₀": a reader saw −2 where the norm was 0.01.
    Each label now parses as a norm (0.001 … 1), drawn where the colour of that norm is; the
    scale stays log (a decade apart, labels evenly spaced); a cell's hover reads its norm."""
    page = drawn
    _resize(page, WIDE)
    page.locator(HEAT).scroll_into_view_if_needed()
    bar = page.evaluate(HEAT_BAR, HEAT)
    texts = [t["text"] for t in bar["ticks"]]
    assert {"0.001", "0.01", "0.1", "1"} <= set(texts), bar
    assert "log" in (bar["title"] or "") and "₁₀" not in bar["title"], bar
    lo, hi = bar["zmin"], bar["zmax"]
    for t in bar["ticks"]:
        v = float(t["text"].replace("\u2212", "-"))
        at = bar["top"] + (bar["bottom"] - bar["top"]) * (hi - math.log10(v)) / (hi - lo)
        assert abs(t["mid"] - at) <= 4, (t, at, bar)
    # a cell's hover: the norm it holds (the page's own value), not its log
    x, y, want = page.evaluate("""(sel) => { const gd = document.querySelector(sel);
        const fl = gd._fullLayout, r = gd.getBoundingClientRect(), j = 40;
        return [r.left + fl.xaxis._offset + fl.xaxis.d2p(gd.data[0].x[j]),
                r.top + fl.yaxis._offset + fl.yaxis.d2p(0), gd.data[0].customdata[0][j]]; }""",
                                HEAT)
    page.mouse.move(x, y)
    page.wait_for_function("() => document.querySelector('[data-panel=grads] .hoverlayer "
                           ".hovertext')", timeout=5_000)
    hover = page.locator("[data-panel=grads] .hoverlayer .hovertext").text_content()
    page.mouse.move(1, 1)
    assert f"grad norm {want:.4g}" in hover, (hover, want)


# The Attention and Weights panels of a run with no map and no weight histogram: each
# panel's box, its note, and its figures shown.
EMPTY = """() => Object.fromEntries(['attention', 'weights'].map((p) => {
    const box = document.querySelector(`[data-panel=${p}]`), r = box.getBoundingClientRect();
    const note = box.querySelector('.nbw-empty');
    return [p, {height: r.height, width: r.width,
      note: note && note.offsetParent ? note.textContent : null,
      figures: [...box.querySelectorAll('.nbw-plot')].filter((d) => d.offsetParent)
        .map((d) => ({cls: d.className, width: d.getBoundingClientRect().width}))}]; }))"""


def test_the_attention_panel_without_maps_is_a_line(drawn):
    """Before (or without) an attention map the Attention panel was a blank box ~840 px tall
    (its empty figures' height) under "no probe yet". It is now its head and one line saying
    when maps come, or here why none came: this run ended without one."""
    att = drawn.evaluate(EMPTY)["attention"]
    assert att["note"] == "no attention maps: the run ended before an eval took them", att
    assert att["height"] < 80 and not att["figures"], att


def test_the_weights_panel_without_histograms_says_so(drawn):
    """A run without weight histograms drew the histogram as empty axes from −1 to 6. Its
    place is now one line saying why (this run ended without one), and the update ratios,
    which the run has, are drawn across the panel."""
    _resize(drawn, WIDE)
    w = drawn.evaluate(EMPTY)["weights"]
    assert w["note"] == "no weight histograms in this run", w
    assert [f["cls"].split() for f in w["figures"]] == [
        ["nbw-plot", "nbw-half", "nbw-weights-ratio", "js-plotly-plot"]], w
    assert w["figures"][0]["width"] > 0.9 * w["width"], w
