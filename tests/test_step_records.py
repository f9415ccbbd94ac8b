"""A step's record (its "step" rules, its row, its alerts) is carried out in batches
(recorder/step_end.py: within RECORD_EVERY_S and RECORD_STEPS of its end), yet each row
keeps its own step and wall time, an alert names the step it looked at, and a loop of
one's own reads every step it logged."""

from __future__ import annotations

import itertools
import time

import pytest
import torch
from torch import nn

import nbwatch
from nbwatch.alerts.rules import Rule
from nbwatch.recorder import host_copy
from nbwatch.recorder.step_end import RECORD_EVERY_S, RECORD_STEPS
from tests.conftest import until


def tiny(seed: int = 0):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    return m, torch.optim.SGD(m.parameters(), lr=1e-2)


def own_steps(mon, m, opt, n: int, pause_s: float = 0.0) -> None:
    for _ in range(n):
        loss = m(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        mon.log(loss=loss)
        time.sleep(pause_s)


def test_an_own_loop_reads_every_step_it_logged_mid_run(tmp_path):
    m, opt = tiny()
    with nbwatch.Monitor(m, opt, run_dir=tmp_path / "r", display=False) as mon:
        own_steps(mon, m, opt, 5)  # fewer than a batch, well within its time
        assert mon.df.index.tolist() == [1, 2, 3, 4, 5]
        assert mon.df["grad_norm/global"].notna().all()


def test_each_row_keeps_the_wall_time_its_step_ended(tmp_path):
    m, opt = tiny()
    gap = RECORD_EVERY_S / 10  # the steps of one batch, recorded together
    with nbwatch.Monitor(m, opt, run_dir=tmp_path / "r", display=False) as mon:
        own_steps(mon, m, opt, 6, pause_s=gap)
    walls = nbwatch.open_run(tmp_path / "r").reader.walls()
    assert len(walls) == 6
    assert (walls.diff().iloc[1:] >= gap * 0.9).all(), walls.diff().tolist()


def test_a_step_rules_alert_names_its_step_and_its_pause_follows_within_a_batch(tmp_path):
    m, opt = tiny()
    mon = nbwatch.Monitor(m, opt, run_dir=tmp_path / "r")
    mon.rules.append(Rule("huge_loss", "warning", "step",
                          lambda w, p: "huge" if w.latest.get("loss/train", 0) > 1e3 else None,
                          actions=("pause",)))
    calls = itertools.count(1)

    def step(model, x):
        loss = model(x).pow(2).mean()
        return loss * 1e6 if next(calls) == 30 else loss  # only step 30's loss is huge

    mon.start(step, itertools.repeat(torch.randn(4, 8)), max_steps=500, display=False)
    until(lambda: mon.state == "paused", 60, "the alert's pause")
    paused_at = mon.step
    mon.stop()
    mon.wait()
    ev = mon.events
    alert = ev[(ev.kind == "alert") & ev.message.str.startswith("huge_loss")]
    assert alert.step.tolist() == [30]
    action = ev[(ev.kind == "action") & ev.message.str.startswith("paused")]
    assert 30 <= action.step.iloc[0] <= 30 + RECORD_STEPS, action
    assert 30 <= paused_at <= 30 + RECORD_STEPS
    assert nbwatch.open_run(tmp_path / "r").df.index.tolist() == list(range(1, mon.step + 1))


@pytest.mark.parametrize("gpu_order", [False, True])
def test_a_slow_step_is_recorded_when_read_not_with_a_later_batch(tmp_path, monkeypatch,
                                                                 gpu_order):
    """A step longer than a batch's time is its own batch: its row reaches the store (and a
    reader, a killed process's survivors) as soon as it is read, without waiting for the
    steps after it: at its own end on a CPU, at the next step's end in a GPU's order."""
    monkeypatch.setattr(host_copy, "DEFER_ON_CPU", gpu_order)
    m, opt = tiny()
    mon = nbwatch.Monitor(m, opt, run_dir=tmp_path / "r", display=False)
    try:
        own_steps(mon, m, opt, 1)  # step 1 (a histogram step: recorded with them)
        loss = m(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        time.sleep(RECORD_EVERY_S * 1.2)  # step 2 takes longer than a batch may wait
        mon.log(loss=loss)
        if gpu_order:
            own_steps(mon, m, opt, 1)  # step 3, whose end reads step 2's copy
        until(lambda: len(nbwatch.open_run(tmp_path / "r").df) == 2, 5, "step 2's row")
    finally:
        mon.close()


def test_a_non_finite_figure_a_rule_reads_after_the_step_fires_at_its_step(tmp_path):
    """The nonfinite rule reads what a loop reports after its optimizer step (here its own
    figure `train/aux`) on that step's record: a non-finite figure is recorded at once."""
    m, opt = tiny()
    keys = ["loss/train", "grad_norm/global", "train/aux"]
    with nbwatch.Monitor(m, opt, run_dir=tmp_path / "r", display=False,
                         alerts={"nonfinite": {"keys": keys, "actions": []}}) as mon:
        for step in range(1, 8):
            loss = m(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            mon.log(loss=loss, aux=float("nan") if step == 5 else 1.0)
    ev = nbwatch.open_run(tmp_path / "r").events
    fired = ev[(ev.kind == "alert") & ev.message.str.startswith("nonfinite")]
    assert fired.step.tolist() == [5], list(ev.message)


def test_a_notebook_cells_own_loop_is_recorded_when_the_cell_ends(tmp_path):
    """No next log() comes after a cell's loop: its last steps are recorded at the cell's
    end (IPython's post_run_cell), not left waiting for the run's close."""
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    config = Config()
    config.HistoryManager.enabled = False  # no history thread left behind
    shell = InteractiveShell.instance(config=config)
    m, opt = tiny()
    shell.user_ns.update(nbwatch=nbwatch, own_steps=own_steps, m=m, opt=opt,
                         run_dir=tmp_path / "r")
    try:
        result = shell.run_cell(
            "mon = nbwatch.Monitor(m, opt, run_dir=run_dir, display=False)\n"
            "own_steps(mon, m, opt, 3)\n")
        result.raise_error()
        # the writer commits within its flush interval (0.2 s); the rows came at the cell's end
        until(lambda: len(nbwatch.open_run(tmp_path / "r").df) == 3, RECORD_EVERY_S * 4,
              "the cell's 3 steps")
        shell.user_ns["mon"].close()
    finally:
        InteractiveShell.clear_instance()
    assert nbwatch.open_run(tmp_path / "r").df.index.tolist() == [1, 2, 3]


def test_an_early_gradient_explosion_is_caught_though_its_steps_wait_for_a_batch(tmp_path):
    """grad_explosion decides in the optimizer's pre-hook, on the steps recorded before it:
    while they are fewer than its min_history (20), each step it looks at has every step
    before it recorded, as without batches; so a ×1000 gradient at step 25 of fast steps
    (a batch of 16 would hold steps 17-24) is clipped."""
    m, opt = tiny()
    with nbwatch.Monitor(m, opt, run_dir=tmp_path / "r", display=False) as mon:
        for step in range(1, 31):
            loss = m(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
            if step == 25:
                for p in m.parameters():
                    p.grad.mul_(1000.0)
            opt.step()
            opt.zero_grad()
            mon.log(loss=loss)
    ev = nbwatch.open_run(tmp_path / "r").events
    fired = ev[ev["message"].str.contains("gradient norm", na=False)]
    assert 25 in fired["step"].tolist(), ev[["step", "message"]].to_string()
