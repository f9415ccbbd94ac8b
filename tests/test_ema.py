"""An EMA of the weights given to the Monitor beside the model, frozen, in one module
(docs/loops.md): saved in every checkpoint and restored at a resume, while the run's
gradient figures stay the model's (no warning of weights left out of the optimizer)."""

from __future__ import annotations

import itertools
import warnings

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import nbwatch
from nbwatch.demo import make_demo


def test_an_ema_beside_the_model_is_checkpointed_and_resumed_with_it(tmp_path):
    torch.manual_seed(0)
    demo = make_demo(d=16, layers=1, heads=2, ctx=16)
    model, batches = demo.model, itertools.cycle(demo.train)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9)).requires_grad_(False)
    both = torch.nn.ModuleDict({"model": model, "ema": ema})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "not in the optimizer" for the EMA's weights
        mon = nbwatch.Monitor(both, opt, run_dir=tmp_path / "r", display=False)
    with mon:
        for step in range(1, 5):
            b = next(batches)
            loss = nbwatch.masked_cross_entropy(model(b["input_ids"]), b["labels"], b["mask"])
            loss.backward()
            opt.step()
            opt.zero_grad()
            ema.update_parameters(model)
            with torch.no_grad():
                val = nbwatch.masked_cross_entropy(
                    ema(b["input_ids"]), b["labels"], b["mask"]).item() if step == 4 else None
            mon.log(loss=loss, val=val)
    assert not [c for c in mon.df.columns if "ema" in c]
    averaged = ema.module.head.weight.detach().clone()
    assert not torch.equal(averaged, model.head.weight)

    ema.module.head.weight.data.zero_()  # a new process: the EMA is back from the checkpoint
    ema.n_averaged.zero_()
    with nbwatch.Monitor(both, opt, run_dir=tmp_path / "r", display=False, resume=True):
        assert torch.equal(ema.module.head.weight, averaged)
        assert int(ema.n_averaged) == 4
