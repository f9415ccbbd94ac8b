"""A loop of the user's own that clips its gradients itself before `optimizer.step()`:
nbwatch's figures are taken inside that step, after the clip, yet `grad_norm/global` and
`grad_norm/<layer>` must be the norms before it and `grad_norm/clipped` the norm after it,
whichever of torch's clipping functions the loop calls; where the norms before the clip
cannot be known, an event says so."""

from __future__ import annotations

import gc
import math
import subprocess
import sys
import textwrap
import warnings
from collections import defaultdict

import pytest
import torch
import torch.nn.utils.clip_grad as torch_clip_grad

# bound before any Monitor exists, as a notebook's first cell would
from torch.nn.utils import clip_grad_norm_

import nbwatch
from nbwatch.demo import TinyGPT

from .conftest import make_batches

MAX_NORM = 0.1
TORCH_FUNCTIONS = (torch_clip_grad._clip_grads_with_norm_, torch.nn.utils.clip_grads_with_norm_,
                   torch.nn.utils.clip_grad_norm_)


def setup(seed: int = 0):
    torch.manual_seed(seed)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, make_batches(n=8)


def backward(model, batch, scale: float = 1e4) -> None:
    """A loss large enough that its gradient norms are in the thousands."""
    logits = model(batch["input_ids"])
    loss = nbwatch.masked_cross_entropy(logits, batch["labels"], batch["mask"]) * scale
    loss.backward()
    return loss


def layer_norms(model) -> dict[str, float]:
    """The gradient norm of each layer (the module owning the parameters), as they are."""
    sq: dict[str, float] = defaultdict(float)
    for name, p in model.named_parameters():
        if p.grad is not None:
            sq[name.rpartition(".")[0] or "(root)"] += float(p.grad.double().square().sum())
    return {k: math.sqrt(v) for k, v in sq.items()}


def global_norm(model) -> float:
    return math.sqrt(sum(v * v for v in layer_norms(model).values()))


def check_before_clip(df, before: list[dict[str, float]], returned: list[float] | None = None,
                      max_norm: float | None = MAX_NORM) -> None:
    """Recorded norms are those before the clip (global and per layer), clipped after."""
    assert len(df) == len(before)
    for step, layers in enumerate(before, start=1):
        row = df.loc[step]
        for layer, norm in layers.items():
            assert row[f"grad_norm/{layer}"] == pytest.approx(norm, rel=1e-5), layer
        assert row["grad_norm/global"] == pytest.approx(
            math.sqrt(sum(v * v for v in layers.values())), rel=1e-5)
        if returned is not None:
            assert row["grad_norm/global"] == pytest.approx(returned[step - 1], rel=1e-5)
        assert row["grad_norm/global"] > 1000 * MAX_NORM  # the true norms: thousands
        if max_norm is not None:
            assert row["grad_norm/clipped"] <= max_norm * (1 + 1e-5)


def test_clip_grad_norm_in_a_foreground_loop_records_the_norms_before_it(tmp_path):
    model, opt, batches = setup()
    other = torch.nn.Linear(4, 4)  # a model no Monitor watches, clipped in the same loop
    before, returned = [], []
    with nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False) as mon:
        assert torch.nn.utils.clip_grads_with_norm_ is not TORCH_FUNCTIONS[1]  # watched
        for b in batches:
            loss = backward(model, b)
            before.append(layer_norms(model))
            returned.append(float(clip_grad_norm_(model.parameters(), MAX_NORM)))
            assert global_norm(model) == pytest.approx(MAX_NORM, rel=1e-4)  # it did clip
            other(torch.ones(2, 4)).sum().mul(1e3).backward()
            assert float(clip_grad_norm_(other.parameters(), 1.0)) > 1.0
            assert global_norm(other) == pytest.approx(1.0, rel=1e-4)  # torch's, untouched
            other.zero_grad()
            opt.step()
            opt.zero_grad()
            mon.log(loss=loss)
    assert mon.state == "finished" and mon.step == len(batches)
    check_before_clip(mon.df, before, returned)
    info = mon.events.query("kind == 'probe'")
    assert info.message.str.contains("clips its gradients itself").sum() == 1
    assert not (mon.events.severity == "warning").any()
    # the run closed: torch's functions are torch's again (once no Monitor that could still
    # record a loop of its own is alive: earlier tests' unused ones go with the collector)
    del mon
    gc.collect()
    assert (torch_clip_grad._clip_grads_with_norm_, torch.nn.utils.clip_grads_with_norm_,
            torch.nn.utils.clip_grad_norm_) == TORCH_FUNCTIONS


