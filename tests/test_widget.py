"""The dashboard widget at the Python level: what it sends, the replay a late view gets,
and buttons reaching a real Monitor training the tiny GPT."""

from __future__ import annotations

import sqlite3
import sys
import time

import numpy as np
import pytest

import nbwatch
from nbwatch.magic import nbwatch_magic, remember
from nbwatch.records import Scalars
from nbwatch.store import RunStore, is_run_dir
from nbwatch.widget import Dashboard, pack
from tests.conftest import tiny_step, until


class Outbox:
    """Collects what the widget sends (the comm outside a kernel goes nowhere)."""

    def __init__(self, dash: Dashboard):
        self.msgs: list[tuple[dict, list]] = []
        dash.send = lambda content, buffers=None: self.msgs.append((content, buffers or []))

    def of(self, kind: str) -> list[tuple[dict, list]]:
        return [m for m in self.msgs if m[0]["type"] == kind]


def unpack(obj, buffers):
    if isinstance(obj, dict):
        if "$buf" in obj:
            dt = {"f4": np.float32, "i4": np.int32, "u1": np.uint8}[obj["dtype"]]
            return np.frombuffer(buffers[obj["$buf"]], dtype=dt).reshape(obj["shape"])
        return {k: unpack(v, buffers) for k, v in obj.items()}
    if isinstance(obj, list):
        return [unpack(v, buffers) for v in obj]
    return obj


def slow_step(model, batch):
    time.sleep(0.03)
    return tiny_step(model, batch)


def start(tiny, tmp_path, steps=40, fn=tiny_step, **kw):
    model, opt, batches = tiny
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "run", config={"name": "<b>x</b>"})
    mon.start(fn, batches, max_steps=steps, val_fn=lambda m: 1.0, eval_every=10,
              probe_batch=batches[0], display=False, **kw)
    return mon


def test_deltas_carry_only_new_points_as_binary_buffers(tiny, tmp_path):
    mon = start(tiny, tmp_path, steps=60, fn=slow_step)
    dash = Dashboard.for_monitor(mon)
    out = Outbox(dash)
    mon.wait()
    until(lambda: not dash.polling)  # the poll thread ends once the run has ended
    deltas = [unpack(c["panels"], b) for c, b in out.of("delta")]
    assert len(deltas) >= 2
    for _, b in out.of("delta"):
        assert all(isinstance(x, memoryview) for x in b)
    train = [d["loss"]["train"] for d in deltas if "train" in d.get("loss", {})]
    steps = np.concatenate([t["x"] for t in train])
    assert train[0]["y"].dtype == np.float32
    # Each step travels once, in order; together the deltas hold what the store holds.
    assert np.all(np.diff(steps) > 0)
    df = mon.df
    assert steps[-1] == 60 and set(steps) <= set(df.index)
    last = np.concatenate([t["y"] for t in train])[-1]
    assert last == pytest.approx(df["loss/train"].iloc[-1], rel=1e-6)
    assert deltas[-1]["header"]["state"] == "finished"
    dash.close()


def test_hello_gets_plotly_once_and_the_whole_history(tiny, tmp_path):
    mon = start(tiny, tmp_path, steps=30)
    mon.wait()
    dash = Dashboard.for_run(mon.run_dir)
    until(lambda: not dash.polling)
    out = Outbox(dash)
    dash._on_msg(dash, {"type": "hello", "view": "v1", "plotly": True}, [])
    dash._on_msg(dash, {"type": "hello", "view": "v2", "plotly": False}, [])
    assert [c["type"] for c, _ in out.msgs] == ["plotly", "full", "full"]
    plotly = out.msgs[0][1][0]
    assert len(plotly) > 1_000_000 and b"scatter" in bytes(plotly[:2_000_000])
    full, bufs = out.msgs[1]
    assert full["to"] == "v1" and out.msgs[2][0]["to"] == "v2"
    p = unpack(full["panels"], bufs)
    assert list(p["loss"]["train"]["x"]) == list(range(1, 31))
    assert list(p["loss"]["val"]["x"]) == [10, 20, 30]
    assert p["header"] == {**p["header"], "step": 30, "max_steps": 30, "state": "finished"}
    assert p["header"]["name"] == "run"
    assert p["grads"]["layers"][0] == "tok_emb" and len(p["grads"]["norms"]) == 16
    # The attention overview carries no map: the page asks for the head it opens.
    att = p["attention"]
    assert "maps" not in att["samples"][0] and att["samples"][0]["entropy"].shape == (
        len(att["modules"]), att["heads"])
    out.msgs.clear()
    module = att["modules"][-1]
    dash._on_msg(dash, {"type": "attention", "view": "v2", "step": att["step"], "sample": 0,
                        "layer": len(att["modules"]) - 1, "head": 1, "module": module}, [])
    [(reply, bufs)] = out.msgs
    assert reply["to"] == "v2" and reply["module"] == module and reply["head"] == 1
    got = unpack(reply, bufs)["map"]
    want = nbwatch.open_run(mon.run_dir).attention(att["step"])[module][1]
    assert got.dtype == np.float32 and np.array_equal(got, want.astype(np.float32))
    # by the overview's row alone (no module), and a head the store lacks: map None
    dash._on_msg(dash, {"type": "attention", "view": "v2", "step": att["step"],
                        "layer": len(att["modules"]) - 1, "head": 1}, [])
    assert np.array_equal(unpack(*out.msgs[-1])["map"], got)
    dash._on_msg(dash, {"type": "attention", "view": "v2", "step": att["step"],
                        "module": module, "head": 99}, [])
    assert out.msgs[-1][0]["map"] is None
    assert set(p["weights"]["hist"]) >= {"tok_emb", "head"}
    assert [it["kind"] for it in p["alerts"]["items"]][0] == "checkpoint"
    dash.close()


