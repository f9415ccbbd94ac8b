"""A backbone frozen when the run opens and unfrozen mid-run (a param group added, or its
weights' requires_grad turned on): from that step on, its layers are measured and the
model FLOPs a token costs count their weight gradients (6·N, not 4·N + 2·N_trained)."""

from __future__ import annotations

import itertools

import pytest
import torch

import nbwatch
from nbwatch.demo import make_demo

UNFREEZE = 4


def flops_per_token(df):
    return (df["throughput/tflops"] * 1e12 / df["throughput/tokens_per_s"]).dropna()


@pytest.mark.parametrize("how", ["requires_grad", "add_param_group"])
def test_unfreezing_the_backbone_mid_run_counts_its_gradients_from_that_step(tmp_path, how):
    torch.manual_seed(0)
    demo = make_demo(d=16, layers=2, heads=2, ctx=16)
    model, batches = demo.model, itertools.cycle(demo.train)
    backbone = list(model.blocks.parameters())
    for p in backbone:
        p.requires_grad_(False)
    head = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(model.parameters() if how == "requires_grad" else head, lr=1e-3)
    with nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False) as mon:
        for step in range(1, 8):
            if step == UNFREEZE:
                for p in backbone:
                    p.requires_grad_(True)
                if how == "add_param_group":
                    opt.add_param_group({"params": backbone, "lr": 1e-4})
            b = next(batches)
            mask = torch.ones_like(b["input_ids"])  # every row T long: T is the length
            loss = nbwatch.masked_cross_entropy(model(b["input_ids"]), b["labels"], mask)
            loss.backward()
            opt.step()
            opt.zero_grad()
            mon.log(loss=loss, mask=mask)
    run = nbwatch.open_run(tmp_path / "r")
    f = run.meta["run"]["flops"]
    n, trained, T = f["n_params"], f["n_trained"], b["input_ids"].shape[1]
    attention = 12 * f["layers"] * T * f["d_model"]
    fpt = flops_per_token(run.df)
    assert trained < n
    before, after = fpt[fpt.index < UNFREEZE], fpt[fpt.index >= UNFREEZE]
    assert before.to_numpy() == pytest.approx(4 * n + 2 * trained + attention, rel=1e-4)
    assert after.to_numpy() == pytest.approx(6 * n + attention, rel=1e-4)
    assert run.df.loc[UNFREEZE:, "grad_norm/blocks.0.attn.qkv"].notna().all()
