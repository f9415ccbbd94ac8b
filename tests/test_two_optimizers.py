"""Two optimizers on one model: an optimizer re-created mid-run is refused as what it is
(not with advice that cannot apply to it), and two optimizers stepped as one (Muon for the
hidden matrices, AdamW for the rest: docs/loops.md, 'Two optimizers on one model') are
watched whole: each group's LR, the gradient norm over every weight, Cut LR on both, both
states in the checkpoint and back at a resume."""

from __future__ import annotations

import itertools

import pytest
import torch

import nbwatch
from nbwatch.demo import make_demo


class Optimizers(torch.optim.Optimizer):
    """Several optimizers stepped as one, their parameter groups shared (docs/loops.md)."""

    def __init__(self, *optimizers):
        self.optimizers = optimizers
        groups = [g for o in optimizers for g in o.param_groups]
        super().__init__([{"params": g["params"]} for g in groups], {})
        self.param_groups = groups

    def step(self, closure=None):
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none=True):
        for o in self.optimizers:
            o.zero_grad(set_to_none)

    def state_dict(self):
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict):
        for o, s in zip(self.optimizers, state_dict["optimizers"]):
            o.load_state_dict(s)  # new group dicts: shared again below
        self.param_groups = [g for o in self.optimizers for g in o.param_groups]


def loss_of(model, b):
    return nbwatch.masked_cross_entropy(model(b["input_ids"]), b["labels"], b["mask"])


def test_an_optimizer_re_created_mid_run_is_refused_as_a_replacement(tmp_path):
    demo = make_demo(d=16, layers=1, heads=2, ctx=16)
    model, batches = demo.model, itertools.cycle(demo.train)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False) as mon:
        loss_of(model, next(batches)).backward()
        opt.step()
        opt.zero_grad()
        mon.log(loss=1.0)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)  # "a new LR"
        loss_of(model, next(batches)).backward()
        with pytest.raises(RuntimeError, match=r"re-created mid-run.*Change the LR in place"):
            opt.step()
        embeddings = torch.optim.Adam([model.tok_emb.weight], lr=1e-2)  # a part only
        with pytest.raises(RuntimeError, match="Two optimizers on one model") as got:
            embeddings.step()
        assert "re-created" not in str(got.value)


def test_two_optimizers_stepped_as_one_are_watched_whole(tmp_path):
    torch.manual_seed(0)
    demo = make_demo(d=16, layers=1, heads=2, ctx=16)
    model, batches = demo.model, itertools.cycle(demo.train)
    hidden = [p for n, p in model.named_parameters() if n.startswith("blocks.") and p.dim() == 2]
    rest = [p for p in model.parameters() if all(p is not h for h in hidden)]
    muon = torch.optim.Muon(hidden, lr=0.02)
    opt = Optimizers(muon, torch.optim.AdamW(rest, lr=1e-3))
    norms = []
    with nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False) as mon:
        for step in range(1, 5):
            loss = loss_of(model, next(batches))
            loss.backward()
            norms.append(float(torch.linalg.vector_norm(
                torch.stack([p.grad.norm() for p in model.parameters()]))))
            opt.step()
            opt.zero_grad()
            if step == 2:
                mon.scale_lr(0.5)  # applied at this step's log(): steps 3 and 4 at half
            mon.log(loss=loss)
    df = mon.df
    assert df["lr"].tolist() == pytest.approx([0.02, 0.02, 0.01, 0.01])
    assert df["lr/group1"].tolist() == pytest.approx([1e-3, 1e-3, 5e-4, 5e-4])
    assert df["grad_norm/global"].tolist() == pytest.approx(norms, rel=1e-5)
    momentum = muon.state[hidden[0]]["momentum_buffer"].clone()

    muon2 = torch.optim.Muon(hidden, lr=0.02)
    opt2 = Optimizers(muon2, torch.optim.AdamW(rest, lr=1e-3))
    with nbwatch.Monitor(model, opt2, run_dir=tmp_path / "r", display=False,
                         resume=True) as again:
        assert again.step == 4
        assert torch.equal(muon2.state[hidden[0]]["momentum_buffer"], momentum)
        loss = loss_of(model, next(batches))
        loss.backward()
        opt2.step()
        opt2.zero_grad()
        again.log(loss=loss)
    row = again.df.loc[5]  # the cut is the run's: both groups stay at half
    assert [row["lr"], row["lr/group1"]] == pytest.approx([0.01, 5e-4])
