"""The Health panel's output-logits figure: every training step's log Z and max |logit|
(`train_logits/*`) drawn under the probe pass's points, one figure for one signal, from
the HTML export in headless Chromium; and the Metrics picker does not list them again."""

from __future__ import annotations

import pytest
import torch

import nbwatch
from nbwatch.demo import TinyGPT
from tests.browser.conftest import exported_page
from tests.conftest import make_batches

pytestmark = pytest.mark.browser


def test_health_draws_every_steps_logits_under_the_probes(browser, tmp_path):
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=64, layers=2, heads=2, ctx=32)  # d = V, as the demo's
    data = make_batches(8)

    def step_fn(m, b):  # {"loss": ...} only: the figures come from the output layer's hook
        return {"loss": nbwatch.masked_cross_entropy(m(b["input_ids"]), b["labels"],
                                                     b["mask"]), "mask": b["mask"]}

    mon = nbwatch.Monitor(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                          run_dir=tmp_path / "run")
    mon.start(step_fn, data, max_steps=8, eval_every=4, probe_batch=data[0], display=False)
    mon.wait()
    df = mon.df
    steps = int(df["train_logits/log_z"].notna().sum())
    assert steps == 7  # the hook is set once step 1 handed no logits
    with exported_page(browser, tmp_path / "run", tmp_path / "run.html") as (page, errors):
        box = page.locator("[data-panel=health]")
        box.locator(".nbw-health-out .main-svg").first.wait_for(timeout=30_000)
        drawn = box.locator(".nbw-health-out").evaluate(
            "e => Object.fromEntries(e.data.map("
            "t => [t.name, t.y.filter(Number.isFinite).length]))")
        assert drawn == {"log Z": steps, "max |logit|": steps,
                         "log Z, probe": 2, "max |logit|, probe": 2}
        assert not box.locator(".nbw-health-none-out").is_visible()  # nothing missing
        assert box.locator(".nbw-health-entropy .main-svg").first.is_visible()
        listed = page.locator("[data-panel=metrics]").inner_text()
        assert "grad_norm/" in listed and "train_logits" not in listed
        assert not errors, errors
