"""The clip and the skip of a step, decided where the step is taken: on the host on a CPU,
on the device in a GPU's order (`DEFER_ON_CPU`): a fused optimizer takes nbwatch's clip as
its `grad_scale` and its skip as its `found_inf`, any other gets `_foreach_mul_` and
zeroed gradients. Each is held to torch's own `clip_grad_norm_` on a twin model."""

from __future__ import annotations

import contextlib
import copy
import itertools
import math

import pytest
import torch

import nbwatch
from nbwatch.demo import make_demo, masked_cross_entropy
from nbwatch.recorder import host_copy

STEPS = 6


def twins(fused: bool, kind=torch.optim.AdamW, **kw):
    demo = make_demo(d=32, layers=2, heads=2, ctx=32, batch_size=4)
    model = demo.model
    ref = copy.deepcopy(model)
    opts = [kind(m.parameters(), lr=1e-2, fused=fused, **kw) for m in (model, ref)]
    data = list(itertools.islice(itertools.cycle(demo.train), STEPS))
    return model, ref, opts, data


def deciding(opt, clip: float | None = None, skip: bool = True):
    """What `act` uses of a run (`clip_skip.Deciding`), with the run's own state objects."""
    from types import SimpleNamespace

    from nbwatch.controls import ControlState
    from nbwatch.recorder.state import InFlight

    return SimpleNamespace(opt=opt, flight=InFlight(), control=ControlState(clip=clip),
                           skip_nonfinite=skip)


def loss_of(m, b, poison: bool = False):
    loss = masked_cross_entropy(m(b["input_ids"]), b["labels"], b["mask"])
    return loss * math.nan if poison else loss


@pytest.mark.parametrize("gpu_order", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_the_clip_equals_torchs_clip_grad_norm(tmp_path, monkeypatch, fused, gpu_order):
    monkeypatch.setattr(host_copy, "DEFER_ON_CPU", gpu_order)
    # SGD: an update linear in the gradient, so float32 against float64 arithmetic of the
    # same clip factor stays at float32's precision (Adam divides by √v, and amplifies it)
    model, ref, (opt, ref_opt), data = twins(fused, torch.optim.SGD, momentum=0.9)
    norms = []
    for b in data:  # torch's way, first: no Monitor watches its clips
        loss_of(ref, b).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)))
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    with nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", clip=0.5, display=False) as mon:
        for b in data:
            loss = loss_of(model, b)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            mon.log(loss=loss)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    df = nbwatch.open_run(tmp_path / "r").df
    assert df["grad_norm/global"].tolist() == pytest.approx(norms, rel=1e-5)
    assert df["grad_norm/clipped"].tolist() == pytest.approx([min(n, 0.5) for n in norms],
                                                             rel=1e-5)
    assert not hasattr(opt, "found_inf") and not hasattr(opt, "grad_scale")  # taken back


@pytest.mark.parametrize("gpu_order", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_a_nonfinite_step_is_skipped_or_zeroed(tmp_path, monkeypatch, fused, gpu_order):
    """Step 3's loss is NaN. Read at once (a CPU) or by a fused optimizer, the step is
    skipped: the weights and the optimizer's state after it are those before it. A
    non-fused optimizer in a GPU's order gets zeroed gradients: finite weights, moved once
    by its momentum, and the alert says so."""
    monkeypatch.setattr(host_copy, "DEFER_ON_CPU", gpu_order)
    model, _, (opt, _), data = twins(fused)
    before = None
    with nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False,
                         alerts={"nonfinite": {"actions": ["skip_step"]}}) as mon:
        for i, b in enumerate(data, 1):
            if i == 3:
                before = [p.detach().clone() for p in model.parameters()]
            loss = loss_of(model, b, poison=i == 3)
            loss.backward()
            opt.step()
            if i == 3:
                after = [p.detach().clone() for p in model.parameters()]
            opt.zero_grad(set_to_none=True)
            mon.log(loss=loss)
    exact = fused or not gpu_order
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(torch.equal(x, y) for x, y in zip(before, after)) == exact
    run = nbwatch.open_run(tmp_path / "r")
    assert run.df.loc[3, "skipped"] == 1.0 and run.df["skipped"].fillna(0).sum() == 1
    (msg,) = run.events.query("kind == 'alert'").message
    assert ("zeroed" in msg) != exact and msg.startswith("nonfinite")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_device_skip_zeroes_nan_and_inf_and_leaves_a_good_step_bit_for_bit(dtype):
    """The foreach path's skip (`zero_unless`, decided on the device): a bad step's
    gradients become +0.0, NaN and inf included (NaN · 0 would stay NaN); a good step's
    are left exactly as they were, -0.0 and a transposed gradient included."""
    from nbwatch.recorder.clip_skip import by_device, zero_unless

    def grads():
        torch.manual_seed(0)
        odd = torch.tensor([1.5, math.nan, math.inf, -math.inf, -0.0, -2.25, 1e-40])
        return [odd.to(dtype), torch.randn(3, 4).to(dtype).t(),
                torch.randn(5, 5).to_sparse().to(dtype)]

    def bits(t):
        t = t.to_dense() if t.is_sparse else t
        return t.contiguous().view(torch.uint8)

    kept = grads()
    zero_unless(torch.tensor(True), by_device(kept))
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(kept, grads()))
    zeroed = grads()
    zero_unless(torch.tensor(False), by_device(zeroed))
    for g in zeroed:
        g = g.to_dense() if g.is_sparse else g
        assert torch.equal(bits(g), torch.zeros_like(bits(g)))  # +0.0: no NaN, no -0.0