def test_buttons_call_the_monitor_and_the_ack_comes_back(tiny, tmp_path):
    mon = start(tiny, tmp_path, steps=2000, fn=slow_step)
    dash = Dashboard.for_monitor(mon)
    out = Outbox(dash)
    click = lambda kind, **args: dash._on_msg(  # a button sends its arguments by name
        dash, {"type": "command", "view": "v", "kind": kind, "args": args}, [])
    try:
        until(lambda: mon.step >= 5)
        click("pause")
        until(lambda: mon.state == "paused")
        at = mon.step
        time.sleep(0.5)
        assert mon.step == at
        click("scale_lr", factor=0.5)
        click("clip", max_norm=0.05)
        click("checkpoint")
        click("resume")
        until(lambda: mon.step >= at + 5)
        until(lambda: any(
            "LR scaled" in it["message"] for c, b in out.of("delta")
            for it in unpack(c["panels"], b).get("alerts", {}).get("items", [])))
        assert list((mon.run_dir / "checkpoints").glob("*.pt"))
        df = mon.df
        assert df["grad_norm/clipped"].iloc[-1] <= 0.05 * (1 + 1e-4)
        click("clip", max_norm=None)
        click("bogus")
        assert out.of("refused")[-1][0]["message"].startswith("unknown command")
        # malformed arguments are refused, never taken as the defaults (a 100-step rewind)
        for kind, args, says in (("rewind", {"steps": "5", "skip": 0}, "steps must be an int"),
                                 ("rewind", {"steps": 1e999, "skip": 0}, "steps must be an int"),
                                 ("rewind", {"step": 5}, "rewind takes steps=, skip=; got step="),
                                 ("skip", {}, "skip takes batches=; got none")):
            click(kind, **args)
            assert says in out.of("refused")[-1][0]["message"], (kind, args)
        dash._on_msg(dash, {"type": "command", "view": "v", "kind": "rewind", "args": [5]}, [])
        assert "args are a dict" in out.of("refused")[-1][0]["message"]
        assert not mon.events.message.str.contains("rewound|skipping").any()
    finally:
        click("stop")
        mon.wait()
        dash.close()
    assert mon.state == "stopped"
    click("pause")  # a finished run refuses, politely
    assert "not running" in out.of("refused")[-1][0]["message"]
    ro = Dashboard.for_run(mon.run_dir)
    with pytest.raises(RuntimeError, match="read-only"):
        ro.command("pause")
    ro.close()


def test_failed_run_shows_red_with_traceback(tiny, tmp_path):
    def boom(model, batch):
        if boom.n == 5:
            raise RuntimeError("loss went to the moon")
        boom.n += 1
        return tiny_step(model, batch)

    boom.n = 0
    mon = start(tiny, tmp_path, steps=50, fn=boom)
    dash = Dashboard.for_monitor(mon)
    with pytest.raises(RuntimeError):
        mon.wait()
    until(lambda: not dash.polling)
    out = Outbox(dash)
    dash._on_msg(dash, {"type": "hello", "view": "v", "plotly": False}, [])
    h = out.of("full")[0][0]["panels"]["header"]
    assert h["failed"] and h["state"] == "failed"
    assert "loss went to the moon" in h["traceback"] and "Traceback" in h["traceback"]
    dash.close()


