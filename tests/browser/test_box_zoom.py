"""A zoom of one's own on the figures that set their own y range (the Health panel's four,
the update ratios beside the weight histogram) and on the weight histogram's heat map while
the run is live: a box drawn on both axes holds x and y while new steps arrive (y is not
refitted to the window), its end labels by their lines; a double click gives back the whole
run, which then follows the new steps; a zoom on y alone holds y while x follows the run."""

from __future__ import annotations

import time

import numpy as np
import pytest

from nbwatch.records import Histogram, Scalars
from nbwatch.store import RunStore

from .harness import dashboard_notebook, double_click, open_notebook, run_all

pytestmark = pytest.mark.browser

# The figures, each a JS expression of its plotly div.
PLOTS = {
    "entropy": "document.querySelector('[data-panel=health] .nbw-health-entropy')",
    "max_logit": "document.querySelector('[data-panel=health] .nbw-health-max_logit')",
    "rms": "document.querySelector('[data-panel=health] .nbw-health-rms')",
    "out": "document.querySelector('[data-panel=health] .nbw-health-out')",
    "ratio": "document.querySelector('[data-panel=weights] .nbw-weights-ratio')",
    "heat": "document.querySelector('[data-panel=weights] .nbw-weights-heat')",
}
MODULES = ("blocks.0.attn", "blocks.1.attn")


def _steps(store: RunStore, first: int, last: int) -> None:
    """Health figures and update ratios that climb with the step (a later step is above
    everything before it: an autorange that follows the run shows it), and histograms of the
    first module's weights at step 1 and every 10th, wider as the run goes (the heat map's y
    grows; its first column would reach before step 0)."""
    for s in range(first, last + 1):
        up = 1.0 + s / 50 + 0.1 * np.sin(s)
        v = {"loss/train": 3.0 * np.exp(-s / 200), "lr": 1e-3,
             "logits/z_mean": 2.0 * up, "logits/max_abs": 10.0 * up,
             "train_logits/log_z": 2.0 * up + 0.05, "train_logits/max_abs": 10.0 * up + 0.5}
        for i, m in enumerate(MODULES):
            v[f"attn/entropy/{m}"] = up + i
            v[f"attn/max_logit/{m}"] = 5.0 * up * (i + 1)
            v[f"act/rms/blocks.{i}"] = up * (i + 2)
            v[f"update_ratio/{m}"] = 1e-3 * up * (i + 1)
        store.put(Scalars(s, v, wall=1000.0 + s))
        if s == 1 or s % 10 == 0:
            store.put(Histogram(s, f"weight/{MODULES[0]}", np.linspace(-up, up, 17),
                                np.arange(16) % 5 + 1))
    store.flush()


def _ranges(page, gd: str) -> dict[str, list[float]]:
    """Each cartesian axis's range as drawn (plotly's units: log10 on a log axis)."""
    return page.evaluate(f"""() => {{ const fl = {gd}._fullLayout;
        return Object.fromEntries(Object.keys(fl).filter((k) => /^[xy]axis\\d*$/.test(k))
          .map((k) => [k, fl[k].range.slice()])); }}""")


def _has(gd: str, step: int) -> str:
    return f"() => ({gd}?.data || []).length > 0 && {gd}.data.every((t) => t.x.includes({step}))"


def _at(page, gd: str, fx: float, fy: float) -> tuple[float, float]:
    """The page pixel at fractions (fx, fy) of the figure's plot area (from its top left)."""
    page.evaluate(f"() => {gd}.scrollIntoView({{block: 'center'}})")
    return tuple(page.evaluate(f"""([fx, fy]) => {{ const gd = {gd}, fl = gd._fullLayout,
        r = gd.getBoundingClientRect();
        return [r.left + fl.xaxis._offset + fx * fl.xaxis._length,
                r.top + fl.yaxis._offset + fy * fl.yaxis._length]; }}""", [fx, fy]))


def _drag(page, gd: str, a: tuple[float, float], b: tuple[float, float]) -> list[float]:
    """Drag from `a` to `b` (fractions of the plot area); the x range spanned (in steps)."""
    (x0, y0), (x1, y1) = _at(page, gd, *a), _at(page, gd, *b)
    xs = page.evaluate(f"(fs) => fs.map((f) => {gd}._fullLayout.xaxis.p2l("
                       f"f * {gd}._fullLayout.xaxis._length))", [a[0], b[0]])
    page.mouse.move(x0, y0)
    page.mouse.down()
    page.mouse.move(x1, y1, steps=8)
    page.mouse.up()
    return xs


def _labels_off(page, gd: str) -> list[list[float]]:
    """Each end label whose line ends (at the last step in view) inside the y range shown:
    [its height, its line's] as fractions of the plot area; [] where they agree."""
    return page.evaluate(f"""() => {{ const gd = {gd}, fl = gd._fullLayout;
        const [a, b] = fl.xaxis.range, ya = fl.yaxis, log = ya.type === 'log';
        const out = [];
        for (const an of gd.layout.annotations || []) {{
          if (an.name !== 'end-label') continue;
          const t = gd.data.find((t) => t.line.color === an.font.color);
          let last = null;
          t.x.forEach((x, i) => {{ if (x >= a && x <= b) last = t.y[i]; }});
          const f = ((log ? Math.log10(last) : last) - ya.range[0]) / (ya.range[1] - ya.range[0]);
          if (f >= 0 && f <= 1 && Math.abs(an.y - f) > 0.02) out.push([an.y, f]);
        }}
        return out; }}""")


