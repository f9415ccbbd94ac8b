"""A loop of the user's own: `Monitor.log()` once per optimizer step, run in a thread by
`Monitor.run()` or in the foreground, with the whole product (figures, controls, alerts,
checkpoints, resume). The loop is nanoGPT-style: AdamW, a LambdaLR warm-up, masked loss."""

from __future__ import annotations

import _thread
import math
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import nbwatch
from nbwatch.demo import TinyGPT

from .conftest import make_batches, until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def setup(seed: int = 0, warmup: int = 10):
    torch.manual_seed(seed)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    return model, opt, sched, make_batches()


class Loop:
    """A user's training loop: computes its own figures, calls mon.log, ignores its return."""

    def __init__(self, model, opt, sched, batches, mon, delay: float = 0.0):
        self.model, self.opt, self.sched, self.batches, self.mon = model, opt, sched, batches, mon
        self.delay = delay
        self.seen: list[dict] = []

    def __call__(self, steps: int | None = None, start: int = 0) -> None:
        i = start
        while steps is None or i < start + steps:
            b = self.batches[i % len(self.batches)]
            logits = self.model(b["input_ids"])
            loss = nbwatch.masked_cross_entropy(logits, b["labels"], b["mask"])
            loss.backward()
            norm = torch.linalg.vector_norm(
                torch.stack([p.grad.norm() for p in self.model.parameters()]))
            lr = self.opt.param_groups[0]["lr"]
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad(set_to_none=True)
            m = b["mask"].float()
            self.seen.append({"loss": loss.item(), "norm": norm.item(), "lr": lr,
                              "pad": 1 - (m.sum() / m.numel()).item()})
            if self.delay:
                time.sleep(self.delay)
            self.mon.log(loss=loss, mask=b["mask"])
            i += 1


def test_recorded_figures_equal_what_the_loop_computed(tmp_path):
    model, opt, sched, batches = setup()
    mon = nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "r", display=False)
    loop = Loop(model, opt, sched, batches, mon)
    mon.run(loop, 25)
    mon.wait()
    assert mon.state == "finished" and mon.step == 25
    df = mon.df
    assert list(df.index) == list(range(1, 26))
    for step, seen in enumerate(loop.seen, start=1):
        row = df.loc[step]
        assert row["loss/train"] == pytest.approx(seen["loss"], rel=1e-6)
        assert row["grad_norm/global"] == pytest.approx(seen["norm"], rel=1e-5)
        assert row["lr"] == pytest.approx(seen["lr"], rel=1e-12)  # the LR the step used
        assert row["data/padding_ratio"] == pytest.approx(seen["pad"], abs=1e-6)
    assert df["lr"].iloc[0] == pytest.approx(1e-4) and df["lr"].iloc[-1] == pytest.approx(1e-3)
    per_layer = [c for c in df if c.startswith("grad_norm/") and c not in
                 ("grad_norm/global", "grad_norm/clipped")]
    assert len(per_layer) >= 6
    # per-layer norms add up (in squares) to the global norm
    assert (df[per_layer] ** 2).sum(axis=1).pow(0.5).values == pytest.approx(
        df["grad_norm/global"].values, rel=1e-5)
    assert df["update_ratio/" + per_layer[0].split("/", 1)[1]].notna().any()
    assert {"time/step", "throughput/tokens_per_s", "data/seq_len_mean"} <= set(df)
    assert mon.events.query("kind == 'checkpoint'").message.str.contains("final").any()
    run = nbwatch.open_run(tmp_path / "r")
    assert run.histograms(f"weight/{per_layer[0].split('/', 1)[1]}")[0].tolist() == [1]


def test_pause_checkpoint_resume_stop_a_loop_that_ignores_log(tmp_path):
    model, opt, sched, batches = setup()
    mon = nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "r", display=False)
    loop = Loop(model, opt, sched, batches, mon, delay=0.005)
    mon.run(loop)  # runs for ever unless stopped
    until(lambda: mon.step >= 3, what="3 steps")
    mon.pause()
    until(lambda: mon.state == "paused", what="paused")
    frozen = mon.step
    time.sleep(0.4)
    assert mon.step == frozen and len(loop.seen) == frozen  # the loop itself is frozen
    mon.checkpoint()
    until(lambda: (mon.events.kind == "checkpoint").any(), what="checkpoint")
    ev = mon.events.query("kind == 'checkpoint'").iloc[0]
    ck = torch.load(ev.data["path"], weights_only=True)
    assert ck["step"] == frozen == ev.step
    probe = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
    probe.load_state_dict(ck["model"])  # loadable into a fresh model
    assert ck["scheduler"]["last_epoch"] == frozen and ck["optimizer"]["state"]
    mon.resume()
    until(lambda: mon.step >= frozen + 3, what="steps after resume")
    mon.stop()
    mon.wait()  # no exception: a stop is not a failure
    assert mon.state == "stopped"
    assert len(loop.seen) == mon.step  # ended at log(): no step ran past it
    last = mon.events.query("kind == 'checkpoint'").iloc[-1]
    assert "stop checkpoint" in last.message and last.step == mon.step
    assert nbwatch.open_run(tmp_path / "r").state == "stopped"