def test_close_stops_the_poll_thread_of_a_live_run(tiny, tmp_path):
    mon = start(tiny, tmp_path, steps=2000, fn=slow_step)
    dash = Dashboard.for_monitor(mon)
    until(lambda: dash.refreshes > 0)
    dash.close()
    assert not dash.polling
    mon.stop()
    mon.wait()


def test_pack_narrows_and_flags_non_finite():
    bufs: list = []
    out = pack({"a": np.arange(3, dtype=np.int64), "b": [np.float64("nan"), 1.5],
                "c": np.ones((2, 2))}, bufs)
    assert out["a"]["dtype"] == "i4" and out["c"] == {"$buf": 1, "dtype": "f4", "shape": [2, 2]}
    assert out["b"] == [None, 1.5] and len(bufs) == 2


def test_magic_shows_latest_monitor_and_reopens_runs(tiny, tmp_path, capsys):
    mon = start(tiny, tmp_path, steps=10)
    mon.wait()
    remember(mon)
    live = nbwatch_magic("")
    assert isinstance(live, Dashboard) and live.live
    ro = nbwatch_magic(str(mon.run_dir))
    assert isinstance(ro, Dashboard) and not ro.live
    nbwatch_magic(f"ls {tmp_path}")
    rows = capsys.readouterr().out.splitlines()
    assert rows[1].split()[:3] == ["run", "finished", "10/10"]  # the header, then the run
    assert nbwatch_magic(str(tmp_path / "nope")) is None
    for d in (live, ro):
        d.close()


def test_magic_ls_passes_every_argument(tmp_path, capsys):
    for name, lr in (("a", 0.1), ("b", 0.2)):
        store = RunStore(tmp_path / name)
        store.set_meta("config", {"lr": lr})
        store.set_meta("state", "finished")
        store.close()
    nbwatch_magic(f"ls {tmp_path} --where lr=0.2")
    out = capsys.readouterr().out
    assert "b " in out and "\na " not in out
    # a bad flag or value is said in the cell; the kernel sees no SystemExit
    nbwatch_magic(f"ls {tmp_path} --sort bogus")
    assert "usage: %nbwatch ls" in capsys.readouterr().out
    nbwatch_magic(f"ls {tmp_path} --where lr")
    assert "--where takes KEY=VALUE" in capsys.readouterr().out
    assert nbwatch_magic('"runs/my run') is None  # an unclosed quote: a line, no traceback
    assert "No closing quotation" in capsys.readouterr().out
    for ask in ("--help", "-h"):  # it used to look for a run folder named --help
        assert nbwatch_magic(ask) is None
        out = capsys.readouterr().out
        assert "%nbwatch RUN_DIR" in out and "holds no nbwatch run" not in out


def test_magic_takes_the_command_lines_commands(tmp_path, capsys):
    """`%nbwatch export runs/exp1` said 'export holds no nbwatch run' (the word taken for a
    folder), as did pause, resume, stop and checkpoint: each is the command line's now."""
    store = RunStore(tmp_path / "exp1")
    store.set_meta("state", "finished")
    store.close()
    assert nbwatch_magic(f"export {tmp_path / 'exp1'} -o {tmp_path / 'page.html'}") is None
    assert (tmp_path / "page.html").stat().st_size > 0
    assert "holds no nbwatch run" not in capsys.readouterr().out
    nbwatch_magic(f"stop {tmp_path / 'exp1'}")  # the command line's answer, in the cell
    said = capsys.readouterr()
    assert "cannot stop" in said.err and "finished" in said.err and "holds no" not in said.out
    nbwatch_magic("export")  # a missing argument: a usage line, no SystemExit
    assert "usage: %nbwatch export RUN_DIR" in capsys.readouterr().out
    assert nbwatch_magic(f"{tmp_path / 'exp1'} extra") is None  # two words: not one folder
    assert "takes one folder" in capsys.readouterr().out


def test_the_saved_notebooks_text_gives_an_export_call_that_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = RunStore(tmp_path / "exp1")
    store.set_meta("state", "finished")
    store.close()
    dash = Dashboard.for_run(tmp_path / "exp1")
    try:
        call = repr(dash).split("or ", 1)[1].split(" for a page")[0]
    finally:
        dash.close()
    assert call.startswith("nbwatch.export_html(")
    out = eval(call, {"nbwatch": nbwatch})  # it used to leave out the path: a TypeError
    assert out.name == "exp1.html" and out.exists()


