"""Page helpers: open a notebook, run it, run code in its kernel, read the dashboard."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import nbformat
from playwright.sync_api import BrowserContext, Page

PANELS = ("loss", "grads", "weights", "attention", "system", "data", "alerts", "samples")
_KERNEL = "window.jupyterapp.shell.currentWidget.sessionContext.session.kernel"


def local_only(ctx: BrowserContext) -> list[str]:
    """Keep `ctx`'s pages on 127.0.0.1 (and data:/blob: URLs): any other request is
    aborted and its URL added to the list returned."""
    blocked: list[str] = []

    def route(r: Any) -> None:
        if r.request.url.startswith(("http://127.0.0.1", "ws://127.0.0.1", "data:", "blob:")):
            r.continue_()
        else:
            blocked.append(r.request.url)
            r.abort()

    ctx.route("**/*", route)
    return blocked


def dashboard_notebook(workdir: Path, name: str) -> Path:
    """`name`.ipynb in `workdir`: one cell that draws the dashboard of `runs/<name>`."""
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {
        "name": "python3", "display_name": "Python 3", "language": "python"}})
    nb.cells = [nbformat.v4.new_code_cell(
        f"from nbwatch.widget import Dashboard\nDashboard.for_run('runs/{name}')")]
    path = workdir / f"{name}.ipynb"
    nbformat.write(nb, path)
    return path


def open_notebook(page: Page, url: str) -> None:
    page.goto(url)
    page.wait_for_function(
        "() => { try { return " + _KERNEL + ".status === 'idle'; } catch (e) { return false; } }",
        timeout=60_000)


def run_all(page: Page) -> None:
    # Not awaited: the promise resolves only when every cell has finished.
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")


def kernel_idle(page: Page, within: float = 0.0) -> bool:
    """Idle at two readings 0.3 s apart, at some time `within` seconds from now (a widget's
    message, an attention fetch, keeps the kernel busy a moment; a running cell keeps it
    busy throughout)."""
    deadline = time.monotonic() + within
    while True:
        first = page.evaluate(f"() => {_KERNEL}.status")
        time.sleep(0.3)
        if first == "idle" and page.evaluate(f"() => {_KERNEL}.status") == "idle":
            return True
        if time.monotonic() >= deadline:
            return False


def kernel_json(page: Page, expr: str) -> Any:
    """Evaluate `expr` in the notebook's kernel (while it is idle) and return it via JSON."""
    code = f"import json as _j; print(_j.dumps({expr}, default=str))"
    out = page.evaluate(
        """async (code) => {
            const k = """ + _KERNEL + """;
            const out = [];
            const f = k.requestExecute({code, store_history: false});
            f.onIOPub = (m) => {
              if (m.header.msg_type === 'stream') out.push(m.content.text);
              if (m.header.msg_type === 'error') out.push('ERROR ' + m.content.evalue);
            };
            await f.done;
            return out.join('');
        }""", code)
    if out.startswith("ERROR"):
        raise AssertionError(f"kernel raised on {expr!r}: {out}")
    return json.loads(out)


def page_step(page: Page) -> int:
    return int(page.locator(".nbw-root").first.get_attribute("data-step") or 0)


def wait_step(page: Page, at_least: int, timeout: float = 60) -> int:
    page.wait_for_function(
        "(n) => Number(document.querySelector('.nbw-root')?.dataset.step || 0) >= n",
        arg=at_least, timeout=timeout * 1000)
    return page_step(page)


def trace(page: Page, panel: str, name: str, plot: int | str = 0) -> dict[str, list]:
    """x and y of the plotly trace `name` in a panel's `plot`-th figure (or the figure of
    that CSS class), as the page holds it."""
    return page.evaluate(
        """([panel, name, i]) => {
            const gd = typeof i === "string"
              ? document.querySelector(`[data-panel=${panel}] .${i}`)
              : document.querySelectorAll(`[data-panel=${panel}] .js-plotly-plot`)[i];
            const t = gd.data.find((t) => t.name === name);
            return t ? {x: Array.from(t.x), y: Array.from(t.y)} : null;
        }""", [panel, name, plot])