def _clip_grad_norm(params, max_norm):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated, still in use
        return torch.nn.utils.clip_grad_norm(params, max_norm)


def _total_then_clip(params, max_norm):
    params = list(params)
    total = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def _inf_norm(params, max_norm):
    return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=math.inf)


@pytest.mark.parametrize("clip", [_clip_grad_norm, _total_then_clip, _inf_norm],
                         ids=["clip_grad_norm", "get_total_norm+clip_grads_with_norm_",
                              "norm_type=inf"])
def test_every_route_of_torch_clipping(tmp_path, clip):
    model, opt, batches = setup()
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False)
    before, returned, after = [], [], []

    def train():
        for b in batches:
            loss = backward(model, b)
            before.append(layer_norms(model))
            returned.append(float(clip(model.parameters(), MAX_NORM)))
            after.append(global_norm(model))
            opt.step()
            opt.zero_grad()
            mon.log(loss=loss)

    mon.run(train)
    mon.wait()
    # an inf-norm clip returns (and bounds) the largest element, not the L2 norm recorded
    inf = clip is _inf_norm
    check_before_clip(mon.df, before, None if inf else returned, None if inf else MAX_NORM)
    assert mon.df["grad_norm/clipped"].tolist() == pytest.approx(after, rel=1e-5)


def test_two_clips_of_parts_of_the_model_with_their_own_limits(tmp_path):
    model, opt, batches = setup()
    emb = [p for n, p in model.named_parameters() if n.startswith(("tok", "pos", "emb"))]
    assert emb, [n for n, _ in model.named_parameters()]
    rest = [p for p in model.parameters() if all(p is not q for q in emb)]
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False)
    before = []

    def train():
        for b in batches:
            loss = backward(model, b)
            before.append(layer_norms(model))
            clip_grad_norm_(emb, 0.01)
            clip_grad_norm_(rest, MAX_NORM)
            opt.step()
            opt.zero_grad()
            mon.log(loss=loss)

    mon.run(train)
    mon.wait()
    check_before_clip(mon.df, before, max_norm=math.hypot(0.01, MAX_NORM))


def test_nbwatch_clip_over_the_loop_clip(tmp_path):
    model, opt, batches = setup()
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False, clip=0.02)
    before, returned = [], []

    def train():
        for b in batches:
            loss = backward(model, b)
            before.append(layer_norms(model))
            returned.append(float(clip_grad_norm_(model.parameters(), MAX_NORM)))
            opt.step()
            opt.zero_grad()
            mon.log(loss=loss)

    mon.run(train)
    mon.wait()
    check_before_clip(mon.df, before, returned, max_norm=0.02)
    assert mon.df["grad_norm/clipped"].tolist() == pytest.approx([0.02] * len(before), rel=1e-4)


def test_a_clip_on_each_micro_batch_is_said(tmp_path):
    """Clipping each accumulation micro-batch cuts partial sums, which no factor undoes:
    recorded is the norm before the step's last clip, and an event says why."""
    model, opt, batches = setup()
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False)
    returned = []

    def train():
        for i in range(0, len(batches), 2):
            losses = []
            for b in batches[i:i + 2]:
                losses.append(backward(model, b))
                n = clip_grad_norm_(model.parameters(), MAX_NORM)
            returned.append(float(n))
            opt.step()
            opt.zero_grad()
            mon.log(loss=losses)  # each micro-batch's (one alone is said to be one of two)

    mon.run(train)
    mon.wait()
    df = mon.df
    assert df["grad_norm/global"].tolist() == pytest.approx(returned, rel=1e-5)
    warned = mon.events.query("severity == 'warning'").message
    assert len(warned) == 1 and "before a later backward" in warned.iloc[0]


