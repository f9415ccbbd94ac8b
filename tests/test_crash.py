"""`kill -9` of a real training subprocess: the store keeps all but the last second, and
every checkpoint left on disk loads. SIGTERM: the run stops with every step it took."""

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import nbwatch
from nbwatch.demo import TinyGPT
from nbwatch.store import RunReader, blocks
from tests.conftest import until

SCRIPT = textwrap.dedent("""
    import sys, time, torch
    import nbwatch
    from nbwatch.demo import TinyGPT
    from tests.conftest import make_batches, tiny_step

    def step(model, batch):
        time.sleep(0.01)
        return tiny_step(model, batch)

    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = nbwatch.Monitor(model, opt, run_dir=sys.argv[1])
    mon.start(step, make_batches(), max_steps=100_000, checkpoint_every=7, display=False)
    mon.wait()
""")


def reached(run: Path, proc: subprocess.Popen, step: int) -> bool:
    """The training subprocess has committed `step` (it must not have died meanwhile)."""
    assert proc.poll() is None, "training subprocess died on its own"
    try:
        return (run / "nbwatch.db").exists() and RunReader(run).last_step() >= step
    except sqlite3.OperationalError:  # the writer is still creating the schema
        return False


def test_kill_9_loses_at_most_the_last_second(tmp_path):
    run = tmp_path / "run"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(run)], cwd=root,
                            env={**os.environ, "PYTHONPATH": root})
    try:
        until(lambda: reached(run, proc, 60), 60, "the subprocess to reach step 60", poll=0.1)
        killed_at = time.time()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        proc.kill()
    reader = RunReader(run)
    walls = reader.walls()
    assert killed_at - walls.iloc[-1] < 1.0, "more than the last second of steps was lost"
    assert walls.index.tolist() == list(range(1, len(walls) + 1))  # no hole before the end
    checkpoints = sorted((run / "checkpoints").glob("step_*.pt"))
    assert checkpoints
    for path in checkpoints:
        ck = torch.load(path, weights_only=True)
        assert ck["step"] % 7 == 0 and set(ck["model"]) >= {"head.weight", "tok_emb.weight"}
    assert reader.meta()["state"] == "running"  # what the killed writer last recorded
    assert nbwatch.open_run(run).state == "stale"  # what a reader is told: its writer is gone
    reader.close()


RESUMABLE = textwrap.dedent("""
    import sys, torch
    import nbwatch
    from nbwatch.demo import TinyGPT
    from tests.conftest import make_batches, tiny_step

    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = nbwatch.Monitor(model, opt, run_dir=sys.argv[1])
    resume = sys.argv[2] == "resume"
    mon.start(tiny_step, make_batches(), max_steps=int(sys.argv[3]), checkpoint_every=3,
              resume=resume, display=False)
    mon.wait()
""")


def test_kill_9_then_resume_records_every_step_exactly_once(tmp_path):
    """Checkpoints every 3 steps at full speed: the newest checkpoint must never be newer
    than what the store committed, or the resumed run's history has a hole."""
    run = tmp_path / "run"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    proc = subprocess.Popen([sys.executable, "-c", RESUMABLE, str(run), "new", "100000"],
                            cwd=root, env=env)
    try:
        until(lambda: reached(run, proc, 120), 90, "the subprocess to reach step 120")
        time.sleep(0.1)  # a commit was just seen: kill halfway to the next one
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        proc.kill()
    killed_at = RunReader(run).last_step()
    end = killed_at + 30
    subprocess.run([sys.executable, "-c", RESUMABLE, str(run), "resume", str(end)],
                   cwd=root, env=env, check=True, timeout=120)
    reader = RunReader(run)
    assert reader.meta()["state"] == "finished"
    recorded = np.concatenate([
        blocks.decode(first, steps, values, reader.layout(lid))[0]
        for _, lid, first, steps, values, _ in reader.block_rows(["loss/train"])])
    assert sorted(recorded.tolist()) == list(range(1, end + 1))  # every step, once
    assert reader.walls().index.tolist() == list(range(1, end + 1))
    assert reader.df()["loss/train"].notna().all()


def test_a_run_killed_before_its_first_checkpoint_says_what_to_do(tmp_path):
    """Both ways in name the same way out (they used to point at each other)."""
    run = tmp_path / "run"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = SCRIPT.replace("checkpoint_every=7", "checkpoint_every=100_000")
    proc = subprocess.Popen([sys.executable, "-c", script, str(run)], cwd=root,
                            env={**os.environ, "PYTHONPATH": root})
    try:
        until(lambda: reached(run, proc, 5), 60, "the subprocess to reach step 5", poll=0.1)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        proc.kill()
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(FileNotFoundError) as resumed:
        nbwatch.Monitor(model, opt, run_dir=run, resume=True)
    mon = nbwatch.Monitor(model, opt, run_dir=run)
    with pytest.raises(FileExistsError) as fresh:
        mon.start(lambda m, b: m(b["input_ids"]).sum(), [{}], max_steps=1, display=False)
    for err in (resumed.value, fresh.value):
        assert "before its first checkpoint" in str(err)
        assert "new run_dir" in str(err) and "delete this folder" in str(err)
        assert "resume=True to continue" not in str(err) and "without resume" not in str(err)


