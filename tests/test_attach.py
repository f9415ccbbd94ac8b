"""`nbwatch.attach`: a real training subprocess, followed and steered from this process."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import nbwatch
from nbwatch.store import RunReader
from nbwatch.widget import Dashboard
from tests.conftest import until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = textwrap.dedent("""
    import sys, time, torch
    import nbwatch
    from nbwatch.demo import TinyGPT
    from tests.conftest import make_batches, tiny_step

    def step(model, batch):
        time.sleep(0.02)
        return tiny_step(model, batch)

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = nbwatch.Monitor(model, opt, run_dir=sys.argv[1], config={"lr": 1e-3})
    mon.start(step, make_batches(), max_steps=100_000, display=False)
    mon.wait()
""")


def spawn(run: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SCRIPT, str(run)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": ROOT})


def actions(att) -> list[dict]:
    ev = att.events
    return [d for d in ev[ev.kind == "action"].data]


def test_attach_follows_pauses_resumes_and_stops_a_subprocess(tmp_path):
    run = tmp_path / "run"
    att = nbwatch.attach(run, stale_after=3.0, display=False)  # before the run exists
    assert att.state == "waiting" and att.step == 0 and not att.running
    assert "waiting" in att.message and att.df.empty and att.events.empty
    with pytest.raises(RuntimeError, match="not started"):
        att.pause()
    proc = spawn(run)
    dash = None
    try:
        until(lambda: att.step >= 1, 60, "the subprocess's first step")
        # The live dashboard, its buttons steering the subprocess. (Made once the store has
        # its tables: the widget's poll thread does not yet survive a store mid-creation.)
        dash = Dashboard.for_monitor(att)
        assert att.state == "running" and att.running and att.config == {"lr": 1e-3}

        # Latency: how long after the writer stamped a step does the attached side see it
        # (the writer commits every 0.2 s, so one poll sees several new steps at once).
        seen_at: dict[int, float] = {}
        seen = att.step
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            s = att.step
            if s > seen:
                seen_at.update(dict.fromkeys(range(seen + 1, s + 1), time.time()))
                seen = s
            time.sleep(0.01)
        walls = RunReader(run).walls()
        lags = [t - walls[s] for s, t in seen_at.items()]
        assert len(lags) >= 3, "the subprocess made no progress in 2 s"
        print(f"attach latency: median {statistics.median(lags):.3f} s, max {max(lags):.3f} s "
              f"over {len(lags)} new steps")
        assert max(lags) < 1.0

        dash.command("pause")  # the Pause button
        until(lambda: att.state == "paused", 5, "the subprocess to pause")
        paused_at = att.step
        time.sleep(3.5)  # longer than stale_after: the 1 Hz system rows keep it alive
        assert att.step == paused_at, "steps went on after the pause was acknowledged"
        assert att.state == "paused", att.message
        assert any(a["command"] == "pause" and a["source"].startswith("attach:")
                   for a in actions(att))

        att.set_clip(1.0)
        att.resume()
        until(lambda: att.step > paused_at + 3, 5, "steps after the resume")
        kinds = [a["command"] for a in actions(att)]
        assert kinds[-2:] == ["clip", "resume"]
        with pytest.raises(ValueError, match="positive"):
            att.scale_lr(-1)

        att.stop()
        assert proc.wait(30) == 0
        assert att.wait(timeout=5).state == "stopped"
        assert not att.running and att.message.startswith("stopped at step")
        with pytest.raises(RuntimeError, match="stopped"):
            att.pause()
        assert att.error is None and len(att.df) == att.step
        until(lambda: not dash.polling, 5, "the dashboard to see the end of the run")
        assert dash.refreshes > 0 and dash._feed is not None and dash._feed.step == att.step
    finally:
        proc.kill()
        if dash is not None:
            dash.close()
        att.close()


def test_attach_reports_a_killed_writer_as_stale(tmp_path):
    run = tmp_path / "run"
    proc = spawn(run)
    try:
        att = nbwatch.attach(run, timeout=60, stale_after=2.0, display=False)
        until(lambda: att.step >= 3, 60, "the subprocess's first steps")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        killed = time.monotonic()
        until(lambda: att.state == "stale", 10, "the attached run to turn stale", poll=0.1)
        print(f"stale reported {time.monotonic() - killed:.1f} s after kill -9 "
              f"(stale_after=2)")
        assert att.meta["state"] == "running"  # what the store says; attach knows better
        assert not att.running
        assert "stale" in att.message and "written nothing for" in att.message
        with pytest.raises(RuntimeError, match="stale"):
            att.stop()
        with pytest.raises(RuntimeError, match="stale"):
            att.wait(timeout=1)
        att.close()
    finally:
        proc.kill()


def test_attach_timeout_names_the_folder(tmp_path):
    with pytest.raises(TimeoutError, match="no nbwatch run appeared in"):
        nbwatch.attach(tmp_path / "never", timeout=0.2, display=False)


def test_a_relative_run_dir_survives_a_chdir(tmp_path, monkeypatch):
    """open_run("runs/x") and attach("runs/x"), then %cd elsewhere: both still read the run
    (they read "unable to open database file", or said the folder was deleted)."""
    from nbwatch.records import Scalars
    from nbwatch.store import RunStore

    store = RunStore(tmp_path / "runs" / "x")
    for step in range(1, 6):
        store.put(Scalars(step, {"loss/train": 1.0 / step}))
    store.set_meta("state", "finished")
    store.close()
    monkeypatch.chdir(tmp_path)
    run, att = nbwatch.open_run("runs/x"), nbwatch.attach("runs/x")
    monkeypatch.chdir(tmp_path / "runs")
    assert run.step == 5 and len(run.df) == 5
    assert att.step == 5 and len(att.df) == 5
    att.close()


def test_attach_to_a_file_says_it_takes_a_folder_at_once(tmp_path):
    """`attach("runs/exp1/nbwatch.db")` used to wait out its timeout as if the run had not
    started yet: it is refused at once, naming what to pass."""
    db = tmp_path / "nbwatch.db"
    db.write_bytes(b"")
    t0 = time.monotonic()
    with pytest.raises(NotADirectoryError, match="takes a run folder.*is a file"):
        nbwatch.attach(db, timeout=30, display=False)
    assert time.monotonic() - t0 < 5