def _in_view(page, gd: str) -> dict[str, list[float]]:
    """Per y axis: the smallest and largest y of its points (plotly's units)."""
    return page.evaluate(f"""() => {{ const gd = {gd}, fl = gd._fullLayout, out = {{}};
        for (const t of gd.data) {{
          const k = t.yaxis && t.yaxis !== 'y' ? 'yaxis' + t.yaxis.slice(1) : 'yaxis';
          const log = fl[k].type === 'log';
          for (const y of t.y) {{
            const u = log ? Math.log10(y) : y;
            if (!Number.isFinite(u)) continue;
            const r = out[k] || (out[k] = [u, u]);
            r[0] = Math.min(r[0], u); r[1] = Math.max(r[1], u);
          }}
        }}
        return out; }}""")


def _covers(page, gd: str, name: str, within: float = 3) -> None:
    """Every y axis of the figure shows every point of its lines, at most `within` seconds
    from now (a view that sets its own y redraws at the frame after plotly's relayout)."""
    deadline = time.monotonic() + within
    while True:
        shown, points = _ranges(page, gd), _in_view(page, gd)
        out = [(k, shown[k], [lo, hi]) for k, (lo, hi) in points.items()
               if not (shown[k][0] <= lo and shown[k][1] >= hi)]
        if not out or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not out, (name, out)


def test_live_a_box_zoom_holds_x_and_y_through_the_refreshes_and_a_double_click_follows_the_run(
        page, lab, workdir):
    run_dir = workdir / "runs" / "box_live"
    store = RunStore(run_dir)
    try:
        store.set_meta("state", "running")
        _steps(store, 1, 100)
        dashboard_notebook(workdir, "box_live")
        open_notebook(page, f"{lab.url}/lab/tree/box_live.ipynb?reset")
        run_all(page)
        for gd in PLOTS.values():
            page.wait_for_function(_has(gd, 100), timeout=30_000)
        boxed = {}
        for name, gd in PLOTS.items():
            before = _ranges(page, gd)
            # a box over the lower middle of the plot area
            xs = _drag(page, gd, (0.3, 0.45), (0.6, 0.9))
            page.wait_for_function(f"() => {gd}._fullLayout.xaxis.range[1] < 80")
            boxed[name] = _ranges(page, gd)
            assert boxed[name]["xaxis"] == pytest.approx(xs, abs=1), name
            for k, r in boxed[name].items():  # every axis zoomed: a box, not a strip
                assert r[1] - r[0] < 0.6 * (before[k][1] - before[k][0]), (name, k, r, before[k])
            # the end labels beside their lines in the box, before any refresh comes
            deadline = time.monotonic() + 3  # (they are redrawn at the next frame)
            while (off := _labels_off(page, gd)) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert off == [], name
        for last in (140, 180):  # the run goes on and every figure redraws: the box stays
            _steps(store, last - 39, last)
            for name, gd in PLOTS.items():
                page.wait_for_function(_has(gd, last), timeout=30_000)
                shown = _ranges(page, gd)
                assert shown.keys() == boxed[name].keys(), name
                for k, r in boxed[name].items():
                    assert shown[k] == pytest.approx(r, rel=1e-9), (name, last, k)
                assert _labels_off(page, gd) == [], name
        for name, gd in PLOTS.items():  # a double click: the whole run, x and y
            double_click(page, *_at(page, gd, 0.5, 0.5),
                         f"() => {gd}._fullLayout.xaxis.range[1] >= 179")
            _covers(page, gd, name)
        _steps(store, 181, 220)  # and each follows the run again, on both axes
        for name, gd in PLOTS.items():
            page.wait_for_function(f"() => {gd}._fullLayout.xaxis.range[1] >= 219",
                                   timeout=30_000)
            _covers(page, gd, name)
        # the heat map's whole run starts at step 0, not half a column before step 1
        assert _ranges(page, PLOTS["heat"])["xaxis"][0] == pytest.approx(0, abs=1e-9)
        # a zoom on y alone (a drag up or down): y holds, x goes on following the run
        strip = {}
        for name, gd in PLOTS.items():
            _drag(page, gd, (0.5, 0.45), (0.5, 0.9))
            page.wait_for_function(f"() => {gd}._fullLayout.xaxis.autorange === true && "
                                   f"{gd}._fullLayout.yaxis.autorange === false")
            strip[name] = {k: r for k, r in _ranges(page, gd).items() if k != "xaxis"}
        for last in (260, 300):
            _steps(store, last - 39, last)
            for name, gd in PLOTS.items():
                page.wait_for_function(f"() => {gd}._fullLayout.xaxis.range[1] >= {last - 1}",
                                       timeout=30_000)
                for k, r in strip[name].items():
                    assert _ranges(page, gd)[k] == pytest.approx(r, rel=1e-9), (name, last, k)
    finally:
        store.set_meta("state", "finished")
        store.close()
        lab.shutdown_kernels()
