"""How a run meets its process's end (nbwatch/monitor/exiting.py): what arming the
SIGTERM handler at a run's open may read."""

from __future__ import annotations

import sys
import types

import pytest
import torch

import nbwatch


@pytest.mark.parametrize("where", ["thread", "foreground"])
def test_a_run_opens_while_another_thread_imports_ipython(where, tmp_path, monkeypatch):
    """`nbwatch.hf.start(trainer)` in a script failed now and then at the fit's first step
    ("AttributeError: partially initialized module 'IPython' has no attribute
    'get_ipython'"), recorded nowhere: the main thread was importing IPython while the fit
    thread opened its run. A module half imported has no shell: the run trains."""
    monkeypatch.setitem(sys.modules, "IPython", types.ModuleType("IPython"))  # mid-import
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "run", display=False)

    def train() -> None:
        for _ in range(3):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            mon.log(loss=loss)

    if where == "thread":
        mon.run(train)
        mon.wait()
    else:
        with mon:
            train()
    assert (mon.state, mon.step) == ("finished", 3)


@pytest.mark.parametrize("loop", ["framework", "own"])
def test_a_run_that_fails_to_open_is_recorded_failed(loop, tmp_path, monkeypatch):
    """An error while a run opened (after its store had) left the run open: the Trainer's
    fit raised (a loop of one's own: its first optimizer.step()), and the process's exit
    then recorded the run `finished` at step 0, with a final checkpoint and no error. It
    is `failed`, with the error, and its folder is given back."""
    from nbwatch.monitor.monitor import Monitor

    def fails(self, display):
        raise RuntimeError("the dashboard could not be shown")

    monkeypatch.setattr(Monitor, "_shown", fails)  # the last thing the run's open does
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "run", display=False)
    with pytest.raises(RuntimeError, match="could not be shown"):
        if loop == "framework":
            mon.open_external("myfw")
        else:
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()  # a loop of one's own opens its run at its first step
    assert mon.state == "failed" and mon.closed
    run = nbwatch.open_run(tmp_path / "run")
    assert run.state == "failed"
    assert "could not be shown" in run.events.query("kind == 'error'")["message"].iloc[0]
