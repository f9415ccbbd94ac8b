"""A model or optimizer changed in the middle of a run (progressive unfreezing, a new head)
is measured as it is now: the norms, the clip and the non-finite skip cover it."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

import nbwatch
from nbwatch.demo import make_demo, masked_cross_entropy
from nbwatch.recorder import host_copy


def true_norm(model: nn.Module) -> float:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:  # a skipped step's gradients are dropped
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))


def run_loop(tmp_path, change, steps=12, clip=None, poison_at=None, all_params=False):
    """An own loop whose model (a TinyGPT) has its output layer frozen and left out of the
    optimizer (`all_params`: held by it all the same); `change(model, opt)` runs before
    step 6. Returns the Monitor and, per step, the loop's own norm of the gradients before
    the step and after it (after the clip)."""
    torch.manual_seed(0)
    demo = make_demo(d=32, layers=2, heads=2, ctx=32, batch_size=4)
    m = demo.model
    m.head.weight.requires_grad_(False)
    opt = torch.optim.SGD([p for p in m.parameters() if all_params or p.requires_grad],
                          lr=0.05)
    mon = nbwatch.Monitor(m, opt, run_dir=tmp_path / "r", display=False, clip=clip,
                          alerts={"nonfinite": {"actions": ["skip_step"]}})
    before, after = {}, {}

    def train():
        for step, b in enumerate(itertools.islice(itertools.cycle(demo.train), steps), 1):
            if step == 6:
                change(m, opt)
            loss = masked_cross_entropy(m(b["input_ids"]), b["labels"], b["mask"])
            loss.backward()
            if step == poison_at:
                m.head.weight.grad[0, 0] = math.nan
            before[step] = true_norm(m)
            opt.step()
            after[step] = true_norm(m)
            opt.zero_grad()
            mon.log(loss=loss)

    mon.run(train).wait()
    assert mon.state == "finished", mon.error
    return mon, before, after


def unfreeze(m, opt):
    m.head.weight.requires_grad_(True)
    opt.add_param_group({"params": [m.head.weight], "lr": 0.01})


def test_a_param_group_added_mid_run_is_measured_clipped_and_skipped(tmp_path):
    mon, before, after = run_loop(tmp_path, unfreeze, clip=0.3, poison_at=9)
    df = mon.df
    for step in (6, 7, 8, 10):
        assert math.isclose(df["grad_norm/global"][step], before[step], rel_tol=1e-4), step
        assert after[step] <= 0.3 * (1 + 1e-4), (step, after[step])  # the clip covers it
        assert df["grad_norm/head"][step] > 0, step
    assert df["grad_norm/head"].loc[:5].isna().all()  # not measured while frozen
    assert torch.isfinite(mon.model.head.weight).all()  # step 9's NaN was skipped
    said = mon.events[mon.events.message.str.contains("changed before step 6")]
    assert len(said) == 1 and "head" in said.message.iloc[0], mon.events.message.tolist()


def test_a_layer_unfrozen_in_place_is_measured_clipped_and_skipped_at_once(tmp_path):
    """`AdamW(model.parameters())` over a model frozen in part, then `requires_grad_()`:
    no hook tells, and it used to be seen only at the 30 s rescan (the norms, the clip
    and the non-finite skip left the layer out until then: its NaN reached the weights).
    The optimizer's frozen tensors are asked at each step."""
    mon, before, after = run_loop(tmp_path, lambda m, opt: m.head.weight.requires_grad_(True),
                                  clip=0.3, poison_at=9, all_params=True)
    df = mon.df
    for step in (6, 7, 8, 10):
        assert math.isclose(df["grad_norm/global"][step], before[step], rel_tol=1e-4), step
        assert after[step] <= 0.3 * (1 + 1e-4), (step, after[step])
        assert df["grad_norm/head"][step] > 0, step
    assert torch.isfinite(mon.model.head.weight).all()  # step 9's NaN was skipped
    said = mon.events[mon.events.message.str.contains("changed before step 6")]
    assert len(said) == 1 and "head" in said.message.iloc[0], mon.events.message.tolist()