def test_a_loop_may_check_stopping_to_clean_up(tmp_path):
    model, opt, sched, batches = setup()
    mon = nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "r", display=False)
    cleaned = []

    def train():
        for i in range(10**6):
            if i == 3:
                until(lambda: mon.stopping, what="the stop")
            if mon.stopping:  # True as soon as stop() is asked
                cleaned.append(mon.step)
                return
            b = batches[i % len(batches)]
            nbwatch.masked_cross_entropy(model(b["input_ids"]), b["labels"],
                                         b["mask"]).backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            mon.log(loss=1.0)

    mon.run(train)
    until(lambda: mon.step >= 3)
    mon.stop()
    mon.wait()
    assert mon.state == "stopped" and cleaned == [3] and mon.step == 3
    assert mon.events.query("kind == 'checkpoint'").iloc[-1].step == mon.step


def test_clip_and_cut_lr_act_at_the_optimizer_step(tmp_path):
    model, opt, sched, batches = setup(warmup=1)
    mon = nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "r", display=False)
    loop = Loop(model, opt, sched, batches, mon, delay=0.003)
    mon.run(loop)
    until(lambda: mon.step >= 3)
    mon.pause()
    until(lambda: mon.state == "paused")
    mon.set_clip(1e-3)
    mon.scale_lr(0.5)
    until(lambda: (mon.events.kind == "action").sum() >= 3, what="actions")  # pause+2
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5e-3)  # between steps: half
    cut_at = mon.step
    mon.resume()
    until(lambda: mon.step >= cut_at + 5)
    mon.stop()
    mon.wait()
    df = mon.df
    after = df.loc[cut_at + 1:]
    assert (after["grad_norm/clipped"] <= 1e-3 * (1 + 1e-6)).all()
    assert (after["grad_norm/global"] > 1e-3).all()  # recorded before clipping
    assert after["lr"].values == pytest.approx(0.5e-3)  # LambdaLR did not undo the cut
    assert df.loc[cut_at, "lr"] == pytest.approx(1e-3)
    assert "lr_raw" not in sched.state_dict() and set(sched.state_dict()) >= {"base_lrs"}


