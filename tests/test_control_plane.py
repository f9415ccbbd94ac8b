"""The control plane: one lifecycle, typed commands with one outcome each, one set of
options, and rewind/skip the same in every loop nbwatch steers. Each test is a way the
implicit version broke (issue 20), through the public API."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import nbwatch
from nbwatch.controls import MAX_SKIP
from nbwatch.demo import make_demo
from nbwatch.lifecycle import ENDED, LIVE, IllegalTransition, RunState, transition
from nbwatch.panels import Feed
from nbwatch.store import RunReader
from nbwatch.widget import Dashboard
from tests.conftest import until

ROOT = Path(__file__).resolve().parents[1]


def tiny(max_steps: int = 60):
    return make_demo(d=32, layers=1, heads=2, ctx=32, max_steps=max_steps)


def outcomes(events, cid: str) -> list[str]:
    """The outcome words of the events naming command `cid`."""
    return [d["outcome"] for d in events.data if isinstance(d, dict) and d.get("id") == cid]


def own_step(demo, batch):
    out = demo.step_fn(demo.model, batch)
    loss = nbwatch.masked_cross_entropy(out["logits"], out["labels"], out["mask"])
    loss.backward()
    demo.optimizer.step()
    demo.scheduler.step()
    demo.optimizer.zero_grad()
    return loss


# -- one lifecycle ----------------------------------------------------------------------
def test_the_lifecycle_refuses_impossible_moves_with_the_reason():
    assert transition("running", "paused") is RunState.PAUSED
    assert transition(RunState.STOPPING, "stopped") == "stopped"
    with pytest.raises(IllegalTransition, match="from finished to paused: the run has"):
        transition("finished", "paused")
    with pytest.raises(IllegalTransition, match="from stopping a run can go to failed, stopped"):
        transition("stopping", "running")
    assert not LIVE & ENDED and {s.value for s in LIVE | ENDED} | {"created"} == {
        s.value for s in RunState}


def test_the_state_sets_and_command_kinds_are_written_once():
    """No module keeps its own copy of the live/ended sets (the page included)."""
    copies = []
    for p in [*(ROOT / "nbwatch").rglob("*.py"), *(ROOT / "js").rglob("*.js")]:
        if "node_modules" in p.parts or p.name == "lifecycle.py":
            continue
        text = p.read_text(encoding="utf-8")
        for literal in ('"finished", "stopped", "failed"', '"starting", "running", "paused"'):
            if literal in text:
                copies.append(f"{p.relative_to(ROOT)}: {literal}")
    assert not copies, copies


def test_the_readers_states_are_words_of_the_same_vocabulary():
    """'waiting' and 'stale' (what a reader of a folder says beyond its writer's state) are
    spelled once, in nbwatch/lifecycle.py, beside the run's own states; no module compares
    with or returns the bare word."""
    import ast

    from nbwatch.lifecycle import STALE, WAITING, FolderState

    assert {WAITING, STALE} <= set(FolderState) and STALE == "stale"
    assert not {s.value for s in FolderState} & {s.value for s in RunState}
    spelled = []
    for p in (ROOT / "nbwatch").rglob("*.py"):
        if p.name == "lifecycle.py":
            continue
        tree = ast.parse(p.read_text(encoding="utf-8"))
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef)) and n.body
                and isinstance(n.body[0], ast.Expr)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and node.value in ("waiting", "stale")
                    and id(node) not in docs):
                spelled.append(f"{p.relative_to(ROOT)}:{node.lineno}")
    assert not spelled, spelled


# -- one set of options -----------------------------------------------------------------
def test_options_given_to_the_monitor_hold_in_start_and_start_overrides_them(tmp_path):
    demo = tiny(20)
    mon = nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler, run_dir=tmp_path / "a",
                          hist_every=7, checkpoint_every=5)
    mon.start(demo.step_fn, demo.train, 20, display=False).wait()
    ckpts = mon.events[mon.events.kind == "checkpoint"]
    assert {5, 10, 15} <= set(ckpts[ckpts.data.map(lambda d: d["reason"]) == "periodic"].step)
    steps, _, _ = nbwatch.open_run(tmp_path / "a").histograms(
        next(n for n in RunReader(tmp_path / "a").histogram_names() if n.startswith("weight/")))
    assert 7 in set(steps.tolist()) and 14 in set(steps.tolist())
    assert nbwatch.open_run(tmp_path / "a").meta["run"]["options"]["hist_every"] == 7

    demo = tiny(20)
    mon = nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler, run_dir=tmp_path / "b",
                          hist_every=7, checkpoint_every=5)
    mon.start(demo.step_fn, demo.train, 20, hist_every=4, display=False).wait()
    opts = nbwatch.open_run(tmp_path / "b").meta["run"]["options"]
    assert opts["hist_every"] == 4 and opts["checkpoint_every"] == 5


# -- typed commands, one outcome each ------------------------------------------------------
def test_every_command_of_the_api_the_dashboard_and_attach_has_one_outcome(tmp_path):
    demo = tiny(100_000)
    mon = nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler, run_dir=tmp_path / "r",
                          checkpoint_every=5)
    mon.start(demo.step_fn, demo.train, 100_000, display=False)
    dash = Dashboard.for_monitor(mon)
    att = nbwatch.attach(tmp_path / "r")
    try:
        until(lambda: mon.step >= 12, 60, "step 12")
        sent = []
        for entry in (mon, dash, att):
            def send(kind, value=None, entry=entry):
                args = {"clip": {"max_norm": value}, "scale_lr": {"factor": value},
                        "rewind": {"steps": 3, "skip": 1}, "skip": {"batches": 2}}.get(kind, {})
                if entry is dash:  # a button sends its command's arguments by name
                    return dash.command(kind, **args)
                return entry.send(kind, **args)
            for kind, value in (("pause", None), ("resume", None), ("checkpoint", None),
                                ("clip", 5.0), ("scale_lr", 0.9), ("skip", 2),
                                ("rewind", [3, 1])):
                cid = send(kind, value)
                sent.append((entry, kind, cid))
                until(lambda cid=cid: outcomes(mon.events, cid), 30, f"the outcome of {kind}")
        mon.stop()
        mon.wait()
    finally:
        dash.close()
    ev = mon.events
    for entry, kind, cid in sent:
        got = outcomes(ev, cid)
        assert len(got) == 1, (type(entry).__name__, kind, got)
        assert got[0] in ("applied", "refused"), (kind, got)
    applied = {kind for _, kind, cid in sent if outcomes(ev, cid) == ["applied"]}
    assert {"pause", "resume", "checkpoint", "clip", "scale_lr", "skip", "rewind"} <= applied


def test_a_refused_rewind_changes_nothing_and_the_page_does_not_take_it_for_one(tmp_path):
    demo = tiny(40)
    seen: list[int] = []
    data = [dict(b, pos=i) for i, b in enumerate(itertools.islice(itertools.cycle(demo.train),
                                                                  400))]
    mon = nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler, run_dir=tmp_path / "r")
    asked: list[str] = []

    def step(model, batch):
        seen.append(int(batch["pos"]))
        if len(seen) == 10:
            asked.append(mon.rewind(10, skip=200))  # no checkpoint: refused
        return demo.step_fn(model, batch)

    mon.start(step, data, 40, display=False).wait()
    assert seen == list(range(40))  # not one batch thrown away
    (cid,) = asked
    ev = mon.events
    assert outcomes(ev, cid) == ["refused"]
    row = ev[[isinstance(d, dict) and d.get("id") == cid for d in ev.data]].iloc[0]
    assert row.kind == "command" and "no checkpoint" in row.data["reason"]
    feed = Feed(RunReader(tmp_path / "r"))
    while True:
        feed.update()
        if not feed.more:
            break
    feed.update()
    assert not feed.history_cut


def test_commands_sent_as_a_run_ends_expire_and_a_resume_never_replays_them(tmp_path):
    demo = tiny(90)
    mon = nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler, run_dir=tmp_path / "r")
    late: list[str] = []

    def step(model, batch):
        if mon.step == 59:  # the last step of 60: nothing takes them in this run
            late.extend([mon.scale_lr(0.1), mon.pause()])
        return demo.step_fn(model, batch)

    mon.start(step, demo.train, 60, display=False).wait()
    assert mon.state == "finished"
    assert [outcomes(mon.events, c) for c in late] == [["expired"], ["expired"]]
    mon.start(demo.step_fn, demo.train, 90, resume=True, display=False).wait(120)
    assert mon.state == "finished" and mon.step == 90  # no replayed pause held it
    assert mon.control.lr_factor == 1.0  # nor a replayed Cut LR


def test_a_command_that_passes_the_state_check_as_the_run_ends_is_refused(tmp_path,
                                                                           monkeypatch):
    """stop() read `running` a moment before the run ended (its state check passed): the
    run's queue is closed by then, so it is refused at the call, never kept for the next
    run (which stopped at once, with nobody pressing Stop)."""
    import nbwatch.monitor.session

    demo = tiny(40)
    mon = nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler, run_dir=tmp_path / "r")
    mon.start(demo.step_fn, demo.train, 20, display=False).wait()
    monkeypatch.setattr(nbwatch.monitor.session, "refuse_early", lambda *a: None)  # the window
    with pytest.raises(RuntimeError, match="stop refused: the run has just ended"):
        mon.stop()
    monkeypatch.undo()
    mon.start(demo.step_fn, demo.train, 40, resume=True, display=False).wait(120)
    assert mon.state == "finished" and mon.step == 40


# -- rewind and skip in every loop ----------------------------------------------------------
def test_rewind_and_skip_work_under_mon_run_and_a_lone_skip_is_delivered_alone(tmp_path):
    demo = tiny(80)
    mon = nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler, run_dir=tmp_path / "r",
                          checkpoint_every=10)
    told: list[tuple] = []
    asked: dict[str, str] = {}

    def train():
        batches = itertools.cycle(demo.train)
        step = 0
        while step < 60:
            loss = own_step(demo, next(batches))
            if step == 24 and "skip" not in asked:
                asked["skip"] = mon.skip(4)
            if step == 34 and "rewind" not in asked:
                asked["rewind"] = mon.rewind(steps=12, skip=0)
            step = mon.log(loss=loss)
            if mon.skip_batches or mon.rewound is not None:
                told.append((step, mon.rewound, mon.skip_batches))
                for _ in range(mon.skip_batches):
                    next(batches)

    mon.run(train).wait()
    assert mon.state == "finished", mon.traceback
    assert told[0] == (25, None, 4)  # the skip, alone, at the next log()
    assert told[1][1] == (20, 0) and told[1][2] == 0  # the rewind: not the old skip's 4
    assert [outcomes(mon.events, c) for c in asked.values()] == [["applied"], ["applied"]]


def test_a_huge_skip_is_refused_and_a_stop_during_a_long_skip_is_taken_at_once(tmp_path):
    demo = tiny(100_000)
    mon = nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler, run_dir=tmp_path / "r")

    class Slow:  # a data stream that costs time per batch, as a real loader does
        def __iter__(self):
            for b in itertools.cycle(demo.train):
                time.sleep(0.001)
                yield b

    mon.start(demo.step_fn, Slow(), 100_000, display=False)
    until(lambda: mon.step >= 3, 60, "step 3")
    with pytest.raises(ValueError, match=f"≤ {MAX_SKIP:,}"):
        mon.skip(10**9)
    mon.skip(MAX_SKIP)  # ~100 s of batches to throw away
    time.sleep(0.3)
    t0 = time.monotonic()
    mon.stop()
    mon.wait(timeout=30)
    assert mon.state == "stopped" and time.monotonic() - t0 < 20


def test_resume_after_a_rewind_continues_the_live_branch(tmp_path):
    demo = tiny(1000)
    mon = nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler, run_dir=tmp_path / "r",
                          checkpoint_every=10, keep_last=10,
                          system_interval=0.1)  # the sampler reads during the branch too
    calls = {"n": 0}

    def step(model, batch):
        calls["n"] += 1
        if calls["n"] == 46:
            mon.rewind(steps=10, skip=0)  # taken after step 46: back to step 30
        if calls["n"] == 48:
            mon.stop()  # taken after the re-run step 32
        return demo.step_fn(model, batch)

    mon.start(step, demo.train, 1000, display=False).wait()
    assert mon.state == "stopped"
    stopped_at = mon.step
    assert stopped_at == 32
    demo2 = tiny(1000)
    again = nbwatch.Monitor(demo2.model, demo2.optimizer, demo2.scheduler,
                            run_dir=tmp_path / "r", resume=True)
    assert again.step == stopped_at  # the stop checkpoint, not the abandoned step 40
    assert sorted(p.name for p in (tmp_path / "r/checkpoints/rewind/1").iterdir()) == [
        "step_00000040.pt"]
    df = nbwatch.open_run(tmp_path / "r").df
    assert list(df.index) == list(range(1, stopped_at + 1))  # no hole


# -- after a stop ---------------------------------------------------------------------------
def test_a_loop_that_swallows_stop_training_cannot_write_into_the_stopped_run(tmp_path):
    demo = tiny(200)
    mon = nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler, run_dir=tmp_path / "r")
    raised = []

    def train():
        batches = itertools.cycle(demo.train)
        for i in range(200):
            loss = own_step(demo, next(batches))
            if i == 72:
                mon.stop()
            try:
                mon.log(loss=loss)
            except nbwatch.StopTraining:
                raised.append(i)  # and goes on, as a careless loop would

    mon.run(train).wait()
    assert mon.state == "stopped" and mon.step == 73
    assert raised[0] == 72 and len(raised) == 200 - 72  # every later log() says it again
    assert nbwatch.open_run(tmp_path / "r").df.index.max() == 73


WRITER = textwrap.dedent("""
    import sys, time, torch
    import nbwatch
    from nbwatch.demo import make_demo
    torch.set_num_threads(1)
    demo = make_demo(d=32, layers=1, heads=2, ctx=32, max_steps=100000)
    mon = nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler, run_dir=sys.argv[1],
                          system_interval=60)
    mon.start(demo.step_fn, demo.train, 100000, display=False)
    mon.wait()
""")


def test_a_paused_run_whose_writer_holds_its_lock_is_never_stale(tmp_path):
    run = tmp_path / "r"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(run)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        att = nbwatch.attach(run, stale_after=1.0)
        until(lambda: att.state == "running" and att.step >= 3, 90, "the writer to run")
        att.pause()
        until(lambda: att.state == "paused", 30, "the pause")
        time.sleep(2.5)  # silent (system_interval=60) for longer than stale_after
        assert att.state == "paused", att.message
        att.resume()
        until(lambda: att.state == "running", 30, "the resume")
        att.stop()
        proc.wait(60)
    finally:
        proc.kill()
    assert nbwatch.open_run(run).state == "stopped"