def test_a_sparse_gradient_among_dense_ones_still_zeroes_them_in_one_op():
    """A group with a sparse gradient (`nn.Embedding(sparse=True)`) cannot view all its
    gradients' bits at once: the dense ones and the sparse one's values still go through
    one `_foreach_mul_`, not an op per gradient, and all of them are zeroed."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from nbwatch.recorder.clip_skip import by_device, zero_unless

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    grads = [torch.full((3, 4), math.nan), torch.randn(5, 5).to_sparse(),
             *[torch.full((8,), math.inf) for _ in range(10)]]
    with Ops() as ops:
        zero_unless(torch.tensor(False), by_device(grads))
    muls = [n for n in ops.names if "mul" in n]
    assert muls == ["aten._foreach_mul_.Tensor"], ops.names
    for g in grads:
        g = g.to_dense() if g.is_sparse else g
        assert torch.equal(g, torch.zeros_like(g))


@pytest.mark.parametrize("fused", [False, True])
def test_the_device_clip_and_skip_keep_to_a_gpus_device_rules(fused):
    """CI has no GPU, and on a CPU every tensor shares one device, so a CPU tensor given to
    a CUDA kernel (or a CUDA one read where a CPU one was meant) fails only on a GPU. Torch's
    FakeTensorMode applies CUDA's device rules without one: `act` on fake CUDA gradients,
    the clip, a clipping rule and the skip armed, a loss given, leaves every flag, the
    clip's `grad_scale` and the skip's `found_inf` on the gradients' device."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from nbwatch.recorder import clip_skip
    from nbwatch.recorder.clip_skip import act, by_device

    clip_skip._constant.cache_clear()  # no fake constant outlives its mode
    with FakeTensorMode(allow_non_fake_inputs=True), contextlib.ExitStack() as undo:
        undo.callback(clip_skip._constant.cache_clear)
        dev = torch.device("cuda:0")
        params = [torch.nn.Parameter(torch.randn(8, 8, device=dev)),
                  torch.nn.Parameter(torch.randn(8, device=dev))]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(params, lr=1e-3, fused=fused)
        grads = [p.grad for p in params]
        per_param = torch.stack(torch._foreach_norm(grads)).float()
        rec = deciding(opt, clip=1.0)
        flags, zeroing, handed = act(rec, per_param, by_device(grads),
                                     torch.tensor(2.0, device=dev), None,
                                     {"grad_explosion": (0.5, 0.25)})
        assert zeroing is not fused and handed is None
        assert {f.device for f in flags} == {dev}, [f.device for f in flags]
        assert len(flags) == 3  # total, the clip's factor, kept
        if fused:
            assert opt.grad_scale.device == dev and opt.found_inf.device == dev
        copied = host_copy.flat(flags)  # the copy's one cat, on the same device
        assert copied.device == dev and copied.dtype == torch.float32


@pytest.mark.parametrize("control", [None, 0.7])
def test_the_device_clip_takes_the_smallest_limit_of_every_rule_that_fires(control):
    """Two clipping rules fire on one step: the clip is the tighter one's, in either order
    of the rules (and the Clip control's where it is tighter still), as torch's own clip
    to that max_norm would be."""
    from nbwatch.recorder.clip_skip import COEF, act

    total = 10.0
    want = min(0.5, 3.0, control or math.inf) / (total + 1e-6)
    for limits in ({"a": (1.0, 0.5), "b": (2.0, 3.0)}, {"b": (2.0, 3.0), "a": (1.0, 0.5)},
                   {"a": (1.0, 0.5), "quiet": (20.0, 0.1)}):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
        rec = deciding(opt, clip=control, skip=False)
        flags, _, _ = act(rec, torch.tensor([total]), [[torch.ones(3)]], None, None, limits)
        assert float(flags[COEF]) == pytest.approx(want, rel=1e-6), limits


def test_the_scalers_figures_are_those_of_the_step_not_of_its_end():
    """A GradScaler changes its scale and found_inf in place (`update()`) before the step's
    end copies its flags to the host: the flags hold the values `act` was given."""
    from nbwatch.recorder.clip_skip import FOUND_INF, SCALE, act

    scale, found = torch.tensor(1024.0), torch.tensor(0.0)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    opt.grad_scale = scale
    rec = deciding(opt)
    flags, _, _ = act(rec, torch.tensor([2048.0]), [[torch.ones(3)]], None, found, {})
    scale *= 2  # what update() does in place
    found += 1
    read = host_copy.flat(flags).tolist()
    assert read[SCALE] == 1024.0 and read[FOUND_INF] == 0.0
