"""On an accelerator a step's figures are copied at its end and read at a later boundary,
no host sync a step (recorder/host_copy.py, step_end.py). CI has no GPU, so these tests
run that order on the CPU (`DEFER_ON_CPU`) and hold it to the record of the same run read
at once: the same figures, histograms, evals, alerts and post-mortems, and nothing lost
at a stop or a failure."""

from __future__ import annotations

import itertools
import math
import threading

import numpy as np
import pytest
import torch

import nbwatch
from nbwatch.demo import make_demo, masked_cross_entropy
from nbwatch.recorder import host_copy, step_end
from tests.conftest import own_step, until

TIMED = ("time/", "throughput/", "system/")  # wall-clock figures: never equal twice
# the rules on those clocks: whether they fire depends on the machine's load, not the run
TIMED_RULES = ("throughput_drop", "data_bottleneck", "straggler")


def defer_on_cpu(monkeypatch, on: bool) -> list:
    """Run the accelerator's order (`on`); returns the steps read at a later boundary than
    their own end, as they come."""
    deferred: list[int] = []
    monkeypatch.setattr(host_copy, "DEFER_ON_CPU", on)
    complete = step_end.complete

    def completing(rec, step, *a, **k):
        if rec.step > step:
            deferred.append(step)
        return complete(rec, step, *a, **k)

    monkeypatch.setattr(step_end, "complete", completing)
    return deferred


def figures(run) -> tuple:
    """What a run recorded, less its clocks."""
    df = run.df
    df = df[[c for c in df.columns if not c.startswith(TIMED)]]
    hists = {n: run.histograms(n) for n in run.reader.histogram_names()}
    ev = run.events
    ev = ev[~ev.message.str.startswith(TIMED_RULES)]
    return df, hists, list(zip(ev.step, ev.kind, ev.severity)), run.spikes


def same(a: tuple, b: tuple, until: int | None = None) -> None:
    """The same record; with `until`, up to that step only (a rule's lasting action taken
    where the step is read, which one order does a step later, parts the runs there)."""
    if until is not None:
        a, b = (upto(x, until) for x in (a, b))
    df_a, hist_a, ev_a, spikes_a = a
    df_b, hist_b, ev_b, spikes_b = b
    assert sorted(df_a.columns) == sorted(df_b.columns)  # in the order they came
    # a clip's factor: a host float on the CPU, float32 on the device (the GPU's order)
    exact = [c for c in df_a.columns if c != "grad_norm/clipped"]
    np.testing.assert_array_equal(df_a[exact].to_numpy(), df_b[exact].to_numpy())
    np.testing.assert_allclose(df_a["grad_norm/clipped"], df_b["grad_norm/clipped"], rtol=1e-6)
    assert hist_a.keys() == hist_b.keys()
    for name, (steps, edges, counts) in hist_a.items():
        steps_b, edges_b, counts_b = hist_b[name]
        assert list(steps) == list(steps_b) and len(steps) > 0, name
        np.testing.assert_array_equal(counts, counts_b)
        assert all(np.array_equal(x, y) for x, y in zip(edges, edges_b))
    assert ev_a == ev_b
    cols = ["step", "loss", "batches", "first", "lead"]
    assert spikes_a[cols].to_dict("records") == spikes_b[cols].to_dict("records")


def upto(run: tuple, step: int) -> tuple:
    df, hists, events, spikes = run
    return (df.loc[:step], {n: tuple(x[: int(np.searchsorted(h[0], step, "right"))]
                                     for x in h) for n, h in hists.items()},
            [e for e in events if e[0] < step or (e[0] == step and e[1] == "alert")],
            spikes[spikes.step <= step])


def demo_run(tmp_path, name: str, defer: bool, monkeypatch, spike_at: int = 0,
             fail_at: int = 0, steps: int = 60):
    """The demo's model, small: masks, logits, weight and length histograms every 10
    steps, an eval every 20, a checkpoint every 25; the loss ×30 at `spike_at`, the step_fn
    raising at `fail_at`."""
    deferred = defer_on_cpu(monkeypatch, defer)
    demo = make_demo(d=32, layers=2, heads=2, ctx=32, batch_size=4, lr=1e-3, max_steps=steps)
    calls = itertools.count(1)

    def step_fn(m, b):
        i = next(calls)
        if i == fail_at:
            raise RuntimeError("a bad batch")
        logits = m(b["input_ids"])
        loss = masked_cross_entropy(logits, b["labels"], b["mask"])
        return {"loss": loss * 30 if i == spike_at else loss, "logits": logits,
                "mask": b["mask"]}

    def val_fn(m):
        with torch.no_grad():
            b = demo.val[0]
            return masked_cross_entropy(m(b["input_ids"]), b["labels"], b["mask"]).item()

    mon = nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler,
                          run_dir=tmp_path / name)
    mon.start(step_fn, itertools.cycle(demo.train), max_steps=steps, val_fn=val_fn,
              eval_every=20, hist_every=10, checkpoint_every=25, display=False)
    return mon, deferred


