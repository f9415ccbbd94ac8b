"""A step's record (recorder/step_end.py) waits for a batch of steps while the loop runs;
a loop that goes quiet (an eval of its own, a slow batch, a hang) has the steps waiting
recorded from the system sampler's thread, their alerts raised on the loop's thread."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import nbwatch
from nbwatch.recorder import host_copy, step_end
from nbwatch.store import RunReader
from tests.conftest import until


@pytest.mark.parametrize("gpu_order", [False, True])
def test_a_quiet_loops_steps_reach_the_store_and_their_alerts_the_loop(
        tmp_path, monkeypatch, gpu_order):
    """Fast steps, a loss spike at step 22, then the loop goes quiet: the steps it logged
    reach the store within seconds (they used to wait, up to 15 of them, for the loop's
    next step: a reader saw them late, and a kill lost them); the spike's alert is raised
    on the loop's own thread, at its next step at the latest; each step is stored once.
    In a GPU's order the last step's figures are read at the next step's end, as always."""
    monkeypatch.setattr(host_copy, "DEFER_ON_CPU", gpu_order)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen: list[tuple[str, int, str]] = []
    run = tmp_path / "r"
    mon = nbwatch.Monitor(
        model, opt, run_dir=run, display=False, system_interval=0.2,
        alerts={"loss_spike": {"min_history": 10, "window": 50, "recent": 5}},
        on_alert=lambda ev: seen.append((ev.data.get("rule", ev.message), ev.step,
                                         threading.current_thread().name)))

    def step(spike: bool = False) -> None:
        loss = model(torch.randn(16, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        mon.log(loss=torch.tensor(100.0) if spike else loss)

    with mon:
        for i in range(1, 23):
            step(spike=i == 22)
        last = 21 if gpu_order else 22
        reader = RunReader(run)
        until(lambda: reader.last_step() >= last, 10, f"step {last} in the store")
        reader.close()
        step()
        if not gpu_order:  # (in a GPU's order step 22 was read at this step's end)
            assert [rule for rule, _, _ in seen] == ["loss_spike"], seen
    assert [rule for rule, _, _ in seen] == ["loss_spike"], seen
    assert {thread for _, _, thread in seen} == {threading.current_thread().name}
    df = nbwatch.open_run(run).df
    assert df.index.tolist() == list(range(1, 24))
    events = nbwatch.open_run(run).events
    spikes = events[events.message.str.contains("spiked")]
    assert spikes.step.tolist() == [22]


def test_a_long_steps_row_reaches_the_store_during_the_next_step_in_a_gpus_order(
        tmp_path, monkeypatch):
    """On an accelerator a step's figures are read at the next step's end: with long steps
    (a big model) the folder showed the step before the latest, and a kill lost the last.
    The copy lands while the next step runs, and the sampler's thread records it then; the
    loop still reads nothing on its step path."""
    monkeypatch.setattr(host_copy, "DEFER_ON_CPU", True)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    run = tmp_path / "r"
    seen: list[int] = []
    with nbwatch.Monitor(model, opt, run_dir=run, display=False, system_interval=0.2) as mon:
        for step in range(1, 7):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
            if step == 6:  # a long step: its predecessor's row arrives meanwhile
                reader = RunReader(run)
                until(lambda r=reader: r.last_step() >= 5, 10, "step 5 in the store")
                seen.append(reader.last_step())
                reader.close()
            opt.step()
            opt.zero_grad()
            mon.log(loss=loss)
    assert seen == [5]
    assert nbwatch.open_run(run).df.index.tolist() == list(range(1, 7))


def _decisions(tmp_path, monkeypatch, name: str, batch: int, gpu_order: bool,
               alerts: dict) -> tuple[list, list, list, list]:
    """A run whose gradient norm and loss the test sets each step (a scalar weight `w`,
    loss `s * w`: its gradient is `s`), its steps recorded `batch` at a time: the clipped
    norms, the LR, the alerts (step, message: `grad_explosion`'s names the median its limit
    came from) and the final weight."""
    monkeypatch.setattr(host_copy, "DEFER_ON_CPU", gpu_order)
    monkeypatch.setattr(step_end, "RECORD_STEPS", batch)
    monkeypatch.setattr(step_end, "RECORD_EVERY_S", 1e9)  # batches by count alone
    rng = np.random.default_rng(0)
    scales = np.exp(np.linspace(0.0, 4.0, 90) + 0.3 * rng.standard_normal(90))
    scales[rng.choice(np.arange(25, 90), 14, replace=False)] *= rng.uniform(2, 40, 14)
    w = torch.nn.Parameter(torch.ones(()))
    model = torch.nn.Module()
    model.w = w
    opt = torch.optim.SGD([w], lr=1e-3)
    fired: list[tuple[int, str]] = []
    run = tmp_path / name
    with nbwatch.Monitor(model, opt, run_dir=run, display=False, alerts=alerts,
                         on_alert=lambda ev: fired.append((ev.step, ev.message))
                         ) as mon:
        for s in scales:
            loss = float(s) * w
            loss.backward()
            opt.step()
            opt.zero_grad()
            mon.log(loss=loss)
    df = nbwatch.open_run(run).df
    return (df["grad_norm/clipped"].round(6).tolist(), df["lr"].tolist(), sorted(fired),
            [float(w.detach())])


@pytest.mark.parametrize("gpu_order", [False, True])
def test_what_changes_training_does_not_depend_on_when_steps_are_recorded(
        tmp_path, monkeypatch, gpu_order):
    """A step's record waits for a batch, whose size depends on timing (16 steps or 0.5 s,
    the sampler's thread on a quiet loop): what changes the training must not. The clip
    limit of `grad_explosion` (a rolling median of the norms) was taken from the steps
    recorded so far, and a "step" rule's action came at the boundary where its batch was
    recorded: the same run clipped other steps, cut the LR at another step and ended on
    other weights with another batching. Now both are the same whatever the batching: the
    limit of step N comes from the norms of the steps before N - 1, and a run whose "step"
    rules act records each step at its read."""
    alerts = {"grad_explosion": {"window": 10, "min_history": 5, "factor": 3.0},
              "loss_spike": {"min_history": 10, "window": 30, "recent": 5,
                             "actions": ["cut_lr"]}}
    one = _decisions(tmp_path, monkeypatch, "one", 1, gpu_order, alerts)
    batched = _decisions(tmp_path, monkeypatch, "batched", 16, gpu_order, alerts)
    clipped, lrs = one[:2]
    assert sum(c == 1.0 for c in clipped) >= 3, clipped  # the rule clipped steps
    assert len(set(lrs)) >= 3, lrs  # and the spikes cut the LR
    assert batched == one
