"""`time/nbwatch`: nbwatch's own time on the training thread, recorded with each step —
what watching costs, measured where it is spent; a pause, an eval and a checkpoint are
the user's, not watching's."""

from __future__ import annotations

import itertools
import threading
import time

import pandas as pd
import pytest
import torch
from torch import nn

import nbwatch
from nbwatch.recorder.own_time import OwnTime


def test_the_clock_counts_the_outermost_entry_and_splits_an_open_one_at_a_take():
    clock = OwnTime()
    with clock:
        with clock:  # nested: counted once
            time.sleep(0.02)
        first = clock.take()  # inside: up to now, the rest goes to the next take
        time.sleep(0.02)
    time.sleep(0.05)  # outside: not counted
    second = clock.take()
    assert 0.02 <= first < 0.05 and 0.02 <= second < 0.05
    assert clock.take() == 0.0


def test_a_wait_outside_watching_is_neither_watching_nor_its_wait():
    """A copy read for an eval or a checkpoint (the user's time) may wait for the device
    outside every entry: that wait was never counted, so it takes nothing off the next
    entry's watching (which would go negative) and is no `time/device_wait`."""
    clock = OwnTime()
    clock.exclude(0.05)  # outside
    with clock:
        time.sleep(0.01)
        clock.exclude(0.004)  # inside: 4 ms of the 10 were a wait
    assert 0.005 <= clock.take() < 0.05 and clock.take_wait() == 0.004


def tiny(seed: int = 0):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    return m, torch.optim.SGD(m.parameters(), lr=1e-2)