@pytest.mark.parametrize("spike_at", [0, 57])
def test_a_run_copied_a_step_later_records_what_one_copied_at_once_does(
        tmp_path, monkeypatch, spike_at):
    runs = []
    for defer in (False, True):
        mon, deferred = demo_run(tmp_path, f"d{defer}", defer, monkeypatch, spike_at=spike_at)
        mon.wait()
        assert mon.state == "finished", mon.error
        # every step is read at the next boundary, a histogram step's (1, every 10)
        # included, but those that read the device at their own end: an eval (every 20),
        # a checkpoint (every 25)
        reads_at_once = {*range(20, 61, 20), 25, 50}
        assert deferred == ([s for s in range(1, 60) if s not in reads_at_once]
                            if defer else [])
        runs.append(figures(nbwatch.open_run(tmp_path / f"d{defer}")))
    df, _, events, spikes = runs[1]
    assert df.index.tolist() == list(range(1, 61))  # every step once
    assert "data/seq_len" in runs[1][1] and len(runs[1][1]) > 3, runs[1][1].keys()
    assert df["loss/val"].notna().sum() == 3 and df["train_logits/log_z"].notna().all()
    assert len(spikes) == (1 if spike_at else 0), spikes  # (its step: less the dry run's)
    assert (25, "checkpoint", "info") in events
    if not spike_at:
        same(*runs)
        return
    # the spike's step is clipped on the device in either order (grad_explosion's limit);
    # the lasting clip its alert sets acts from the step after it is read: one step later
    # in the accelerator's order
    (at,) = [s for s, kind, severity in events if kind == "alert" and severity == "critical"]
    same(*runs, until=at)
    for (df, *_), late in zip(runs, (1, 2)):
        assert df.loc[at, "grad_norm/clipped"] <= 1.0 + 1e-5 < df.loc[at, "grad_norm/global"]
        assert (df.loc[at + late:, "grad_norm/clipped"] <= 1.0 + 1e-5).all()


def test_a_run_that_fails_keeps_its_last_step_copied_a_step_later(tmp_path, monkeypatch):
    """The step before the failure waits for a copy that never comes: the failure's end
    records it (its figures, as a run copied at once has them)."""
    runs = []
    for defer in (False, True):
        mon, _ = demo_run(tmp_path, f"d{defer}", defer, monkeypatch, fail_at=33)
        with pytest.raises(RuntimeError, match="a bad batch"):
            mon.wait()
        assert mon.state == "failed"
        runs.append(figures(nbwatch.open_run(tmp_path / f"d{defer}")))
    steps = runs[1][0].index.tolist()
    assert steps == list(range(1, len(steps) + 1)) and len(steps) > 25
    same(*runs)


def test_a_stopped_run_records_each_step_once(tmp_path, monkeypatch):
    deferred = defer_on_cpu(monkeypatch, True)
    demo = make_demo(d=32, layers=2, heads=2, ctx=32, batch_size=4)
    stop_at = 17

    def step_fn(m, b):
        if mon.step == stop_at - 1:
            mon.stop()  # taken at this step's boundary
        return {"logits": m(b["input_ids"]), "labels": b["labels"], "mask": b["mask"]}

    mon = nbwatch.Monitor(demo.model, demo.optimizer, run_dir=tmp_path / "r")
    # update ratios every step: figures taken after the optimizer step, so each step's
    # wait for the next step's copy (start() copies the rest with its own gradients)
    mon.start(step_fn, itertools.cycle(demo.train), max_steps=100, update_every=1,
              display=False).wait()
    assert mon.state == "stopped", mon.error
    df = nbwatch.open_run(tmp_path / "r").df
    assert df.index.tolist() == list(range(1, stop_at + 1))
    # all but the last (the stop reads it at once), the first (a histogram step) included
    assert deferred == list(range(1, stop_at))
    assert df[["loss/train", "update_ratio/head", "tokens/real"]].notna().all().all()