def test_a_layer_replaced_mid_run_is_measured_as_the_new_one(tmp_path):
    def new_head(m, opt):
        m.head = nn.Linear(m.head.in_features, m.head.out_features, bias=False)
        opt.add_param_group({"params": list(m.head.parameters())})

    mon, before, _ = run_loop(tmp_path, new_head)
    df = mon.df
    for step in range(6, 13):
        assert math.isclose(df["grad_norm/global"][step], before[step], rel_tol=1e-4), step
        assert df["grad_norm/head"][step] > 0, step
    said = mon.events[mon.events.message.str.contains("changed before step 6")]
    assert len(said) == 1 and "head" in said.message.iloc[0], mon.events.message.tolist()
    # the new output layer's logits are watched from the step after the change (step 6's
    # forward ran before the pre-hook saw it): no note blaming compile or a fused loss
    assert df["train_logits/log_z"].loc[7:].notna().all()
    assert not mon.events.message.str.contains("torch.compile").any()


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_layer_without_a_gradient_has_no_norm_and_is_no_vanishing_gradient(tmp_path,
                                                                             set_to_none):
    """A module the forward never uses (a pooler a task head skips) and a layer frozen in
    place mid-run have no gradient: their norms read 0.0, and after 20 steps
    vanishing_gradients said their gradients were "1000× below the median layer". Now
    their norms are blank while they have none, one event says so, and no rule fires; the
    frozen layer leaves the measured ones at the next step, with a warning that says so
    (it waited for the 30 s rescan); the global norm is still the loop's own. The same
    where the loop keeps its gradients (`zero_grad(set_to_none=False)`): the frozen
    layer's stay, all zeros (they read 0.0 and fired the rule 20 steps later)."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 1)
            self.pooler = nn.Linear(16, 16)  # never called

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))

    torch.manual_seed(0)
    m = Net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    fired: list[str] = []
    own: dict[int, float] = {}
    with nbwatch.Monitor(m, opt, run_dir=tmp_path / "r", display=False,
                         on_alert=lambda ev: fired.append(ev.message)) as mon:
        for step in range(1, 61):
            if step == 20:
                m.b.requires_grad_(False)
            loss = m(torch.randn(16, 8)).pow(2).mean()
            loss.backward()
            own[step] = true_norm(m)
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
            mon.log(loss=loss)
    run = nbwatch.open_run(tmp_path / "r")
    df = run.df
    assert "grad_norm/pooler" not in df.columns
    assert df["grad_norm/b"].loc[:19].notna().all() and (df["grad_norm/b"].loc[:19] > 0).all()
    assert df["grad_norm/b"].loc[20:].isna().all()
    assert df[["grad_norm/a", "grad_norm/c"]].notna().all().all()
    assert df["grad_norm/global"].tolist() == pytest.approx([own[s] for s in df.index],
                                                            rel=1e-6)
    assert fired == []
    said = run.events[run.events.message.str.startswith("no gradient")]
    assert said.step.tolist() == [1] and "pooler" in said.message.iloc[0]
    changed = run.events[run.events.message.str.contains("changed before")]
    # kept zeros are seen where the step is read: in a GPU's order, a step later
    late = not set_to_none and host_copy.DEFER_ON_CPU
    assert changed.step.tolist() == [22 if late else 21]
    assert "(frozen: b;" in changed.message.iloc[0]


class _Walked(tuple):
    """A layers' parameter tuple that counts the walks over it."""

    walks = 0

    def __iter__(self):
        type(self).walks += 1
        return super().__iter__()


def test_frozen_zeros_walks_the_parameters_once_however_many_layers_read_0():
    """Under torchrun a layer frozen in place stays measured, so its zeros are looked at
    every step: one pass over the parameters, not one per layer at 0 (layers × params
    of host work a step on a model half frozen)."""
    from types import SimpleNamespace

    from nbwatch.probes.grads import Layers
    from nbwatch.recorder.layer_changes import LayerWatch

    n = 40
    params = _Walked(SimpleNamespace(requires_grad=i % 2 == 1) for i in range(2 * n))
    of = tuple(i // 2 for i in range(2 * n))  # a frozen and a trained parameter each
    layers = Layers(tuple(f"l{i}" for i in range(n)), params, of)
    frozen = Layers(layers.names, _Walked(SimpleNamespace(requires_grad=False)
                                          for _ in range(2 * n)), of)
    model = nn.Linear(2, 2).requires_grad_(False)
    watch = LayerWatch(model, torch.optim.SGD(model.parameters(), lr=0.1), layers,
                       distributed=True)
    try:
        _Walked.walks = 0
        assert watch.frozen_zeros(layers, [0.0] * n) == [0.0] * n  # trained: a real 0
        got = watch.frozen_zeros(frozen, [0.0] * (n - 1) + [1.0])
        assert got == [None] * (n - 1) + [1.0]
        assert _Walked.walks <= 2
        assert watch.changed(layers) is None  # torchrun: blanked only, no rank re-layers
    finally:
        watch.close()
