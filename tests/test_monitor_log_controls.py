"""A loop of the user's own steered and ended: pause, checkpoint, resume, stop (a loop
that ignores `log()`'s return, or checks `mon.stopping`), clip and cut LR at the optimizer
step, Ctrl-C during `wait()`, a script steered by `attach`, failures in the foreground and
the background, a resumed run's step numbering, a second Monitor on the same optimizer.
The loop and its setup are `test_monitor_log.py`'s."""

from __future__ import annotations

import _thread
import contextlib
import itertools
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
from nbwatch.checkpoint import load
from nbwatch.demo import TinyGPT, make_demo, masked_cross_entropy

from .conftest import until
from .test_monitor_log import Loop, own_steps, setup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    at_three = threading.Event()  # the loop is past step 3's log(): the stop comes now

    def train():
        for i in range(10**6):
            if i == 3:
                at_three.set()
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
    # not `mon.step >= 3`: that holds inside step 3's log(), where a stop already asked
    # ends the loop with StopTraining before it can look at `stopping`
    until(at_three.is_set, what="the loop past step 3")
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


def test_the_first_of_two_monitors_on_one_optimizer_takes_it_back_to_start(tmp_path):
    """mon1, then mon2 on the same optimizer (a cell with another run_dir), then
    mon1.start(): mon1 records its run; mon2's hooks, taken over by it, open no phantom run
    in mon2's folder (it failed mon1 at step 1 with "optimizer.step() ran twice")."""
    model, opt, sched, batches = setup()
    mon1 = nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "a", display=False)
    mon2 = nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "b", display=False)
    mon1.start(lambda m, b: m(b["input_ids"]).float().mean(), batches, max_steps=4,
               display=False).wait()
    assert mon1.state == "finished" and mon1.df["grad_norm/global"].notna().all()
    assert mon2.state == "created" and not (tmp_path / "b" / "nbwatch.db").exists()


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, RuntimeError])
def test_a_loop_stopped_between_its_step_and_log_checkpoints_that_steps_weights(
        tmp_path, interrupt):
    """Ctrl-C (or an error) after `optimizer.step()` and before `log()`: the optimizer's
    step is recorded (without the loss `log()` would have brought) and the run's last
    checkpoint, numbered after it, holds the weights it left: a resume does not take it
    again."""
    demo = make_demo(d=32, layers=2, heads=2, ctx=32, batch_size=4)
    m, opt = demo.model, demo.optimizer
    mon = nbwatch.Monitor(m, opt, run_dir=tmp_path / "r", display=False)
    with pytest.raises(interrupt), mon:
        for i, b in enumerate(itertools.islice(itertools.cycle(demo.train), 9), 1):
            loss = masked_cross_entropy(m(b["input_ids"]), b["labels"], b["mask"])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i == 5:
                raise interrupt("between the step and log()")
            mon.log(loss=loss)
    assert mon.state == ("stopped" if interrupt is KeyboardInterrupt else "failed")
    df = nbwatch.open_run(tmp_path / "r").df
    assert df.index.tolist() == [1, 2, 3, 4, 5]
    assert math.isnan(df.loc[5, "loss/train"]) and df.loc[5, "grad_norm/global"] > 0
    last = max((tmp_path / "r" / "checkpoints").glob("step_*.pt"))
    assert last.name == "step_00000005.pt"
    saved = load(last)["model"]
    assert all(torch.equal(v, saved[k]) for k, v in m.state_dict().items())


def test_a_foreground_loop_that_goes_on_after_a_stop_gets_stoptraining_each_log(tmp_path):
    """`with mon:` and a stop: every further log() raises StopTraining (which the block
    swallows), as under mon.run(), not a RuntimeError once the run is closed."""
    model, opt, sched, batches = setup()
    mon = nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "r", display=False)
    stopped = []
    with mon:
        for i, (loss, b) in enumerate(itertools.islice(own_steps(model, opt, sched, batches),
                                                       8)):
            if i == 3:
                mon.stop()
            try:
                mon.log(loss=loss, mask=b["mask"])
            except nbwatch.StopTraining:
                stopped.append(i)
    assert stopped == [3, 4, 5, 6, 7] and mon.state == "stopped" and mon.step == 4