def test_an_own_loop_copied_a_step_later_records_the_same(tmp_path, monkeypatch):
    """`mon.log(loss=..., mask=..., logits=...)`: the loss goes with the next step's
    gradient copy, as on a GPU."""
    runs = []
    for defer in (False, True):
        deferred = defer_on_cpu(monkeypatch, defer)
        demo = make_demo(d=32, layers=2, heads=2, ctx=32, batch_size=4)
        m, opt = demo.model, demo.optimizer
        with nbwatch.Monitor(m, opt, run_dir=tmp_path / f"d{defer}", hist_every=10,
                             display=False) as mon:
            for b in itertools.islice(itertools.cycle(demo.train), 30):
                own_step(mon, m, opt, b)
        runs.append(figures(nbwatch.open_run(tmp_path / f"d{defer}")))
        assert deferred == (list(range(1, 30)) if defer else [])  # histogram steps too
    assert runs[1][0].index.tolist() == list(range(1, 31))
    assert runs[1][0]["train_logits/log_z"].notna().all()
    same(*runs)


def fit_both_orders(tmp_path, monkeypatch, fit, waits: int) -> list:
    """`fit(run_dir)` (a framework's run handle) in each order, `waits` steps waiting in
    the accelerator's; their figures."""
    runs = []
    for defer in (False, True):
        deferred = defer_on_cpu(monkeypatch, defer)
        run = fit(tmp_path / f"d{defer}")
        run.wait()
        assert run.state == "finished", run.error
        assert len(deferred) >= waits if defer else not deferred
        runs.append(figures(nbwatch.open_run(tmp_path / f"d{defer}")))
    assert runs[1][0]["loss/val"].notna().sum() == 2
    return runs


def test_the_trainer_copied_a_step_later_records_the_same(tmp_path, monkeypatch):
    """Under the Hugging Face Trainer (its loss comes after the optimizer step), with an
    eval every 10 steps."""
    pytest.importorskip("transformers")
    import nbwatch.hf
    from tests.test_hf import make_trainer

    same(*fit_both_orders(tmp_path, monkeypatch, lambda d: nbwatch.hf.start(
        make_trainer(d.with_name(f"out_{d.name}")), run_dir=d, display=False,
        monitor={"hist_every": 10}), waits=14))


def test_lightning_copied_a_step_later_records_the_same(tmp_path, monkeypatch):
    pytest.importorskip("lightning.pytorch")
    import nbwatch.lightning
    from tests.test_lightning import TinyModule, loader, make_trainer

    def fit(d):
        torch.manual_seed(0)
        return nbwatch.lightning.start(
            make_trainer(d.with_name(f"pl_{d.name}")), TinyModule(),
            train_dataloaders=loader(16), val_dataloaders=loader(2, seed=1), run_dir=d,
            display=False)

    same(*fit_both_orders(tmp_path, monkeypatch, fit, waits=14))


def test_a_rewind_copied_a_step_later_keeps_the_same_line_and_branch(tmp_path, monkeypatch):
    """A rewind reloads a checkpoint while a step's figures wait for the next copy (update
    ratios every step: every step waits)."""
    runs, branches = [], []
    for defer in (False, True):
        deferred = defer_on_cpu(monkeypatch, defer)
        demo = make_demo(d=32, layers=2, heads=2, ctx=32, batch_size=4, lr=1e-3)
        data = [dict(b, pos=i) for i, b in
                enumerate(itertools.islice(itertools.cycle(demo.train), 120))]
        mon = nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler,
                              run_dir=tmp_path / f"d{defer}")

        def step(model, batch, mon=mon, demo=demo):
            if int(batch["pos"]) == 50:
                mon.rewind(steps=15, skip=5)
            return demo.step_fn(model, batch)

        mon.start(step, data, max_steps=70, checkpoint_every=20, update_every=1,
                  display=False).wait()
        assert mon.state == "finished", mon.error
        assert len(deferred) >= (40 if defer else 0)
        runs.append(figures(nbwatch.open_run(tmp_path / f"d{defer}")))
        branches.append(mon.branches)
    assert runs[1][0].index.tolist() == list(range(1, 71))
    assert list(branches[1]["rewind/1/loss/train"].dropna().index) == list(range(21, 52))
    same(*runs)
    np.testing.assert_array_equal(branches[0].to_numpy(), branches[1][branches[0].columns])