def test_db_without_tables_yet_is_retried_not_fatal(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    sqlite3.connect(run / "nbwatch.db").close()  # the file exists, the schema not yet
    assert is_run_dir(run)
    dash = Dashboard.for_run(run)
    out = Outbox(dash)
    time.sleep(0.8)  # a few polls, each "no such table"
    assert dash.polling and not out.msgs
    store = RunStore(run)  # the writer creates its tables now
    store.set_meta("name", "late")
    for s in range(1, 11):
        store.put(Scalars(s, {"loss/train": 3.0 - 0.1 * s}))
    store.set_meta("state", "finished")
    store.close()
    until(lambda: not dash.polling)
    assert out.msgs[-1][0] == {"type": "tick", "last": True}  # the page's watch ends here
    panels = [unpack(c["panels"], b) for c, b in out.msgs if "panels" in c]
    steps = np.concatenate([p["loss"]["train"]["x"] for p in panels if "loss" in p])
    assert list(steps) == list(range(1, 11))
    assert panels[-1]["header"]["state"] == "finished"
    dash.close()


def test_header_shows_an_attached_runs_state_and_message(tmp_path):
    att = nbwatch.attach(tmp_path / "run", stale_after=0.5)
    dash = Dashboard.for_monitor(att)
    out = Outbox(dash)

    def hello() -> dict:  # what a page that renders now gets
        dash._on_msg(dash, {"type": "hello", "view": "v1"}, [])
        return [c for c, _ in out.msgs if c["type"] == "full"][-1]["panels"].get("header", {})

    try:
        # No store yet: the header says "waiting", with the attach's message.
        until(lambda: hello().get("state") == "waiting")
        assert "waiting for a run" in hello()["message"]
        # A writer that said "running" and then went silent reads "stale", not "running",
        # and the poll thread sends that change by itself.
        store = RunStore(tmp_path / "run")
        store.set_meta("name", "followed")
        store.set_meta("state", "running")
        store.put(Scalars(1, {"loss/train": 3.0}))
        store.close()
        until(lambda: any(c["type"] == "delta" and c["panels"].get("header", {}).get(
            "state") == "stale" for c, _ in out.msgs))
        head = [c["panels"]["header"] for c, _ in out.msgs
                if c["type"] == "delta" and "header" in c["panels"]][-1]
        assert head["state"] == "stale" and head["message"].startswith("stale:")
        assert head["name"] == "followed"
        assert hello()["state"] == "stale"
    finally:
        dash.close()
        att.close()


def test_a_read_only_dashboard_stops_polling_a_run_whose_writer_is_gone(tmp_path):
    import socket

    from nbwatch.records import Scalars
    from nbwatch.store import RunStore
    from nbwatch.widget import Dashboard

    store = RunStore(tmp_path / "dead")
    store.put(Scalars(1, {"loss/train": 2.0}))
    store.set_meta("state", "running")  # what a killed writer leaves behind
    store.set_meta("pid", 2**22 + 12345)  # no such process
    store.set_meta("host", socket.gethostname())
    store.close()
    dash = Dashboard.for_run(tmp_path / "dead")
    try:
        until(lambda: not dash.polling, 10, "the dashboard to stop polling a dead run")
    finally:
        dash.close()


def test_in_colab_the_extension_turns_on_the_custom_widget_manager(tmp_path, monkeypatch):
    """Colab renders third-party widgets only after `enable_custom_widget_manager()`:
    `%load_ext nbwatch` and a dashboard call it; outside Colab nothing is imported."""
    import types

    calls = []
    colab = types.ModuleType("google.colab")
    colab.output = types.SimpleNamespace(enable_custom_widget_manager=lambda: calls.append(1))
    google = types.ModuleType("google")
    google.colab = colab

    class Shell:
        def register_magic_function(self, *a, **k):
            calls.append("magic")

    nbwatch.load_ipython_extension(Shell())
    assert calls == ["magic"]  # not in Colab
    monkeypatch.setitem(sys.modules, "google", google)
    monkeypatch.setitem(sys.modules, "google.colab", colab)
    nbwatch.load_ipython_extension(Shell())
    assert calls == ["magic", 1, "magic"]
    store = RunStore(tmp_path / "r")
    store.put(Scalars(1, {"loss/train": 1.0}))
    store.close()
    d = Dashboard.for_run(tmp_path / "r")
    d.close()
    assert calls[-1] == 1


def test_the_x_axis_choice_is_kept_for_the_next_dashboard_of_the_kernel(tmp_path):
    """The page's switch sets the widget's `xaxis` (saved with the notebook); the kernel's
    next dashboard starts with the same choice (one kernel per notebook)."""
    from tests.export_run import write_run

    run = write_run(tmp_path / "run", steps=5)
    first = Dashboard.for_run(run)
    try:
        assert first.xaxis == "step"
        first.xaxis = "relative"  # what the page's switch does through the model
        second = Dashboard.for_run(run)
        assert second.xaxis == "relative"
        second.close()
    finally:
        first.close()
        Dashboard._kept_xaxis = "step"


def test_the_baseline_picker_draws_a_run_beside_this_one(tmp_path):
    """A full state offers the runs beside this one; picking one sends its loss (even once
    a finished run's poll has ended); picking none takes it away."""
    from tests.export_run import write_run

    write_run(tmp_path / "runs" / "exp0", steps=30)
    run = write_run(tmp_path / "runs" / "exp1", steps=10)
    dash = Dashboard.for_run(run)
    out = Outbox(dash)
    try:
        until(lambda: not dash.polling)
        dash._on_msg(dash, {"type": "hello", "view": "v"}, [])
        content, buffers = out.of("full")[-1]
        full = unpack(content["panels"], buffers)
        assert full["loss"]["beside"] == ["exp0"] and full["loss"]["picked"] == []
        assert "baselines" not in full["loss"]
        dash._on_msg(dash, {"type": "baseline", "view": "v", "names": ["exp0", "../etc"]}, [])
        content, buffers = out.of("delta")[-1]
        (b,) = unpack(content["panels"], buffers)["loss"]["baselines"]
        assert b["name"].startswith("run ") and b["step"] == 30 and len(b["train"]["x"]) == 30
        dash._on_msg(dash, {"type": "baseline", "view": "v", "names": []}, [])
        content, buffers = out.of("delta")[-1]
        assert unpack(content["panels"], buffers)["loss"]["baselines"] == []
    finally:
        dash.close()


def test_a_dashboard_following_a_killed_run_through_its_resume_shows_the_resumed_history(
        tmp_path):
    """A job killed and resumed (a preempted torchrun job, say) drops the steps after its
    checkpoint and records them again: a dashboard that followed it shows the history as
    the resumed run left it, once each step (it kept the dropped steps beside the new
    ones, until the page was reopened)."""
    att = nbwatch.attach(tmp_path / "run", stale_after=0.5)
    dash = Dashboard.for_monitor(att)
    out = Outbox(dash)

    def shown() -> tuple[list, list]:
        dash._on_msg(dash, {"type": "hello", "view": "v1"}, [])
        content, buffers = out.of("full")[-1]
        train = unpack(content["panels"], buffers).get("loss", {}).get("train") or {}
        return list(train.get("x", [])), list(train.get("y", []))

    try:
        first = RunStore(tmp_path / "run")  # killed at step 20: its state says "running"
        first.set_meta("started", 1000.0)
        first.set_meta("state", "running")
        for s in range(1, 21):
            first.put(Scalars(s, {"loss/train": 1.0}))
        first.close()
        until(lambda: shown()[0][-1:] == [20], 10, "the dashboard to show step 20")
        resumed = RunStore(tmp_path / "run")  # from its checkpoint of step 10
        resumed.truncate_after(10)
        resumed.set_meta("started", 2000.0)
        resumed.set_meta("state", "running")
        for s in range(11, 16):
            resumed.put(Scalars(s, {"loss/train": 5.0}))
        resumed.set_meta("state", "finished")
        resumed.close()
        until(lambda: not dash.polling, 10, "the dashboard to see the run finish")
        x, y = shown()
        assert x == list(range(1, 16))
        assert y == [1.0] * 10 + [5.0] * 5
    finally:
        dash.close()
        att.close()


def test_a_live_run_with_nothing_new_still_ticks(tmp_path, monkeypatch):
    """The page takes 15 s of silence for a kernel gone (restarted under the run): while a
    run is live and nothing is new (paused), the poll sends a tick every TICK_S."""
    import nbwatch.widget as widget

    monkeypatch.setattr(widget, "TICK_S", 0.3)
    store = RunStore(tmp_path / "run")
    store.put(Scalars(1, {"loss/train": 3.0}))
    store.set_meta("state", "paused")
    store.flush()
    try:
        dash = Dashboard.for_run(tmp_path / "run")
        out = Outbox(dash)
        until(lambda: len(out.of("tick")) >= 3, timeout=20, what="three ticks")
        assert dash.polling and not any(c.get("last") for c, _ in out.of("tick"))
        dash.close()
    finally:
        store.close()
