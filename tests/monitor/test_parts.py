"""Each part of a `Monitor` alone, without a Monitor around it: what it was given
(`Setup`), one run opened, held and closed (`RunSession`), the training thread
(`TrainingThread`) and the run's end with its process (`ProcessExit`)."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest
import torch

from nbwatch import Run
from nbwatch.controls import make_command
from nbwatch.monitor.background import TrainingThread
from nbwatch.monitor.exiting import ProcessExit
from nbwatch.monitor.options import Options
from nbwatch.monitor.session import RunSession
from nbwatch.monitor.setup import Setup


def given(tmp_path: Path, **kw) -> Setup:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    args = dict(scaler=None, name=None, keep_last=2, system_interval=1.0, alerts=None,
                on_alert=None, baseline=None)
    return Setup.of(model, opt, None, kw.pop("run_dir", tmp_path / "run"), None,
                    **{**args, **kw})


def one_step(setup: Setup) -> torch.Tensor:
    loss = setup.model(torch.randn(3, 4)).square().mean()
    loss.backward()
    setup.optimizer.step()
    setup.optimizer.zero_grad()
    return loss.detach()


# -- Setup ---------------------------------------------------------------------------
def test_setup_checks_what_it_is_given_and_is_fixed_once_made(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    setup = given(tmp_path, run_dir="rel")
    assert setup.run_dir == tmp_path / "rel" and setup.run_dir.is_absolute()
    assert setup.name == "rel" and setup.rank == 0 and setup.control.clip is None
    assert {r.name for r in setup.rules} >= {"loss_spike", "nonfinite"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        setup.model = torch.nn.Linear(1, 1)  # type: ignore[misc]
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no parameters that require grad"):
        Setup.of(frozen, torch.optim.SGD([torch.zeros(1, requires_grad=True)]), None,
                 tmp_path / "x", None, scaler=None, name=None, keep_last=2,
                 system_interval=1.0, alerts=None, on_alert=None, baseline=None)
    with pytest.raises(KeyError, match="no_such_rule"):
        given(tmp_path, alerts={"no_such_rule": {"enabled": False}})


# -- RunSession ----------------------------------------------------------------------
def test_a_session_opens_its_loop_at_the_first_optimizer_step_and_closes_it(tmp_path):
    setup = given(tmp_path)
    opened = []
    session = RunSession(setup, Options(hist_every=0, attention_samples=0),
                         on_loop_open=lambda: opened.append(session.recorder))
    assert session.state == "created" and not session.running and session.closed.is_set()
    for i in range(3):
        loss = one_step(setup)  # the first: the optimizer's hooks open a loop's run
        if i == 0:
            rec = session.recorder
            assert opened == [rec] and session.mode == "loop" and session.running
            assert not session.closed.is_set() and session.clips_are_the_loops()
            with pytest.raises(RuntimeError, match="already running"):
                session.check_can_open(resume=False)
        session.recorder_for_log(None).record_step({"loss/train": float(loss)},
                                                   ["loss/train"], [], reduction="test")
    session.end_loop(None)
    assert session.closed.is_set() and session.recorder is None and not session.running
    run = Run(setup.run_dir)
    assert run.state == "finished" and run.step == session.step
    assert run.meta["run"]["mode"] == "loop"
    with pytest.raises(RuntimeError, match="already ran"):
        session.check_can_open(resume=False)


def test_a_stop_submitted_to_a_session_is_its_stopping(tmp_path):
    setup = given(tmp_path)
    session = RunSession(setup, Options(hist_every=0, attention_samples=0))
    with pytest.raises(RuntimeError):  # nothing is open: refused at once, not queued
        session.submit(make_command("stop"))
    one_step(setup)
    session.submit(make_command("stop"))
    assert session.stopping and session.stop_asked
    session.end_loop(None)
    assert Run(setup.run_dir).state == "stopped"


# -- TrainingThread --------------------------------------------------------------------
def test_the_training_thread_runs_its_target_then_its_end_and_refuses_a_wait_from_inside():
    thread = TrainingThread()
    with pytest.raises(RuntimeError, match="before start"):
        thread.wait(None, lambda: 0)
    go, ended, inside = threading.Event(), [], []

    def target():
        go.wait(10)
        try:
            thread.wait(None, lambda: 0)
        except RuntimeError as e:
            inside.append(str(e))

    thread.start(target, "nbwatch-train-test", on_end=lambda: ended.append(thread.done.is_set()))
    assert thread.started and not thread.done.is_set()
    with pytest.raises(TimeoutError, match="at step 7 after 0.2s"):
        thread.wait(0.2, lambda: 7)
    go.set()
    thread.wait(10, lambda: 0)  # the target and the finisher both ended
    assert ended == [True] and "own training thread" in inside[0]
    assert not any(t.is_alive() for t in thread.threads if t is not None)


# -- ProcessExit -----------------------------------------------------------------------
def test_an_exit_under_a_running_thread_records_the_stop_first_then_sends_it(tmp_path, capsys):
    setup = given(tmp_path)
    session = RunSession(setup, Options(hist_every=0, attention_samples=0))
    session.open("run", session.options.spec(), False, session.options, {})
    thread, asked = TrainingThread(), threading.Event()
    sent = []

    def send(kind, source="api"):
        sent.append((kind, source))
        asked.set()
        return "id"

    thread.start(lambda: asked.wait(10), "nbwatch-train-exit", on_end=session.close_run)
    exit_ = ProcessExit(session, thread, send)
    exit_.stop_at_exit()
    assert sent == [("stop", "exit")] and thread.done.is_set()
    run = Run(setup.run_dir)
    assert run.meta["state"] == "stopped" and "exited at step 0" in run.meta["stopped_by"]
    assert "was stopped at step 0" in capsys.readouterr().err


def test_an_exit_in_a_forked_child_leaves_the_parents_run_alone(tmp_path, monkeypatch):
    setup = given(tmp_path)
    session = RunSession(setup, Options(hist_every=0, attention_samples=0))
    one_step(setup)  # a loop's run is open
    exit_ = ProcessExit(session, TrainingThread(), lambda *a, **k: "id")
    monkeypatch.setattr("nbwatch.monitor.exiting.forked_from", lambda pid: True)
    exit_.at_exit()
    assert session.running  # a DataLoader worker's exit ended nothing
    monkeypatch.undo()
    exit_.at_exit()  # the owner's exit ends the loop's run: finished, closed
    assert not session.running and session.closed.is_set()
    assert Run(setup.run_dir).state == "finished"