@pytest.mark.parametrize("fault", ["nan", "explosion"])
def test_a_gradient_rules_action_acts_when_the_step_is_read_in_either_order(
        tmp_path, monkeypatch, fault):
    """Non-finite gradients at step 6 (nonfinite: skip, pause, checkpoint) or a gradient
    norm ×1e5 (grad_explosion with cut_lr): the skip acts on the device at step 6 itself;
    the pause, or the LR cut, acts where step 6's figures are read: before step 7 trains
    when read at once, before step 8 in the accelerator's order (one step late). The
    recorded LR is the one the optimizer used."""
    for defer in (False, True):
        deferred = defer_on_cpu(monkeypatch, defer)
        demo = make_demo(d=32, layers=2, heads=2, ctx=32, batch_size=4)
        m, opt = demo.model, demo.optimizer
        used: dict[int, float] = {}
        opt.register_step_post_hook(
            lambda o, a, k, used=used: used.__setitem__(len(used) + 1, o.param_groups[0]["lr"]))
        rules = {"grad_explosion": {"absolute": 1e3, "actions": ["cut_lr"], "lr_factor": 0.5}}
        mon = nbwatch.Monitor(m, opt, run_dir=tmp_path / f"{fault}{defer}", display=False,
                              alerts=rules)
        paused_after: list[int] = []

        def resume(mon=mon, used=used, paused_after=paused_after):
            until(lambda: mon.state == "paused", 30, "the pause")
            paused_after.append(len(used))  # optimizer steps taken when it held
            mon.resume()

        waiter = threading.Thread(target=resume, daemon=True)
        if fault == "nan":
            waiter.start()
        with mon:
            for i, b in enumerate(itertools.islice(itertools.cycle(demo.train), 9), 1):
                logits = m(b["input_ids"])
                loss = masked_cross_entropy(logits, b["labels"], b["mask"])
                loss.backward()
                if i == 6:
                    for p in m.parameters():
                        p.grad.mul_(math.nan if fault == "nan" else 1e5)
                opt.step()
                opt.zero_grad(set_to_none=True)
                mon.log(loss=loss, mask=b["mask"])
        df = nbwatch.open_run(tmp_path / f"{fault}{defer}").df
        late = 1 if defer else 0
        if fault == "nan":
            waiter.join(5)
            assert paused_after == [6 + late] and df.loc[6, "skipped"] == 1.0
            assert all(torch.isfinite(p).all() for p in m.parameters())
        else:
            assert used[7 + late] == used[6] / 2
            assert df["lr"].tolist() == [used[s] for s in df.index]
        # all but the first and the last, and the one the pause reads at once
        assert len(deferred) >= 6 if defer else not deferred


def test_an_error_at_the_last_steps_copy_fails_the_run_and_reaches_the_loop(
        tmp_path, monkeypatch):
    """On a GPU the last step's copy, at the run's end, is the first sync after its kernels:
    an asynchronous device error comes out there. Simulated: the copy raises once the loop
    is over. The `with` block raises it, and the run is recorded failed, not left running."""
    defer_on_cpu(monkeypatch, True)
    real, broken = host_copy.HostCopy.read, [False]

    def read(self, own=None):
        if broken[0]:
            raise RuntimeError("CUDA error: device-side assert triggered (simulated)")
        return real(self, own)

    monkeypatch.setattr(host_copy.HostCopy, "read", read)
    demo = make_demo(d=32, layers=2, heads=2, ctx=32, batch_size=4)
    m, opt = demo.model, demo.optimizer
    mon = nbwatch.Monitor(m, opt, run_dir=tmp_path / "r", display=False)
    with pytest.raises(RuntimeError, match="device-side assert"), mon:
        for b in itertools.islice(itertools.cycle(demo.train), 5):
            loss = masked_cross_entropy(m(b["input_ids"]), b["labels"], b["mask"])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            mon.log(loss=loss)
        broken[0] = True  # step 5's kernels failed
    assert mon.state == "failed"
    run = nbwatch.open_run(tmp_path / "r")
    ev = run.events
    assert run.df.index.tolist() == [1, 2, 3, 4]  # step 5's figures never reached the host
    assert ev[ev.kind == "error"].message.str.contains("device-side assert").any()
    assert ev[ev.kind == "state"].message.iloc[-1].startswith("run failed")


