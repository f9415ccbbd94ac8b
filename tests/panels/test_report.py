"""The export's summary table (panels/report.py)."""

import torch

import nbwatch
from nbwatch.demo import TinyGPT
from nbwatch.panels.report import summary
from tests.conftest import make_batches, tiny_step


def test_a_model_with_frozen_weights_says_how_many_train():
    """A LoRA or a frozen backbone: the summary says its trainable count beside the total
    (a model that trains every weight says the total alone)."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
    for p in model.blocks.parameters():
        p.requires_grad_(False)
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    mon = nbwatch.Monitor(model, opt, run_dir=None, display=False)
    mon.start(tiny_step, make_batches(), max_steps=2)
    mon.wait()
    meta = nbwatch.open_run(mon.run_dir).meta
    rows = dict(summary(meta, 2, None, None, 1.0))
    assert rows["model"] == f"TinyGPT ({total:,} parameters, {trained:,} trainable)"
    meta["run"]["trainable"] = total
    assert dict(summary(meta, 2, None, None, 1.0))["model"] == f"TinyGPT ({total:,} parameters)"
