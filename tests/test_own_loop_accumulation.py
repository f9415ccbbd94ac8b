"""Gradient accumulation in a loop of one's own: `mon.log(loss=[l1, ..., lk])` records the
step's mean loss, as start(accumulate=k) and the Trainer do; one forward's loss handed over
for a step of k backward passes (the last micro-batch's, or its `loss / k`) is recorded as
given and said once a run, with the fix; a loss that may be the step's own is not
questioned."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

import nbwatch
from nbwatch.demo import TinyGPT, masked_cross_entropy

from .conftest import make_batches

K, STEPS = 4, 3


def loop(tmp_path, log, k: int = K):
    """A loop of k micro-batches per step, each backpropagated as `loss / k`; `log(mon,
    losses, graphs)` calls mon.log with the step's micro-batches' losses (detached, and as
    computed). Returns the recorded loss/train, each step's mean by hand, the warnings
    about the loss and the run's events."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = itertools.cycle(make_batches())
    hand = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False) as mon:
            for _ in range(STEPS):
                losses, graphs = [], []
                for _ in range(k):
                    b = next(batches)
                    loss = masked_cross_entropy(model(b["input_ids"]), b["labels"], b["mask"])
                    (loss / k).backward()
                    losses.append(loss.detach())
                    graphs.append(loss)
                opt.step()
                opt.zero_grad()
                hand.append(sum(float(x) for x in losses) / k)
                log(mon, losses, graphs)
    run = nbwatch.open_run(tmp_path / "r")
    said = [str(w.message) for w in caught if "loss/train" in str(w.message)]
    return run.df["loss/train"].tolist(), hand, said, run.events


@pytest.mark.parametrize("given", ["tensors", "floats"])
def test_a_list_of_micro_batch_losses_is_recorded_as_the_steps_mean(tmp_path, given):
    def log(mon, losses, graphs):
        mon.log(loss=losses if given == "tensors" else [float(x) for x in losses])

    recorded, hand, said, _ = loop(tmp_path, log)
    assert recorded == pytest.approx(hand, rel=1e-6)  # the mean of the four, by hand
    assert not said


@pytest.mark.parametrize("shape", ["last", "divided"])
def test_one_forwards_loss_for_an_accumulated_step_is_said_once_with_the_fix(tmp_path, shape):
    """`mon.log(loss=loss)` (the last micro-batch's) and `mon.log(loss=loss / K)` (nanoGPT's
    loop: what was backpropagated, K× too small): recorded as given, said once a run."""
    def log(mon, losses, graphs):
        mon.log(loss=graphs[-1] / K if shape == "divided" else graphs[-1])

    recorded, hand, said, events = loop(tmp_path, log)
    assert len(said) == 1  # once a run, not once a step
    assert f"{K} backward passes" in said[0] and "mon.log(loss=[l1, l2, l3, ...])" in said[0]
    assert f"{K}x too small" in said[0]
    feed = events[events["message"].str.startswith("loss/train: mon.log(loss=...)")]
    assert len(feed) == 1 and feed["severity"].iloc[0] == "warning"
    scale = K if shape == "divided" else 1
    assert recorded[0] * scale != pytest.approx(hand[0], rel=1e-6)  # one micro-batch's


@pytest.mark.parametrize("shape", ["detached_mean", "graph_sum", "stacked_mean"])
def test_a_loss_that_may_be_the_steps_own_is_not_questioned(tmp_path, shape):
    """build-nanogpt's running total of detached losses, a sum or stack of the micro-batches'
    losses: the step's mean, recorded without a word."""
    def log(mon, losses, graphs):
        mon.log(loss={"detached_mean": sum(losses) / K, "graph_sum": sum(graphs) / K,
                      "stacked_mean": torch.stack(graphs).mean()}[shape])

    recorded, hand, said, _ = loop(tmp_path, log)
    assert recorded == pytest.approx(hand, rel=1e-6)
    assert not said


@pytest.mark.parametrize("given", ["graph", "detached"])
def test_sams_two_backward_passes_on_one_batch_take_the_advice_given(tmp_path, given):
    """SAM: a backward at the weights, one at the perturbed weights, on one batch. Its
    first loss is the step's own; the warning says how to hand it over unquestioned."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False) as mon:
            for _ in range(STEPS):
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                with torch.no_grad():  # climb to the worst weights nearby, and back after
                    eps = [0.05 * p.grad / (p.grad.norm() + 1e-12) for p in model.parameters()]
                    for p, e in zip(model.parameters(), eps):
                        p.add_(e)
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                with torch.no_grad():
                    for p, e in zip(model.parameters(), eps):
                        p.sub_(e)
                opt.step()
                opt.zero_grad()
                mon.log(loss=loss if given == "graph" else loss.detach())
    said = [str(w.message) for w in caught if "loss/train" in str(w.message)]
    if given == "graph":
        assert len(said) == 1 and "hand over loss.detach()" in said[0]
    else:
        assert not said


def test_a_step_of_one_backward_pass_is_not_questioned(tmp_path):
    recorded, hand, said, _ = loop(tmp_path, lambda mon, losses, graphs: mon.log(
        loss=graphs[-1]), k=1)
    assert recorded == pytest.approx(hand, rel=1e-6) and not said


def test_a_closures_backward_passes_are_the_steps_own(tmp_path):
    """LBFGS calls its closure (a backward each) many times inside one step: no accumulation."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.LBFGS(model.parameters(), max_iter=5)
    x, y = torch.randn(16, 4), torch.randn(16, 1)

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False) as mon:
            for _ in range(STEPS):
                mon.log(loss=opt.step(closure))
    assert not [w for w in caught if "loss/train" in str(w.message)]


