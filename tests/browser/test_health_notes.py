"""The Health panel where the probe could not take a figure: the probe event's words (why,
and the line to add) stand where the figure would be, never empty axes. Opened from the
HTML export in headless Chromium."""

from __future__ import annotations

import pytest
import torch

import nbwatch
from tests.browser.conftest import exported_page
from tests.conftest import make_batches
from tests.test_probe_sources import LossOnly

pytestmark = pytest.mark.browser


def test_health_panel_says_why_the_output_logits_are_missing(browser, tmp_path):
    torch.manual_seed(0)
    model = LossOnly()
    data = make_batches(6)
    mon = nbwatch.Monitor(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                          run_dir=tmp_path / "run")
    mon.start(lambda m, b: m(b["input_ids"], b["labels"]), data, max_steps=4, eval_every=2,
              probe_batch=data[0], display=False)
    mon.wait()
    said = mon.events[mon.events.kind == "probe"].message.iloc[0]
    with exported_page(browser, tmp_path / "run", tmp_path / "run.html") as (page, errors):
        box = page.locator("[data-panel=health]")
        box.locator(".nbw-health-entropy .main-svg").first.wait_for(timeout=30_000)
        note = box.locator(".nbw-health-none-out")
        assert note.is_visible() and note.inner_text() == said
        assert not box.locator(".nbw-health-out").is_visible()  # no empty axes
        # this model has no nn.ModuleList of blocks: the RMS figure says so, too
        assert "no repeated blocks" in box.locator(".nbw-health-none-rms").inner_text()
        assert not box.locator(".nbw-health-rms").is_visible()
        assert box.locator(".nbw-health-max_logit .main-svg").first.is_visible()
        assert not errors, errors


def test_health_panel_says_why_when_the_probe_is_off(browser, tmp_path):
    """A model with no attention, no blocks and no output layer (a bigram table: its
    logits are its embedding's rows): the probe turns off, and the panel's one line says
    why (not four empty plots, not a missing panel) above the training batch's logits.
    (With an output layer, a Linear onto the vocabulary, the probe stays on for the
    logits: `tests/test_families_more.py`, Mamba.)"""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 64))
    data = make_batches(6)

    def step_fn(m, b):
        return {"logits": m(b["input_ids"]), "labels": b["labels"], "mask": b["mask"]}

    mon = nbwatch.Monitor(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                          run_dir=tmp_path / "run")
    mon.start(step_fn, data, max_steps=4, eval_every=2, probe_batch=data[0], display=False)
    mon.wait()
    said = mon.events[mon.events.kind == "probe"].message.iloc[0]
    assert "no attention weights" in said
    with exported_page(browser, tmp_path / "run", tmp_path / "run.html") as (page, errors):
        box = page.locator("[data-panel=health]")
        box.locator(".nbw-health-why").wait_for(timeout=30_000)
        assert box.locator(".nbw-health-why").inner_text() == said
        assert box.locator(".nbw-health-none:visible").count() == 0
        # no probe figure; the one drawn is every training step's logits (the step_fn's)
        box.locator(".nbw-health-out .main-svg").first.wait_for(timeout=30_000)
        assert box.locator(".js-plotly-plot").count() == 1
        names = box.locator(".nbw-health-out").evaluate("e => e.data.map(t => t.name)")
        assert names == ["log Z", "max |logit|"]
        assert not errors, errors