def test_a_run_stopped_while_paused_leaves_the_monitor_able_to_resume(tmp_path):
    """Paused, then stopped: the pause ends with the run, so start(resume=True) on the
    same Monitor trains on (it waited at its first step for a resume that never came)."""
    model, opt, sched, batches = setup()
    mon = nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "r", display=False)
    steps = own_steps(model, opt, sched, batches)

    def train():
        for loss, _ in steps:
            time.sleep(0.005)
            mon.log(loss=loss)

    mon.run(train)
    until(lambda: mon.step >= 3)
    mon.pause()
    until(lambda: mon.state == "paused")
    mon.stop()
    mon.wait()
    at = mon.step
    mon.start(lambda m, b: masked_cross_entropy(m(b["input_ids"]), b["labels"], b["mask"]),
              batches, max_steps=at + 5, resume=True, dry_run=False, display=False)
    until(lambda: not mon.running, 30, "the resumed run's end")
    assert mon.state == "finished" and mon.step == at + 5


def test_a_second_with_block_on_an_ended_run_is_refused_before_a_step(tmp_path):
    """A loop of one's own records one run a Monitor: a second `with mon:` is refused at
    once, before an optimizer step could train unrecorded, naming what to do."""
    model, opt, sched, batches = setup()
    mon = nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "r", display=False)
    with mon:
        for loss, _ in itertools.islice(own_steps(model, opt, sched, batches), 3):
            mon.log(loss=loss)
    with pytest.raises(RuntimeError, match="run is finished at step 3.*create a new Monitor"), mon:
        pass
    again = nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "r", resume=True,
                            display=False)
    with again:
        for loss, _ in itertools.islice(own_steps(model, opt, sched, batches), 2):
            again.log(loss=loss)
    assert again.step == 5
    assert nbwatch.open_run(tmp_path / "r").df.index.tolist() == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("stepped", ["before log", "after log"])
def test_reduce_lr_on_plateau_is_the_runs_scheduler_its_cuts_expected(tmp_path, stepped):
    """ReduceLROnPlateau, stepped with a val loss at the loop's evals (before or after
    that step's log()): taken as the run's scheduler (it was refused, and left out its
    cuts each fired lr_change, "not by the scheduler"), its cuts recorded as the LR used
    and said by no alert, a Cut LR on top of them, its state in the checkpoints."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
    vals = iter([3.0, 3.1, 3.2, 2.0, 2.5, 2.6])  # no better: a cut at each but the 4th
    used = []
    with nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "r", display=False) as mon:
        for step in range(1, 25):
            model(torch.randn(8, 4)).square().mean().backward()
            used.append(opt.param_groups[0]["lr"] * (0.5 if step > 13 else 1.0))
            opt.step()
            opt.zero_grad()
            val = next(vals) if step % 4 == 0 else None
            if val is not None and stepped == "before log":
                sched.step(val)
            mon.log(loss=0.0, **({"val": val} if val is not None else {}))
            if val is not None and stepped == "after log":
                sched.step(val)
            if step == 12:
                mon.scale_lr(0.5)  # taken at step 13's log(), used from step 14
    df = mon.df
    assert df["lr"].tolist() == pytest.approx(used, rel=1e-9)
    assert df["lr"].nunique() >= 5  # four cuts of its own and ours
    assert not mon.events.message.str.contains("LR changed").any(), mon.events.message.tolist()
    ck = torch.load(sorted((tmp_path / "r" / "checkpoints").glob("step_*.pt"))[-1],
                    weights_only=False)
    assert ck["scheduler"]["num_bad_epochs"] == sched.num_bad_epochs
    assert ck["scheduler"]["best"] == 2.0


@pytest.mark.parametrize("per_micro", [False, True])
def test_a_scheduler_stepped_per_micro_batch_is_said_once(tmp_path, per_micro):
    """Gradient accumulation of 4 with `scheduler.step()` after each micro-batch: the
    schedule runs 4× faster than the optimizer's steps, and the LR was recorded as it is
    with no word. One warning says so (and how to fix it); a loop that steps it once per
    optimizer step hears nothing."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.99 ** s)
    with nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "r", display=False) as mon:
        for _ in range(10):
            for _ in range(4):
                model(torch.randn(8, 4)).pow(2).mean().backward()
                if per_micro:
                    sched.step()
            opt.step()
            if not per_micro:
                sched.step()
            opt.zero_grad()
            mon.log(loss=torch.tensor(1.0))
    said = mon.events[mon.events.message.str.startswith("the scheduler stepped")]
    if per_micro:
        assert len(said) == 1 and "4 times" in said.message.iloc[0], said.message.tolist()
        assert said.severity.iloc[0] == "warning"
    else:
        assert said.empty
    # the LR each step used: 4 scheduler steps a step (its own micro-batches' included)
    assert mon.df["lr"].iloc[-1] == pytest.approx(0.1 * 0.99 ** (40 if per_micro else 9))