@pytest.mark.parametrize("kind", ["closed_form", "chainable"])
def test_cut_lr_survives_every_kind_of_scheduler(tmp_path, kind):
    """`scale_lr` through the real hooks: the LR between steps reads factor × schedule,
    and the scheduler's state_dict is the plain one (picklable, checkpoints work)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    if kind == "closed_form":
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s)
    else:
        sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
    mon = nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / kind, display=False)
    lrs = []

    def train():
        for _ in range(8):
            model(torch.randn(2, 4)).square().mean().backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            mon.log(loss=0.0)
            lrs.append(opt.param_groups[0]["lr"])
            if len(lrs) == 3:
                mon.scale_lr(0.5)  # applied at the next log()

    with mon:
        train()
    expected = [0.9 ** s * (0.5 if s >= 4 else 1.0) for s in range(1, 9)]
    assert lrs == pytest.approx(expected, rel=1e-9)
    assert mon.df["lr"].tolist() == pytest.approx([0.9 ** s * (0.5 if s >= 4 else 1.0)
                                                   for s in range(8)], rel=1e-9)
    fresh = type(sched)(torch.optim.SGD(model.parameters(), lr=1.0),
                        **({"lr_lambda": lambda s: 0.9 ** s} if kind == "closed_form"
                           else {"gamma": 0.9}))
    assert set(sched.state_dict()) == set(fresh.state_dict())  # nothing of ours in it
    assert "step" not in vars(sched)  # the scheduler's own step(), not a patched one
    assert sched.get_last_lr() == pytest.approx([0.9 ** 8])  # the schedule itself


def test_foreground_loop_in_a_with_block(tmp_path):
    model, opt, sched, batches = setup()
    with nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "r", display=False) as mon:
        Loop(model, opt, sched, batches, mon)(12)
        assert mon.state == "running" and mon.step == 12
    assert mon.state == "finished"
    run = nbwatch.open_run(tmp_path / "r")
    assert run.state == "finished" and len(run.df) == 12


def test_stop_ends_a_foreground_loop_that_ignores_log(tmp_path):
    model, opt, sched, batches = setup()
    mon = nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "r", display=False)
    loop = Loop(model, opt, sched, batches, mon, delay=0.002)
    stopper = threading.Thread(target=lambda: (until(lambda: mon.step >= 5), mon.stop()))
    stopper.start()
    with mon:
        loop()  # for ever, but for the stop
    stopper.join()
    assert mon.state == "stopped" and len(loop.seen) == mon.step >= 5
    assert nbwatch.open_run(tmp_path / "r").state == "stopped"


def test_foreground_failure_is_recorded_with_traceback(tmp_path):
    model, opt, sched, batches = setup()
    mon = nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "r", display=False)
    with pytest.raises(ZeroDivisionError), mon:
        Loop(model, opt, sched, batches, mon)(4)
        raise ZeroDivisionError("division by zero")
    assert mon.state == "failed" and "ZeroDivisionError" in mon.traceback
    ev = mon.events
    assert "emergency checkpoint at step 4" in " ".join(ev.message)
    assert ev.query("kind == 'error'").message.iloc[0].startswith("ZeroDivisionError")


def test_a_failure_in_the_background_loop_is_recorded_and_reraised(tmp_path):
    model, opt, sched, batches = setup()
    mon = nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "r", display=False)
    loop = Loop(model, opt, sched, batches, mon)

    def train():
        loop(3)
        raise RuntimeError("data loader broke")

    mon.run(train)
    with pytest.raises(RuntimeError, match="data loader broke"):
        mon.wait()
    assert mon.state == "failed" and mon.step == 3
    assert nbwatch.open_run(tmp_path / "r").state == "failed"
    assert (mon.events.kind == "error").any()


def test_resume_continues_the_step_numbering_without_gap_or_duplicate(tmp_path):
    model, opt, sched, batches = setup()
    mon = nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "r", display=False,
                          checkpoint_every=5)
    loop = Loop(model, opt, sched, batches, mon)
    mon.run(loop, 12)  # checkpoints at 5, 10 and the final one at 12
    mon.wait()
    ck = torch.load(tmp_path / "r" / "checkpoints" / "step_00000010.pt", weights_only=True)
    (tmp_path / "r" / "checkpoints" / "step_00000012.pt").unlink()  # as if killed at 12

    model2, opt2, sched2, _ = setup(seed=1)
    mon2 = nbwatch.Monitor(model2, opt2, sched2, run_dir=tmp_path / "r", display=False,
                           resume=True)
    assert mon2.step == 10
    assert torch.equal(model2.state_dict()["head.weight"], ck["model"]["head.weight"])
    assert sched2.last_epoch == 10
    loop2 = Loop(model2, opt2, sched2, batches, mon2)
    mon2.run(loop2, 6, start=mon2.step)
    mon2.wait()
    df = nbwatch.open_run(tmp_path / "r").df
    assert list(df.index) == list(range(1, 17))
    assert df.loc[11, "lr"] == pytest.approx(1e-3)
    assert df.loc[11:, "loss/train"].tolist() == pytest.approx([s["loss"] for s in loop2.seen])


def test_nonfinite_loss_skips_the_step_and_pauses(tmp_path):
    model, opt, sched, batches = setup()
    mon = nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "r", display=False)

    def train():
        for i in range(10**6):
            b = batches[i % len(batches)]
            loss = nbwatch.masked_cross_entropy(model(b["input_ids"]), b["labels"], b["mask"])
            if i in (4, 5):  # two bad steps in a row
                loss = loss * float("nan")
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            mon.log(loss=loss, mask=b["mask"])

    mon.run(train)
    until(lambda: mon.state == "paused", what="the alert's pause")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    mon.resume()  # step 6 is NaN too: skipped again, whatever the alert's episode
    until(lambda: mon.step >= 8)
    mon.stop()
    mon.wait()
    df = mon.df
    assert df.loc[5, "skipped"] == 1.0 and df.loc[6, "skipped"] == 1.0
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert mon.events.query("kind == 'alert'").message.str.startswith("nonfinite").any()
    assert all(torch.isfinite(v).all() for v in before.values())


def test_bad_input_gets_an_error_that_names_the_fix(tmp_path):
    model, opt, sched, batches = setup()
    mon = nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "r", display=False)
    with pytest.raises(RuntimeError, match="before any optimizer step"):
        mon.log(loss=1.0)
    b = batches[0]
    with mon:
        loss = nbwatch.masked_cross_entropy(model(b["input_ids"]), b["labels"], b["mask"])
        loss.backward()
        opt.step()
        with pytest.raises(ValueError, match="not one value"):
            mon.log(loss=torch.ones(3))
        with pytest.raises(ValueError, match=r"\[batch, seq_len\]"):
            mon.log(loss=loss, mask=torch.ones(2, 3, 4))
        with pytest.raises(TypeError, match="accuracy"):
            mon.log(loss=loss, accuracy="high")
        mon.log(loss=loss, mask=b["mask"], accuracy=0.5)
        with pytest.raises(RuntimeError, match="twice for one optimizer step"):
            mon.log(loss=loss)
        other = torch.optim.SGD(model.head.parameters(), lr=0.1)
        model(b["input_ids"]).sum().backward()
        with pytest.raises(RuntimeError, match="second optimizer"):
            other.step()
        opt.zero_grad()
        model(b["input_ids"]).sum().backward()
        opt.step()
        with pytest.raises(RuntimeError, match="without mon.log"):
            opt.step()
        mon.log(loss=1.0)
    assert mon.df.loc[1, "train/accuracy"] == 0.5
    assert mon.state == "finished"
    started = nbwatch.Monitor(model, opt, run_dir=tmp_path / "s", display=False)
    started.start(lambda m, b: m(b["input_ids"]).mean(), batches, max_steps=2)
    with pytest.raises(RuntimeError, match="start"):
        started.log(loss=1.0)
    started.wait()


def test_ctrl_c_during_wait_leaves_the_run_in_hand(tmp_path):
    model, opt, sched, batches = setup()
    mon = nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "r", display=False)
    mon.run(Loop(model, opt, sched, batches, mon, delay=0.005))
    until(lambda: mon.step >= 2)
    timer = threading.Timer(0.3, _thread.interrupt_main)
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        mon.wait()
    timer.join()
    assert mon.running and mon.state == "running"
    at = mon.step
    until(lambda: mon.step > at + 2, what="training goes on")
    mon.stop()  # the controls still answer
    mon.wait()
    assert mon.state == "stopped"


def test_val_at_log_records_eval_figures_and_probes_attention(tmp_path):
    model, opt, sched, batches = setup()
    probe = {"idx": batches[0]["input_ids"]}
    mon = nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "r", display=False,
                          probe_batch=probe, probe_fn=lambda m, b: m(b["idx"]))
    with mon:
        for i in range(6):
            b = batches[i]
            loss = nbwatch.masked_cross_entropy(model(b["input_ids"]), b["labels"], b["mask"])
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            val = {"loss": 3.0 - i * 0.1, "accuracy": 0.1 * i} if i % 3 == 2 else None
            mon.log(loss=loss, mask=b["mask"], val=val)
    df = mon.df
    assert df.loc[3, "loss/val"] == pytest.approx(2.8) and df.loc[6, "val/accuracy"] == 0.5
    assert math.isfinite(df.loc[3, "loss/gap"])
    run = nbwatch.open_run(tmp_path / "r")
    maps = run.attention(step=6)
    assert maps and all(w.shape[0] == 2 for w in maps.values())  # 2 heads a module


def test_a_script_in_a_terminal_is_steered_by_attach(tmp_path):
    """No run(): the loop runs in a script's foreground; another process pauses,
    checkpoints and stops it through `nbwatch.attach`."""
    script = textwrap.dedent("""
        import sys, time, torch
        import nbwatch
        from tests.test_monitor_log import Loop, setup
        torch.set_num_threads(1)
        model, opt, sched, batches = setup()
        mon = nbwatch.Monitor(model, opt, sched, run_dir=sys.argv[1])
        Loop(model, opt, sched, batches, mon, delay=0.01)()   # no with, no run()
    """)
    run_dir = tmp_path / "r"
    proc = subprocess.Popen([sys.executable, "-c", script, str(run_dir)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": ROOT},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        att = nbwatch.attach(run_dir).wait_started(timeout=60)
        until(lambda: att.step >= 3, what="the script's steps")
        att.pause()
        until(lambda: att.state == "paused", what="paused")
        att.checkpoint()
        until(lambda: (att.events.kind == "checkpoint").any(), what="checkpoint")
        att.stop()
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert att.state == "stopped"
    assert b"StopTraining" in err  # the script's loop ended at log()
    run = nbwatch.open_run(run_dir)
    assert run.state == "stopped" and run.df.index.max() == run.step
    ckpts = run.events.query("kind == 'checkpoint'")
    assert ckpts.data.iloc[0]["reason"] == "manual"  # taken while paused
    assert ckpts.step.iloc[-1] == run.step  # stopped while paused: that one is the last


def test_a_script_that_crashes_without_with_is_recorded_failed(tmp_path):
    script = textwrap.dedent("""
        import sys, torch
        import nbwatch
        from tests.test_monitor_log import Loop, setup
        torch.set_num_threads(1)
        model, opt, sched, batches = setup()
        mon = nbwatch.Monitor(model, opt, sched, run_dir=sys.argv[1])
        Loop(model, opt, sched, batches, mon)(3)
        raise SystemError("out of data")
    """)
    run_dir = tmp_path / "r"
    subprocess.run([sys.executable, "-c", script, str(run_dir)], cwd=ROOT, timeout=120,
                   env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True)
    run = nbwatch.open_run(run_dir)
    assert run.state == "failed" and run.step == 3
    assert "out of data" in " ".join(run.events.message)


def test_grad_scaler_in_the_loop_norms_unscaled_overflow_routine(tmp_path):
    def train(scaler, mon, steps=4, factor=1.0):
        torch.manual_seed(0)
        for i in range(steps):
            b = batches[i]
            loss = nbwatch.masked_cross_entropy(model(b["input_ids"]), b["labels"], b["mask"])
            (scaler.scale(loss * factor) if scaler else loss * factor).backward()
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad()
            mon.log(loss=loss)

    norms = []
    for use_scaler in (False, True):
        model, opt, _, batches = setup()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12) if use_scaler else None
        with nbwatch.Monitor(model, opt, run_dir=tmp_path / str(use_scaler), scaler=scaler,
                             display=False) as mon:
            train(scaler, mon)
        norms.append(mon.df["grad_norm/global"].tolist())
    assert norms[1] == pytest.approx(norms[0], rel=1e-4)

    model, opt, _, batches = setup()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)  # overflows at first
    with nbwatch.Monitor(model, opt, run_dir=tmp_path / "o", scaler=scaler,
                         display=False) as mon:
        train(scaler, mon, steps=6, factor=1e3)
    df = mon.df
    assert df.loc[1, "amp/overflow"] == 1.0 and len(df) == 6
    assert not (mon.events.severity == "critical").any()
    assert scaler.get_scale() < 2.0**127  # the scaler lowered its scale, as it should


def test_a_second_monitor_on_the_same_optimizer_takes_over(tmp_path):
    """A notebook cell run twice: the first Monitor (never used) must not record, nor
    break the second one's run."""
    model, opt, sched, batches = setup()
    nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "a", display=False)
    mon = nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "b", display=False)
    with mon:
        Loop(model, opt, sched, batches, mon)(3)
    assert mon.state == "finished" and mon.step == 3
    assert not (tmp_path / "a" / "nbwatch.db").exists()
    running = nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "c", display=False)
    running.run(Loop(model, opt, sched, batches, running, delay=0.01))
    until(lambda: running.step >= 1)
    with pytest.raises(RuntimeError, match="watched by a running Monitor"):
        nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "d", display=False)
    running.stop()
    running.wait()


def test_fused_optimizer_under_a_grad_scaler_records_unscaled_norms(tmp_path):
    """A fused AdamW gets still-scaled gradients (and found_inf) from the GradScaler."""
    norms = {}
    for fused in (False, True):
        model, _, _, batches = setup()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        with nbwatch.Monitor(model, opt, run_dir=tmp_path / str(fused), scaler=scaler,
                             display=False) as mon:
            for i in range(4):
                b = batches[i]
                loss = nbwatch.masked_cross_entropy(model(b["input_ids"]), b["labels"],
                                                    b["mask"])
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
                mon.log(loss=loss)
        norms[fused] = mon.df["grad_norm/global"].tolist()
        assert not (mon.events.severity == "critical").any()
    assert norms[True] == pytest.approx(norms[False], rel=1e-4)