def test_own_loop_records_its_watching_and_not_a_pause(tmp_path):
    m, opt = tiny()
    with nbwatch.Monitor(m, opt, run_dir=tmp_path / "r", display=False) as mon:
        for step in range(1, 41):
            loss = m(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step == 20:  # paused at this log() for 0.3 s: step 21 waited that long
                mon.pause()
                threading.Timer(0.3, mon.resume).start()
            mon.log(loss=loss)
    run = nbwatch.open_run(tmp_path / "r")
    own, took = run.df["time/nbwatch"], run.reader.walls().diff()  # record to record
    assert own.notna().all() and (own > 0).all()
    assert (own <= took).iloc[1:].all()
    # the timer starts just before step 20's record: step 21's wall comes ~0.3 s after it
    assert took.loc[21] >= 0.25 and own.loc[21] < 0.1, (took.loc[21], own.loc[21])
    # nor is the pause step 21's time (it read 0.3 s), and step 1, whose start the run
    # (opened at its optimizer step) did not see, has none (it read the optimizer's alone)
    step_s = run.df["time/step"]
    assert step_s.loc[21] < 0.1, step_s.loc[21]
    assert pd.isna(step_s.loc[1]) and step_s.loc[2:].notna().all()


def test_start_leaves_out_the_eval_and_the_checkpoint(tmp_path):
    m, opt = tiny()
    x = torch.randn(4, 8)

    def val_fn(model):
        time.sleep(0.3)
        return {"loss": float(model(x).pow(2).mean())}

    mon = nbwatch.Monitor(m, opt, run_dir=tmp_path / "r", checkpoint_every=10)
    mon.start(lambda model, b: model(b).pow(2).mean(), itertools.repeat(x), max_steps=30,
              val_fn=val_fn, eval_every=10, display=False).wait()
    assert mon.state == "finished"
    df = nbwatch.open_run(tmp_path / "r").df
    own = df["time/nbwatch"]
    assert own.notna().all() and (own > 0).all()
    # the eval of step 10 runs after its record: the next step would have counted it
    assert own.loc[[11, 21]].max() < 0.1, own.loc[[11, 21]]
    shares = own / df["time/step"]
    assert shares.iloc[5:].median() < 1


def test_in_the_gpus_order_a_wait_for_a_copy_is_its_own_figure(tmp_path, monkeypatch):
    """Every copy read waits 30 ms for the device (as a GPU's that has not landed): read at
    a step's end it is `time/device_wait`, not watching; read for an eval (the user's
    time) it is neither. No step's watching goes below 0."""
    from nbwatch.recorder import host_copy

    monkeypatch.setattr(host_copy, "DEFER_ON_CPU", True)
    real = host_copy.HostCopy.read

    def waiting(self, own=None):
        time.sleep(0.03)
        if own is not None:
            own.exclude(0.03)
        return real(self, own)

    monkeypatch.setattr(host_copy.HostCopy, "read", waiting)
    m, opt = tiny()
    x = torch.randn(4, 8)
    mon = nbwatch.Monitor(m, opt, run_dir=tmp_path / "r")
    mon.start(lambda model, b: model(b).pow(2).mean(), itertools.repeat(x), max_steps=12,
              val_fn=lambda model: {"loss": float(model(x).pow(2).mean())}, eval_every=4,
              display=False).wait()
    assert mon.state == "finished", mon.error
    df = nbwatch.open_run(tmp_path / "r").df
    assert (df["time/nbwatch"] >= 0).all(), df["time/nbwatch"]
    waits = df["time/device_wait"].dropna()
    # each step reads the one before at its end, but 5 and 9: the evals after 4 and 8 (the
    # user's time) read those first
    assert waits.index.tolist() == [2, 3, 4, 6, 7, 8, 10, 11, 12], waits
    assert waits.to_numpy() == pytest.approx(0.03), waits


def test_start_counts_the_batch_figures_it_takes(tmp_path, monkeypatch):
    """What the step takes of its logits (between the forward and the backward: a copy of
    their rows, `probes.late`) and of its masks (their figures at the first step, a copy
    later) is watching's time, and not the step_fn's (`time/forward`)."""
    from nbwatch import runner
    from nbwatch.probes import data, late, logits

    def slow(f):
        def run(*a, **k):
            time.sleep(0.01)
            return f(*a, **k)
        return run

    monkeypatch.setattr(logits, "row_copy", slow(logits.row_copy))
    monkeypatch.setattr(runner, "batch_figures", slow(data.batch_figures))
    monkeypatch.setattr(runner, "keep_mask", slow(late.keep_mask))
    torch.manual_seed(0)
    head = nn.Linear(8, 5)
    opt = torch.optim.SGD(head.parameters(), lr=1e-2)
    x, labels, mask = torch.randn(2, 3, 8), torch.randint(0, 5, (2, 3)), torch.ones(2, 3)

    mon = nbwatch.Monitor(head, opt, run_dir=tmp_path / "r")
    mon.start(lambda m, b: {"logits": m(b), "labels": labels, "mask": mask},
              itertools.repeat(x), max_steps=8, accumulate=2, display=False,
              dry_run=False).wait()
    assert mon.state == "finished", mon.error
    df = nbwatch.open_run(tmp_path / "r").df
    assert df["train_logits/log_z"].notna().all() and (df["tokens/real"] == 12).all()
    # one logits' figure (the first micro-batch's) and a mask copy per micro-batch: ≥ 20 ms
    assert (df["time/nbwatch"].iloc[1:] >= 0.02).all(), df["time/nbwatch"]
    # counted as forward, every step's would be ≥ 20 ms; the median leaves a loaded
    # machine's stray slow step out
    assert df["time/forward"].iloc[1:].median() < 0.02, df["time/forward"]


def test_start_counts_the_output_layers_hook_as_watching_not_forward(tmp_path, monkeypatch):
    """A step_fn that returns only a loss: the hook on the output layer takes the logits'
    figures inside the forward, on watching's clock, and `time/forward` leaves it out."""
    from nbwatch.probes import logits

    def slow(x, positions=logits.POSITIONS, cap=None):
        time.sleep(0.01)
        return real(x, positions, cap)

    real = logits.row_copy  # the hook copies the rows of CPU logits (probes.late)
    monkeypatch.setattr(logits, "row_copy", slow)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(5, 8), nn.Linear(8, 5))  # its Linear: the vocabulary
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 5, (2, 3))

    def step_fn(m, b):
        return {"loss": nn.functional.cross_entropy(m(b).flatten(0, 1), b.flatten())}

    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "r")
    mon.start(step_fn, itertools.repeat(ids), max_steps=6, display=False, dry_run=False).wait()
    assert mon.state == "finished", mon.error
    df = nbwatch.open_run(tmp_path / "r").df
    assert df["train_logits/log_z"].iloc[1:].notna().all()  # the hook set after step 1
    assert (df["time/nbwatch"].iloc[1:] >= 0.01).all(), df["time/nbwatch"]
    assert df["time/forward"].iloc[1:].median() < 0.01, df["time/forward"]  # (as above)