FORK = textwrap.dedent("""
    import os, sys, time, torch
    import nbwatch
    from nbwatch.demo import TinyGPT
    from tests.conftest import make_batches, tiny_step

    def step(model, batch):
        time.sleep(0.01)
        return tiny_step(model, batch)

    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = nbwatch.Monitor(model, opt, run_dir=sys.argv[1])
    mon.start(step, make_batches(), max_steps=100_000, display=False)
    while mon.step < 3:
        time.sleep(0.05)
    pid = os.fork()
    if pid == 0:
        sys.exit(0)  # the child's exit: nbwatch's exit hook must not wait for the parent's run
    t0 = time.monotonic()
    os.waitpid(pid, 0)
    print(f"child exited in {time.monotonic() - t0:.1f} s", flush=True)
    mon.stop()
    mon.wait()
    print("parent", mon.state, flush=True)
""")


def test_a_forked_child_exits_at_once_and_leaves_the_parents_run_alone(tmp_path):
    """After `os.fork()` (DataLoader workers fork too) a child's `sys.exit(0)` used to wait
    in nbwatch's exit hook for a training thread it does not have (up to 300 s) and try to
    record the parent's run as stopped. Now the child exits at once and the parent's run
    trains on, to the stop it is asked."""
    run = tmp_path / "run"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", FORK, str(run)], cwd=root, timeout=120,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": root})
    assert out.returncode == 0, out.stderr
    waited = float(out.stdout.split("child exited in ")[1].split(" s")[0])
    assert waited < 10, out.stdout
    assert "parent stopped" in out.stdout, out.stdout + out.stderr
    assert "the program exited" not in out.stderr, out.stderr
    run_ = nbwatch.open_run(run)
    assert run_.meta.get("stopped_by") is None and run_.meta["state"] == "stopped"


NAN_PAUSE = textwrap.dedent("""
    import math, sys, time, torch
    import nbwatch
    from nbwatch.demo import TinyGPT
    from tests.conftest import make_batches, tiny_step

    calls = 0

    def step(model, batch):
        global calls
        calls += 1
        out = tiny_step(model, batch)
        if calls == 4:
            out["logits"] = out["logits"] * math.nan
        return out

    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = nbwatch.Monitor(model, opt, run_dir=sys.argv[1])
    mon.start(step, make_batches(), max_steps=100_000, display=False)
    mon.wait()
    print("ended", mon.state, flush=True)
""")


def test_a_script_paused_by_an_alert_says_so_on_stderr_and_how_to_go_on(tmp_path):
    """The default `nonfinite` rule pauses a run whose loss goes NaN. In a script nobody
    sees a dashboard: `wait()` used to block for ever without a word. The pause is said on
    stderr with how to go on, and following it (attach from another process, stop) ends
    the script."""
    run = tmp_path / "run"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-c", NAN_PAUSE, str(run)], cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": root})
    try:
        line = ""
        deadline = time.monotonic() + 90
        while "paused run" not in line and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "the script ended before it paused"
        assert "alert nonfinite paused run" in line and "attach(" in line, line
        att = nbwatch.attach(run, display=False)
        att.stop()
        att.close()
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "ended stopped" in out, out + err


TERMINATED = textwrap.dedent("""
    import signal, sys, time, torch
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a Ctrl-C: even where the
    import nbwatch                                            # test runner ignores it
    from nbwatch.demo import TinyGPT
    from tests.conftest import make_batches, tiny_step

    run_dir, how, logged = sys.argv[1], sys.argv[2], open(sys.argv[3], "w")
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = torch.utils.data.DataLoader(make_batches(), batch_size=None, num_workers=1)
    asked = []
    if how == "own handler":
        signal.signal(signal.SIGTERM, lambda *a: asked.append(True))

    def step(model, batch):
        time.sleep(0.01)
        return tiny_step(model, batch)

    def loop(mon):
        while not asked:
            for batch in batches:  # a worker forked and ended each epoch
                out = step(model, batch)
                loss = nbwatch.masked_cross_entropy(out["logits"], out["labels"], out["mask"])
                loss.backward(); opt.step(); opt.zero_grad()
                mon.log(loss=loss)
                print(mon.step, file=logged, flush=True)
                if asked:
                    break

    mon = nbwatch.Monitor(model, opt, run_dir=run_dir, display=False)
    if how == "start":
        mon.start(step, make_batches(), max_steps=100_000, display=False)
        mon.wait()
    elif how == "own loop, no with":
        loop(mon)
    else:
        with mon:
            loop(mon)
    print("the script went on", flush=True)
""")