def test_a_cut_lr_a_step_rule_takes_is_the_lr_recorded_in_either_order(tmp_path, monkeypatch):
    """A loss spike whose rule cuts the LR: in the accelerator's order the spike's step is
    recorded (and the cut taken) inside the next step's copy; the LR recorded for each step
    is the one its optimizer step used."""
    for defer in (False, True):
        defer_on_cpu(monkeypatch, defer)
        demo = make_demo(d=32, layers=2, heads=2, ctx=32, batch_size=4, warmup=1)
        m, opt = demo.model, demo.optimizer
        used: list[float] = []
        mon = nbwatch.Monitor(m, opt, demo.scheduler, run_dir=tmp_path / f"d{defer}",
                              display=False,
                              alerts={"loss_spike": {"min_history": 20, "actions": ["cut_lr"]}})
        opt.register_step_pre_hook(  # after nbwatch's: the LR the step takes
            lambda o, a, k, used=used: used.append(o.param_groups[0]["lr"]))
        with mon:
            for i, b in enumerate(itertools.islice(itertools.cycle(demo.train), 40)):
                loss = masked_cross_entropy(m(b["input_ids"]), b["labels"], b["mask"])
                loss.backward()
                opt.step()
                demo.scheduler.step()
                opt.zero_grad()
                mon.log(loss=loss.detach() * (50 if i == 30 else 1))
        run = nbwatch.open_run(tmp_path / f"d{defer}")
        ev = run.events
        assert ev[ev.kind == "action"].message.str.contains("LR").any(), ev
        assert run.df["lr"].tolist() == used


class LaggingEvent:
    """A CUDA event's stand-in for a copy still under way: `query()` says no for `lag`
    asks, and until then the host buffer holds NaN (what a read before the copy landed
    would see); `synchronize()` lands it at once, as a wait for the device does."""

    def __init__(self, src: torch.Tensor, host: torch.Tensor, lag: int, seen: list):
        self.src, self.host, self.left, self.seen = src, host, lag, seen
        self.landed = False

    def query(self) -> bool:
        if self.left > 0:
            self.left -= 1
            self.seen.append("not yet")
            return False
        self._land()
        return True

    def synchronize(self) -> None:
        self.seen.append("waited")
        self._land()

    def _land(self) -> None:
        if not self.landed:
            self.host.copy_(self.src)
            self.landed = True


def lag_copies(monkeypatch, seen: list) -> None:
    """Each CPU share of a step's copy lands late, by 0 to 3 asks of its event."""
    lags = itertools.cycle([0, 2, 1, 3, 0, 1])
    make = host_copy._OnDevice

    def share(spans, host, event=None):
        if event is not None:
            return make(spans, host, event)
        late = torch.full_like(host, math.nan)
        return make(spans, late, LaggingEvent(host, late, next(lags), seen))

    monkeypatch.setattr(host_copy, "_OnDevice", share)


@pytest.mark.parametrize("loop", ["start", "own"])
def test_copies_that_land_late_record_what_one_copied_at_once_does(tmp_path, monkeypatch,
                                                                   loop):
    """A GPU's copy lands when the device gets there: a boundary that finds it under way
    waits for it (timed apart) or leaves it for later; nothing reads the host buffer
    before it landed (it holds NaN until then). Both loops record what a run copied at
    once does."""
    runs, seen = [], []
    for lagging in (False, True):
        name = f"lag{lagging}"
        if lagging:
            lag_copies(monkeypatch, seen)
        if loop == "start":
            mon, _ = demo_run(tmp_path, name, lagging, monkeypatch)
            mon.wait()
            assert mon.state == "finished", mon.error
        else:
            defer_on_cpu(monkeypatch, lagging)
            demo = make_demo(d=32, layers=2, heads=2, ctx=32, batch_size=4)
            m, opt = demo.model, demo.optimizer
            with nbwatch.Monitor(m, opt, run_dir=tmp_path / name, hist_every=10,
                                 display=False) as mon:
                for b in itertools.islice(itertools.cycle(demo.train), 30):
                    own_step(mon, m, opt, b)
        runs.append(figures(nbwatch.open_run(tmp_path / name)))
    assert "not yet" in seen and "waited" in seen  # the late paths were taken
    df = runs[1][0]
    assert df.index.tolist() == list(range(1, len(df) + 1))
    assert not df["loss/train"].isna().any() and not df["grad_norm/global"].isna().any()
    same(*runs)
