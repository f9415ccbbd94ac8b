"""A Monitor's own loop run in the foreground and left open (a notebook cell's loop, then
the cell run again): what ends it gives back its threads, files and hooks."""

from __future__ import annotations

import os
import threading

import torch
from torch import nn

import nbwatch


def _tiny() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=1e-2)


def _steps(mon: nbwatch.Monitor, model: nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    for _ in range(n):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        mon.log(loss=loss)


def _nbwatch_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("nbwatch")]


def test_stop_and_wait_end_a_foreground_loop_left_open(tmp_path):
    """What the refusal of a second Monitor on the optimizer (or the run_dir) advises,
    `stop()` then `wait()`, ends a loop of one's own whose loop is over: its store, sampler
    and writer lock are given back, and a new Monitor takes the optimizer."""
    model, opt = _tiny()
    fds = len(os.listdir("/proc/self/fd"))
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "a", display=False)
    _steps(mon, model, opt, 3)  # no close(): the loop ended, the run is still open
    assert mon.state == "running" and _nbwatch_threads()
    mon.stop()
    mon.wait()
    assert mon.state == "stopped" and mon.closed and mon.step == 3
    assert _nbwatch_threads() == [] and len(os.listdir("/proc/self/fd")) == fds
    again = nbwatch.Monitor(model, opt, run_dir=tmp_path / "b", display=False)
    with again:
        _steps(again, model, opt, 2)
    assert again.state == "finished" and again.step == 2
    assert nbwatch.open_run(tmp_path / "a").state == "stopped"


def test_wait_on_a_foreground_loop_without_a_stop_ends_it_finished(tmp_path):
    model, opt = _tiny()
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "a", display=False)
    _steps(mon, model, opt, 2)
    mon.wait()
    assert mon.state == "finished" and mon.closed and _nbwatch_threads() == []
    mon.wait()  # ended: nothing more to do