def sigterm_at(run: Path, how: str, logged: Path, step: int,
               sig: int = signal.SIGTERM) -> tuple[int, str, str]:
    """Run TERMINATED `how`, send it SIGTERM (or `sig`) once `step` is in its folder: its
    exit status, stdout and stderr."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-c", TERMINATED, str(run), how, str(logged)],
                            cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": root})
    try:
        until(lambda: reached(run, proc, step), 90, f"the subprocess to reach step {step}",
              poll=0.1)
        os.kill(proc.pid, sig)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return proc.returncode, out, err


@pytest.mark.parametrize("how", ["own loop", "start"])
def test_ctrl_c_in_a_script_is_said_as_such(tmp_path, how):
    """Ctrl-C in a script's own loop, or in its mon.wait(): the folder says why the run
    stopped (an own loop's said nothing), and the message does not tell a script that
    called mon.wait() to call it."""
    run, logged = tmp_path / "run", tmp_path / "logged.txt"
    _, _, err = sigterm_at(run, how, logged, 10, sig=signal.SIGINT)
    r = nbwatch.open_run(run)
    assert r.state == "stopped" and r.meta["stopped_by"].startswith(
        "interrupted (Ctrl-C) at step"), r.meta.get("stopped_by")
    assert "Call mon.wait()" not in err, err
    if how == "start":
        assert "nbwatch: Ctrl-C ended the program while run" in err, err


@pytest.mark.parametrize("how", ["own loop", "own loop, no with", "start"])
def test_sigterm_stops_a_scripts_run_with_every_step_and_a_checkpoint(tmp_path, how):
    """`kill`, a scheduler's preemption or time limit, `docker stop`: a script's SIGTERM
    used to end the process at once, its last steps lost in the store's queue and the run
    read `stale`. Now it ends as Ctrl-C does: `stopped`, said why and at which step, every
    step the loop logged recorded, a stop checkpoint that resumes; the process exits 143
    as the signal asks, without running on past the loop."""
    run, logged = tmp_path / "run", tmp_path / "logged.txt"
    code, out, err = sigterm_at(run, how, logged, 20)
    assert code == 128 + signal.SIGTERM, err
    # (a DataLoader's resource sharer may print its own reset connection as the worker goes;
    # a SIGTERM that lands in an at-fork callback (logging's, as the DataLoader forks its
    # worker) is printed and dropped by Python, "Exception ignored in", and raised again at
    # the next log(): test_sigterm_during_a_dataloaders_fork_ends_the_loop_at_its_next_step)
    dropped = "Exception ignored in" in err
    assert "the script went on" not in out and (dropped or "nbwatch/" not in err), err
    assert "terminated by SIGTERM at step" in err, err
    r = nbwatch.open_run(run)
    assert r.state == "stopped" and r.meta["stopped_by"].startswith("terminated by SIGTERM")
    steps = r.df.index.tolist()
    assert steps == list(range(1, r.step + 1)) and r.step >= 20
    if how != "start":  # every step the loop logged is in the folder
        assert r.step - 1 <= int(logged.read_text().split()[-1]) <= r.step
    ck = torch.load(run / "checkpoints" / f"step_{r.step:08d}.pt", weights_only=True)
    assert ck["step"] == r.step


def test_a_scripts_own_sigterm_handler_is_left_as_it_is(tmp_path):
    """A script that handles SIGTERM itself (to end its loop its own way) keeps its
    handler: the loop ends as it decides, the run `finished`, the script goes on."""
    run, logged = tmp_path / "run", tmp_path / "logged.txt"
    code, out, err = sigterm_at(run, "own handler", logged, 10)
    assert code == 0, err
    assert "the script went on" in out and "SIGTERM" not in err, err
    r = nbwatch.open_run(run)
    assert r.state == "finished" and int(logged.read_text().split()[-1]) == r.step


def test_a_handler_that_hands_sigterm_on_to_a_finished_runs_ends_the_process(tmp_path,
                                                                             monkeypatch):
    """A start() run's SIGTERM handler outlives the run (its training thread cannot unset
    it). A handler the script sets over it that does its own cleanup and then calls the
    one it found (the usual chain) asks for that one's answer, the default's: the process
    ends. Only a handler that answers the signal itself (Lightning's, which calls the one
    it found as a notice: tests/test_lightning.py) is left to answer it; the chain's
    SIGTERM was swallowed and the script ran on."""
    from nbwatch.monitor import exiting

    net = torch.nn.Linear(4, 1)
    mon = nbwatch.Monitor(net, torch.optim.SGD(net.parameters(), lr=0.1),
                          run_dir=tmp_path / "r", display=False)
    mon.start(lambda m, b: m(b).square().mean(), [torch.randn(2, 4)] * 3, max_steps=3).wait()
    found = signal.getsignal(signal.SIGTERM)
    assert found is exiting._on_sigterm  # left set
    killed, cleaned = [], []
    monkeypatch.setattr(exiting.os, "kill", lambda pid, sig: killed.append(sig))

    def cleanup_then_hand_on(signum, frame):
        cleaned.append(signum)
        found(signum, frame)

    monkeypatch.setattr(signal, "getsignal", lambda signum: cleanup_then_hand_on)
    monkeypatch.setattr(signal, "signal", lambda signum, handler: None)
    cleanup_then_hand_on(signal.SIGTERM, None)
    assert cleaned == [signal.SIGTERM] and killed == [signal.SIGTERM]


HELD = textwrap.dedent("""
    import signal, sys, threading, time, torch
    import nbwatch
    from nbwatch.demo import TinyGPT
    from tests.conftest import make_batches, tiny_step

    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = nbwatch.Monitor(model, opt, run_dir=sys.argv[1], display=False)
    for batch in make_batches()[:5]:
        out = tiny_step(model, batch)
        loss = nbwatch.masked_cross_entropy(out["logits"], out["labels"], out["mask"])
        loss.backward(); opt.step(); opt.zero_grad()
        mon.log(loss=loss)
    store, main = mon._session.store, threading.main_thread().ident

    def in_put():
        f = sys._current_frames()[main]
        while f is not None and f.f_code.co_name != "put":
            f = f.f_back
        return f is not None

    def writer():  # holds the store's lock, as its writer thread does now and then
        with store._cond:
            while not in_put():
                time.sleep(0.01)
            time.sleep(0.2)  # the main thread waits for the lock
            signal.raise_signal(signal.SIGTERM)  # handled by the main thread once it runs

    threading.Thread(target=writer).start()
    store.set_meta("waited", True)  # a record's put, as the loop's log() makes
    print("the script went on", flush=True)