def test_own_loop_counts_noting_its_own_clips(tmp_path, monkeypatch):
    """The loop's own `clip_grad_norm_`: what nbwatch notes of each clip (for the norms
    before it) is watching's time."""
    from nbwatch.monitor import clip_watch

    real = clip_watch.ClipWatch.saw

    def slow(self, *a):
        time.sleep(0.01)
        return real(self, *a)

    monkeypatch.setattr(clip_watch.ClipWatch, "saw", slow)
    m, opt = tiny()
    with nbwatch.Monitor(m, opt, run_dir=tmp_path / "r", display=False) as mon:
        for _ in range(5):
            m(torch.randn(4, 8)).pow(2).mean().backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.01)
            opt.step()
            opt.zero_grad()
            mon.log()
    own = nbwatch.open_run(tmp_path / "r").df["time/nbwatch"]
    assert (own.iloc[1:] >= 0.01).all(), own  # from step 2: the run opens at step 1's step


@pytest.mark.parametrize("gpu_order", [False, True])
def test_a_step_read_later_keeps_its_own_watching_and_wall_time(tmp_path, monkeypatch,
                                                                gpu_order):
    """In a GPU's order step N is read at step N + 1's end, and its row still holds its
    own watching and the wall time of its own end: a slow note of step 3's clip counts
    in step 3, the last step's watching is its own, and a sleep between steps falls
    between two rows' wall times."""
    from nbwatch.monitor import clip_watch
    from nbwatch.recorder import host_copy

    monkeypatch.setattr(host_copy, "DEFER_ON_CPU", gpu_order)
    real, at = clip_watch.ClipWatch.saw, []

    def slow(self, *a):
        if len(at) in (3, 6):  # steps 3 and 6 (the last)
            time.sleep(0.05)
        return real(self, *a)

    monkeypatch.setattr(clip_watch.ClipWatch, "saw", slow)
    m, opt = tiny()
    logged: dict[int, tuple[float, float]] = {}  # step → wall time before and after log()
    with nbwatch.Monitor(m, opt, run_dir=tmp_path / "r", display=False) as mon:
        for step in range(1, 7):
            m(torch.randn(4, 8)).pow(2).mean().backward()
            at.append(step)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.01)
            opt.step()
            opt.zero_grad()
            before = time.time()
            mon.log()
            logged[step] = (before, time.time())
            time.sleep(0.03)
    run = nbwatch.open_run(tmp_path / "r")
    own = run.df["time/nbwatch"]
    assert own[3] >= 0.05 and own[6] >= 0.05, own
    assert own[[2, 4, 5]].max() < 0.03, own
    walls = run.reader.walls()
    for step, (before, after) in logged.items():
        assert before <= walls[step] <= after, (step, walls[step], logged)


def test_the_own_time_benchmark_times_every_part_it_names_in_the_gpus_order():
    """`benchmarks/own_time.py` times nbwatch's functions by name: a renamed one must fail
    it here, not in the session that next needs it, and its GPU-order run times the
    device's clip and skip."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [sys.executable, "benchmarks/own_time.py", "--steps", "4", "--gpu-order"],
        cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True,
        text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    timed = {line.split("  ")[1].strip() for line in proc.stdout.splitlines()
             if " calls, median " in line}
    assert "pre-hook: the clip and the skip on the device" in timed, proc.stdout
    assert "pre-hook: one read, the clip and the skip (CPU)" not in timed, proc.stdout