def test_a_manual_checkpoint_on_a_periodic_step_is_one_file_and_one_event(tmp_path):
    model, opt, sched, batches = setup()
    mon = nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "r", display=False,
                          checkpoint_every=4)
    steps = own_steps(model, opt, sched, batches)
    for i in range(1, 7):
        loss, b = next(steps)
        if i == 4:
            mon.checkpoint()  # heard at step 4's boundary, after its periodic checkpoint
        mon.log(loss=loss, mask=b["mask"])
    mon.close()
    ev = mon.events
    at4 = ev[(ev.step == 4) & (ev.kind == "checkpoint")]
    assert len(at4) == 1 and "periodic" in at4.message.iloc[0], at4.message.tolist()
    said = ev[(ev.step == 4) & ev.message.str.startswith("manual checkpoint")]
    assert len(said) == 1 and "written already" in said.message.iloc[0]
    assert said.message.iloc[0].endswith(os.path.basename(at4.data.iloc[0]["path"]))


def test_a_gan_is_watched_by_one_monitor_per_network(tmp_path):
    """Generator and discriminator trained in turns, each by its own optimizer: one
    Monitor each, in one loop; each run's norms are its own network's."""
    torch.manual_seed(0)
    g, d = torch.nn.Linear(4, 8), torch.nn.Sequential(torch.nn.Linear(8, 1))
    opt_g, opt_d = torch.optim.Adam(g.parameters(), 1e-3), torch.optim.Adam(d.parameters(), 1e-3)
    mon_g = nbwatch.Monitor(g, opt_g, run_dir=tmp_path / "G", display=False)
    mon_d = nbwatch.Monitor(d, opt_d, run_dir=tmp_path / "D", display=False)
    norms: dict[str, list[float]] = {"G": [], "D": []}
    bce = torch.nn.functional.binary_cross_entropy_with_logits
    for _ in range(5):
        real, fake = torch.randn(16, 8), g(torch.randn(16, 4))
        loss_d = bce(d(real), torch.ones(16, 1)) + bce(d(fake.detach()), torch.zeros(16, 1))
        loss_d.backward()
        norms["D"].append(torch.nn.utils.get_total_norm([p.grad for p in d.parameters()]).item())
        opt_d.step()
        opt_d.zero_grad()
        mon_d.log(loss=loss_d)
        loss_g = bce(d(fake), torch.ones(16, 1))
        loss_g.backward()  # D's gradients too: zeroed before D's next backward, its own
        norms["G"].append(torch.nn.utils.get_total_norm([p.grad for p in g.parameters()]).item())
        opt_g.step()
        opt_g.zero_grad()
        d.zero_grad()
        mon_g.log(loss=loss_g)
    mon_g.close()
    mon_d.close()
    for name in ("G", "D"):
        df = nbwatch.open_run(tmp_path / name).df
        assert list(df.index) == [1, 2, 3, 4, 5]
        assert df["grad_norm/global"].tolist() == pytest.approx(norms[name], rel=1e-5)