""")


def run_to_its_end(script: str, run: Path, timeout: float) -> tuple[int, str, str]:
    """Run `script` with `run` as its argument until it exits: (code, stdout, stderr)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-c", script, str(run)], cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": root})
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return proc.returncode, out, err


def test_sigterm_as_the_loop_takes_the_stores_lock_ends_the_process_at_once(tmp_path):
    """A SIGTERM handled just as the loop's thread took the store's lock (it waited for
    its writer) raised `Terminated` inside `Condition.__enter__`, which left the lock held:
    the writer waited on it forever, and the run's close at the process's exit 60 s (CI
    saw `own loop, no with` hang so, 1 run in 3)."""
    run = tmp_path / "run"
    code, out, err = run_to_its_end(HELD, run, timeout=40)
    assert code == 128 + signal.SIGTERM, err
    assert "the script went on" not in out and "terminated by SIGTERM at step 5" in err, err
    r = nbwatch.open_run(run)
    assert r.state == "stopped" and r.step == 5


FORKED = textwrap.dedent("""
    import os, signal, sys, torch
    import nbwatch
    from nbwatch.demo import TinyGPT
    from tests.conftest import make_batches, tiny_step

    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = torch.utils.data.DataLoader(make_batches(n=4), batch_size=None, num_workers=1)
    sent = []

    def after_the_fork():  # where Python handles a SIGTERM that lands during a fork
        if not sent:
            sent.append(True)
            signal.raise_signal(signal.SIGTERM)

    mon = nbwatch.Monitor(model, opt, run_dir=sys.argv[1], display=False)
    for epoch in range(10):
        for batch in batches:  # a worker forked each epoch
            out = tiny_step(model, batch)
            loss = nbwatch.masked_cross_entropy(out["logits"], out["labels"], out["mask"])
            loss.backward(); opt.step(); opt.zero_grad()
            mon.log(loss=loss)
        if epoch == 0:
            os.register_at_fork(after_in_parent=after_the_fork)
    print("the script went on", flush=True)
""")


def test_sigterm_during_a_dataloaders_fork_ends_the_loop_at_its_next_step(tmp_path):
    """A SIGTERM that lands while a DataLoader forks its worker is handled in an at-fork
    callback, where Python prints `Terminated` and drops it: the loop trained on and the
    process never exited (CI's `own loop, no with` hang). The next log() raises it again,
    the step it recorded the run's last."""
    run = tmp_path / "run"
    code, out, err = run_to_its_end(FORKED, run, timeout=60)
    assert "Exception ignored in" in err, err  # the case: the first Terminated was dropped
    assert code == 128 + signal.SIGTERM, err
    assert "the script went on" not in out, err
    r = nbwatch.open_run(run)
    assert r.state == "stopped" and r.meta["stopped_by"].startswith("terminated by SIGTERM")
    assert r.step == 5