def test_gradients_changed_after_the_clip_are_said(tmp_path):
    """A backward after the clip: the norms before it cannot be known; recorded are those
    the optimizer got, and an event says so."""
    model, opt, batches = setup()
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False)
    got = []

    def train():
        for i in range(0, len(batches), 2):
            first = backward(model, batches[i])
            clip_grad_norm_(model.parameters(), MAX_NORM)
            loss = backward(model, batches[i + 1])
            got.append(global_norm(model))
            opt.step()
            opt.zero_grad()
            mon.log(loss=[first, loss])  # both backward passes' losses

    mon.run(train)
    mon.wait()
    df = mon.df
    assert df["grad_norm/global"].tolist() == pytest.approx(got, rel=1e-5)
    warned = mon.events.query("severity == 'warning'").message
    assert len(warned) == 1 and "cannot be known" in warned.iloc[0]


def test_unscale_then_clip_under_a_grad_scaler(tmp_path):
    """The AMP recipe: scale, backward, unscale_, clip, scaler.step: the norms before the
    clip are the unscaled ones clip_grad_norm_ returned."""
    model, opt, batches = setup()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False, scaler=scaler)
    before, returned = [], []

    def train():
        for b in batches:
            logits = model(b["input_ids"])
            loss = nbwatch.masked_cross_entropy(logits, b["labels"], b["mask"]) * 1e4
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            before.append(layer_norms(model))
            returned.append(float(clip_grad_norm_(model.parameters(), MAX_NORM)))
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            mon.log(loss=loss)

    mon.run(train)
    mon.wait()
    check_before_clip(mon.df, before, returned)
    assert not (mon.events.severity == "warning").any()


def test_torch_clipping_is_torchs_again_once_an_unused_monitor_is_collected(tmp_path):
    """A Monitor made and dropped without a run (a notebook cell run again) watched torch's
    clipping: once the collector takes it, torch's functions are torch's own again."""
    script = textwrap.dedent(f"""
        import gc, torch, nbwatch
        from torch.nn.utils import clip_grad
        torch_fn = clip_grad._clip_grads_with_norm_
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        mon = nbwatch.Monitor(model, opt, run_dir={str(tmp_path / "r")!r}, display=False)
        assert clip_grad._clip_grads_with_norm_ is not torch_fn  # watched
        held = [mon, model, opt]
        held.append(held)  # in a reference cycle, as a notebook's namespace makes them
        del mon, model, opt, held
        gc.collect()
        print(clip_grad._clip_grads_with_norm_ is torch_fn)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True"]


def test_clip_watch_alone_tells_usable_clips_from_partial_and_changed_ones():
    """The clip watch is a part of its own: its rules read without a Monitor."""
    from nbwatch.monitor.clip_watch import ClipWatch

    w = torch.nn.Parameter(torch.ones(3))
    w.grad = torch.full((3,), 2.0)
    watch = ClipWatch()
    watch.saw(5, [w], 1.0, torch.tensor(3.46))
    clips, note = watch.take(5)
    assert [c.max_norm for c in clips] == [1.0] and note is None  # one clip, usable
    assert watch.take(5) == ([], None)  # taken once
    watch.saw(6, [w], 1.0, torch.tensor(3.46))
    w.grad.mul_(0.5)  # the gradients changed after the clip (a backward, say)
    assert watch.take(6) == ([], "changed")
    watch.saw(7, [w], 1.0, torch.tensor(1.0))
    w.grad.add_(1.0)  # a clip on one micro-batch, a backward, a clip on the next
    watch.saw(7, [w], 1.0, torch.tensor(2.0))
    clips, note = watch.take(7)
    assert [float(c.total) for c in clips] == [2.0] and note == "partial"
    watch.saw(8, [w], 1.0, torch.tensor(1.0))
    assert watch.take(9) == ([], None)  # an earlier step's clip: its optimizer step skipped


def test_which_torch_function_to_watch_is_asked_of_torch_not_read_from_its_code():
    """nbwatch watches the function `clip_grad_norm_` scales the gradients through: found by
    one spied clip in this torch (the spy is gone after), never by reading bytecode names."""
    import torch.nn.utils.clip_grad as clip_grad

    from nbwatch.monitor.clip_watch import _clips_through, _targets

    real = clip_grad._clip_grads_with_norm_
    assert _clips_through(clip_grad, "_clip_grads_with_norm_")  # torch ≥ 2.6 does
    assert clip_grad._clip_grads_with_norm_ is real
    assert not _clips_through(clip_grad, "clip_grad_value_")  # a function it never calls
    assert [name for _, name, _ in _targets()][0] == "_clip_grads_with_norm_"