def _lr_run(run_dir, steps, log_first, interrupt_at=None, resume=False, every=None,
            overflow_at=None):
    """An own loop over a LambdaLR (LR = 1e-3 · 0.9^k): `log_first` logs before
    scheduler.step(); `interrupt_at`: Ctrl-C after that step's optimizer.step();
    `overflow_at`: under a GradScaler, whose overflow skips that step's optimizer.step()."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.9 ** k)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4) if overflow_at else None
    mon = nbwatch.Monitor(model, opt, sched, run_dir=run_dir, display=False, resume=resume,
                          checkpoint_every=every, scaler=scaler)
    with contextlib.suppress(KeyboardInterrupt), mon:
        for i in range(mon.step + 1, steps + 1):
            loss = model(torch.randn(8, 4)).square().mean()
            if scaler is None:
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                if i == overflow_at:
                    model.weight.grad[0, 0] = float("inf")
                scaler.step(opt)
                scaler.update()
            opt.zero_grad()
            if i == interrupt_at:
                raise KeyboardInterrupt
            if log_first:
                mon.log(loss=torch.tensor(1.0))
            sched.step()
            if not log_first:
                mon.log(loss=torch.tensor(1.0))
    return nbwatch.open_run(run_dir).df


@pytest.mark.parametrize("log_first", [False, True], ids=["sched_then_log", "log_then_sched"])
def test_a_resume_continues_the_schedule_from_a_checkpoint_between_step_and_scheduler(
        tmp_path, log_first):
    """A checkpoint taken after optimizer.step() and before scheduler.step() (Ctrl-C there;
    a periodic one inside a log() that comes first) is numbered after the step but holds
    the scheduler before it: resumed, every later step ran one schedule step behind, more
    with each such resume. The LRs of the resumed run equal those of one never stopped."""
    ref = _lr_run(tmp_path / "ref", 12, log_first)["lr"]
    run = tmp_path / "r"
    if log_first:  # the periodic checkpoint of step 5, inside log(); the last one set aside
        _lr_run(run, 7, log_first, every=5)
        (run / "checkpoints" / "step_00000007.pt").unlink()
    else:
        _lr_run(run, 12, log_first, interrupt_at=5)
    got = _lr_run(run, 12, log_first, resume=True)["lr"]
    assert got.tolist() == pytest.approx(ref.tolist(), rel=1e-12)


@pytest.mark.parametrize("log_first", [False, True], ids=["sched_then_log", "log_then_sched"])
def test_a_resume_continues_the_schedule_after_a_grad_scalers_skipped_step(tmp_path,
                                                                          log_first):
    """A GradScaler's overflow skips the optimizer's step, not the loop's scheduler.step():
    two steps after one, a Ctrl-C checkpoint between optimizer.step() and scheduler.step()
    was not known to hold the scheduler a step behind, and the resumed run's LRs lagged
    one schedule step behind the uninterrupted run's."""
    ref = _lr_run(tmp_path / "ref", 12, log_first, overflow_at=4)
    assert ref.loc[4, "amp/overflow"] == 1.0
    _lr_run(tmp_path / "r", 12, log_first, interrupt_at=6, overflow_at=4)
    got = _lr_run(tmp_path / "r", 12, log_first, resume=True, overflow_at=4)
    assert got["lr"].tolist() == pytest.approx(ref["lr"].tolist(), rel=1e-12)


def test_a_scheduler_stepped_per_epoch_resumes_where_it_was(tmp_path):
    """StepLR stepped after each 4-step epoch: a checkpoint mid-epoch is no step behind
    (its scheduler steps between epochs), so a resume from it leaves the schedule as it
    was; stepping it there ran the schedule an epoch ahead per resume."""
    def run(run_dir, steps, resume=False, every=None):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        with nbwatch.Monitor(model, opt, sched, run_dir=run_dir, display=False,
                             resume=resume, checkpoint_every=every) as mon:
            for i in range(mon.step + 1, steps + 1):
                model(torch.randn(8, 4)).square().mean().backward()
                opt.step()
                opt.zero_grad()
                mon.log(loss=torch.tensor(1.0))
                if i % 4 == 0:
                    sched.step()
        return nbwatch.open_run(run_dir).df["lr"].tolist()

    ref = run(tmp_path / "ref", 16)
    run(tmp_path / "r", 8, every=2)
    (tmp_path / "r" / "checkpoints" / "step_00000008.pt").unlink()  # from step 6: mid-epoch
    assert run(tmp_path / "r", 16, resume=True) == ref


def test_a_resumed_run_keeps_its_alerts_first_levels(tmp_path):
    """The alerts' floor for a converged run is measured against the run's first 20 steps:
    a resume took its own first 20 (the converged level) instead, and flooded again."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train(steps, resume):
        with nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False,
                             resume=resume) as mon:
            for i in range(mon.step + 1, steps + 1):
                model(torch.randn(8, 4)).square().mean().backward()
                opt.step()
                opt.zero_grad()
                mon.log(loss=torch.tensor(float(i)))  # the first 20: median 10.5
            return mon._session.recorder.engine.start

    first = train(25, False)
    assert first["loss/train"] == 10.5
    saved = load(max((tmp_path / "r" / "checkpoints").glob("step_*.pt")))
    assert saved["alert_start"] == first
    assert train(30, True) == first  # not the median of steps 26-45