def panels_rendered(page: Page) -> dict[str, bool]:
    """Each panel shows content: plots with points, gauges, feed items, sample text."""
    return page.evaluate(
        """() => {
            const q = (p, s) => document.querySelectorAll(`[data-panel=${p}] ${s}`);
            const plotted = (p) => {
              const gds = q(p, '.js-plotly-plot');
              return gds.length > 0 && [...gds].every((gd) => (gd.data || []).some(
                (t) => (t.z && t.z.length) || (t.x && t.x.length) || (t.y && t.y.length)));
            };
            return {
              header: !!document.querySelector('.nbw-header .nbw-step')?.textContent,
              loss: plotted('loss'), grads: plotted('grads'), weights: plotted('weights'),
              attention: plotted('attention'), data: plotted('data'),
              system: q('system', '.nbw-gauge').length >= 2,
              alerts: q('alerts', '.nbw-item').length >= 1,
              samples: q('samples', '.nbw-sample').length >= 1,
            };
        }""")


def wait_panels(page: Page, timeout: float = 60) -> dict[str, bool]:
    deadline = time.monotonic() + timeout
    while True:
        state = panels_rendered(page)
        if all(state.values()) or time.monotonic() > deadline:
            return state
        time.sleep(0.5)


def double_click(page: Page, x: float, y: float, done: str, tries: int = 3) -> None:
    """Double-click at (x, y) until the JS predicate `done` holds, as a user clicks again
    where nothing happened: on a loaded machine the page's main thread, still redrawing
    after the last control, can take plotly's two clicks more than its 300 ms apart."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    for i in range(tries):
        page.mouse.dblclick(x, y)
        try:
            page.wait_for_function(done, timeout=10_000 if i < tries - 1 else 30_000)
            return
        except PlaywrightTimeout:
            if i == tries - 1:
                raise


def ack(page: Page, text: str, timeout: float = 15) -> str:
    loc = page.locator(".nbw-ack:not([data-pending])", has_text=text)
    loc.wait_for(timeout=timeout * 1000)
    return loc.inner_text()


def grad_heat_peak(page: Page) -> dict[str, Any]:
    """The grads heat map's largest cell as drawn: its layer label, bin start step, width."""
    return page.evaluate(
        """() => {
            const gd = document.querySelector('[data-panel=grads] .nbw-grads-heat');
            const t = gd.data[0];
            let best = [-Infinity, 0, 0];
            t.customdata.forEach((row, i) => row.forEach((v, j) => {
              if (Number.isFinite(v) && v > best[0]) best = [v, i, j];
            }));
            const w = t.x.length > 1 ? t.x[1] - t.x[0] : 1;
            return {value: best[0], layer: t.y[best[1]], step: t.x[best[2]], width: w,
                    layers: t.y.length};
        }""")


def click_head(page: Page, layer: int, head: int) -> None:
    """Click the attention overview's cell of (layer, head), where the page draws it."""
    ov = page.locator("[data-panel=attention] .nbw-attn-overview").first
    ov.scroll_into_view_if_needed()
    x, y = page.evaluate(
        """([l, h]) => {
            const gd = document.querySelector('[data-panel=attention] .nbw-attn-overview');
            const fl = gd._fullLayout, r = gd.getBoundingClientRect();
            return [r.left + fl.xaxis._offset + fl.xaxis.d2p(h),
                    r.top + fl.yaxis._offset + fl.yaxis.d2p(l)];
        }""", [layer, head])
    page.mouse.move(x, y)
    page.mouse.click(x, y)


def plots_of(page: Page, panels: list[str]) -> list[dict[str, Any]]:
    """Each drawn, visible plotly figure of `panels`: its panel, CSS classes, x axis title
    and type, the texts of its annotations (end-of-line and row labels) and whether its
    legend shows, and its traces' names."""
    return page.evaluate(
        """(ps) => ps.flatMap((p) => [...document.querySelectorAll(
              `[data-panel=${p}] .js-plotly-plot`)].filter((gd) => !gd.hidden && gd._fullLayout)
            .map((gd) => ({
              panel: p, cls: gd.className, x: gd._fullLayout.xaxis.title.text,
              xtype: gd._fullLayout.xaxis.type,
              labels: (gd.layout.annotations || []).filter((a) => a.name === "end-label"
                || a.name === "row-label").map((a) => a.text),
              legend: !!gd.querySelector('.legend .traces'),
              traces: gd.data.map((t) => t.name),
            })))""", panels)


def choose_x_axis(page: Page, mode: str) -> None:
    page.select_option(".nbw-xaxis", mode)


# The trend panels and, in each, the figures that are not against steps (bars, histograms
# of one moment, attention maps): the x axis switch redraws the others.
TREND = ["loss", "grads", "weights", "health", "data", "metrics"]
NOT_TREND = ("nbw-grads-bars", "nbw-data-hist")