def test_an_empty_or_bad_list_of_losses_is_refused(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    b = make_batches()[0]
    with nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False) as mon:
        masked_cross_entropy(model(b["input_ids"]), b["labels"], b["mask"]).backward()
        opt.step()
        with pytest.raises(ValueError, match="loss is an empty list"):
            mon.log(loss=[])
        with pytest.raises(ValueError, match=r"loss\[1\] has shape \(2,\)"):
            mon.log(loss=[torch.tensor(1.0), torch.ones(2)])
        mon.log(loss=[torch.tensor(1.0), 3])
    assert nbwatch.open_run(tmp_path / "r").df["loss/train"].tolist() == [2.0]


def test_a_step_a_grad_scaler_skipped_lends_its_backward_to_no_other(tmp_path):
    """fp16 with a GradScaler, no accumulation: an overflow skips `optimizer.step()` (as the
    first steps often do while the scale settles); that step's backward is no micro-batch of
    the next step, which is not said to be accumulated."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    batches = itertools.cycle(make_batches())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False,
                             scaler=scaler) as mon:
            for i in range(STEPS):
                b = next(batches)
                loss = masked_cross_entropy(model(b["input_ids"]), b["labels"], b["mask"])
                scaler.scale(loss).backward()
                if i == 0:  # an overflow: the scaler skips this step
                    next(model.parameters()).grad.fill_(float("inf"))
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
                mon.log(loss=loss)
    assert scaler.get_scale() < 2.0**16  # the first step was skipped
    assert not [w for w in caught if "loss/train" in str(w.message)]


def test_the_steps_mean_copies_nothing_from_the_host_to_the_device(monkeypatch):
    """`loss=[l1, 2.5, l3]` (a number, a CPU tensor among device ones): a host value copied
    to the device (`torch.tensor(v, device=...)`, `.to(device)`) waits there for every
    queued kernel on CUDA, on the step path. The meta device stands in for a GPU here."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from nbwatch.monitor.accumulation import step_mean

    crossed = []

    class Copies(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ins = {t.device.type for t in tree_leaves((args, kwargs))
                   if isinstance(t, torch.Tensor)}
            if "cpu" in ins and any(isinstance(t, torch.Tensor) and t.device.type != "cpu"
                                    for t in tree_leaves(out)):
                crossed.append(str(func))
            return out

    made = torch.tensor

    def tensor(*args, **kwargs):
        if kwargs.get("device") is not None:
            crossed.append(f"torch.tensor(..., device={kwargs['device']})")
        return made(*args, **kwargs)

    monkeypatch.setattr(torch, "tensor", tensor)
    on_device = [torch.ones((), device="meta"), torch.zeros((), device="meta")]
    with Copies():
        got = step_mean(on_device, [2.5])
        host = step_mean([torch.tensor(1.0), torch.tensor(2.0)], [3.0])
        mixed = step_mean([on_device[0], torch.tensor(4.0)], [])
    assert not crossed
    assert got.device.type == "meta" and got.shape == () and mixed.device.type == "meta"
    assert host == 2.0
    assert step_mean([torch.tensor(1.0), torch.tensor(4.0)], [1.0]) == 2.0


def test_a_dropped_monitor_leaves_no_hook_on_the_models_weight(tmp_path):
    """A cell that makes the optimizer and the Monitor, run again on the same model: each
    Monitor's backward count left its hook on the weight for ever (one more Python call a
    backward pass per re-run); a dropped Monitor's goes with it."""
    import gc

    model = torch.nn.Linear(4, 1)
    hooks = lambda: len(model.weight._post_accumulate_grad_hooks or {})  # noqa: E731
    for i in range(3):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with nbwatch.Monitor(model, opt, run_dir=tmp_path / str(i), display=False) as mon:
            for _ in range(2):
                model(torch.randn(8, 4)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
                mon.log(loss=1.0)
        assert hooks() == 1  # this Monitor's, while it lives
        del mon, opt
        gc.collect()
    assert hooks() == 0


def test_a_list_of_x_y_micro_batches_counts_each_ones_samples(tmp_path):
    """`log(loss, batch=[(x1, y1), (x2, y2)])` after a backward pass each: the step's
    samples are both micro-batches' rows (it counted the first's alone); the same list
    after one backward pass is one batch of two parts (two views of a pair), its first
    tensor's rows."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False) as mon:
        for step, rows in enumerate([(3, 2), (1, 4), (2, 2)], start=1):
            parts = [(torch.randn(n, 4), torch.randn(n, 1)) for n in rows]
            backwards = len(parts) if step < 3 else 1
            losses = []
            for x, y in parts[:backwards]:
                loss = torch.nn.functional.mse_loss(model(x), y) / backwards
                loss.backward()
                losses.append(loss.detach())
            opt.step()
            opt.zero_grad()
            mon.log(loss=losses if backwards > 1 else losses[0], batch=parts)
        df = mon.df
    samples = (df["throughput/samples_per_s"] * df["time/step"]).round(6)
    assert samples.loc[2] == 1 + 4
    assert samples.loc[3] == 2  # one batch: its first tensor's rows (parts[0][0])
