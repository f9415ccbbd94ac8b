"""The HTML export opened from file:// in headless Chromium: every panel draws, nothing is
requested from anywhere, and hostile strings in the run stay text."""

from __future__ import annotations

import pytest

from nbwatch.export import export_html
from tests.export_run import IMG, SCRIPT, write_run

from .conftest import ARTIFACTS
from .harness import panels_rendered

pytestmark = pytest.mark.browser

PLOTS = ("loss", "grads", "weights", "attention", "data")
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
        svgs = page.evaluate(
            "(ps) => ps.map((p) => document.querySelectorAll(`[data-panel=${p}] .main-svg`)"
            ".length)", list(PLOTS))
        assert all(n > 0 for n in svgs), dict(zip(PLOTS, svgs))
        rows = page.evaluate(
            "(ts) => ts.map((t) => document.querySelectorAll(`[data-panel=${t}] tbody tr`)"
            ".length)", list(TABLES))
        assert all(n > 0 for n in rows), dict(zip(TABLES, rows))
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
