"""Faults and abuse, one test per item of the fault list (issue 12): nothing lost, nothing
misreported. Process faults run in real subprocesses (kill, exit, SIGINT, a second writer,
a full disk)."""

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch

import nbwatch
from nbwatch.demo import TinyGPT
from nbwatch.store import RunInUse, RunReader, StoreFailed
from tests.conftest import make_batches, tiny_step, until

ROOT = Path(__file__).resolve().parents[1]
PRELUDE = textwrap.dedent("""
    import os, sys, time, itertools, torch
    torch.set_num_threads(1)
    import nbwatch
    from nbwatch.demo import TinyGPT
    from tests.conftest import make_batches, tiny_step, until

    def slow(model, batch):
        time.sleep(0.01)
        return tiny_step(model, batch)

    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run_dir = sys.argv[1]
""")


def script(body: str, *args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-u", "-c", PRELUDE + textwrap.dedent(body),
                             *args], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def new_tiny(seed=0):
    torch.manual_seed(seed)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def nan_at(steps):
    calls = {"n": 0}

    def step(model, batch):
        calls["n"] += 1
        out = tiny_step(model, batch)
        if calls["n"] in steps:
            out["logits"] = out["logits"] * float("nan")
        return out
    return step


def finite(model):
    return all(torch.isfinite(p).all() for p in model.parameters())


# 1 ----------------------------------------------------------------------------------------
def test_two_nonfinite_steps_in_a_row_are_both_skipped(tmp_path):
    model, opt = new_tiny()
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "run",
                          alerts={"nonfinite": {"actions": ["skip_step"]}})
    mon.start(nan_at({5, 6}), make_batches(), max_steps=12, checkpoint_every=4, display=False)
    mon.wait()
    df = mon.df
    assert df.loc[[5, 6], "skipped"].tolist() == [1.0, 1.0]
    assert finite(model) and mon.state == "finished"
    ck = torch.load(mon.checkpointer.latest(), weights_only=True)
    assert all(torch.isfinite(v).all() for v in ck["model"].values() if v.is_floating_point())


def test_a_nonfinite_rule_without_skip_says_the_step_was_applied(tmp_path):
    model, opt = new_tiny()
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "run",
                          alerts={"nonfinite": {"actions": []}})
    mon.start(nan_at({5}), make_batches(), max_steps=8, display=False)
    mon.wait()
    msg = mon.events.query("kind == 'alert'").message.iloc[0]
    assert "APPLIED" in msg and "untouched" not in msg


# 2 ----------------------------------------------------------------------------------------
def test_ctrl_c_during_wait_leaves_the_run_in_hand_and_recording(tmp_path):
    run = tmp_path / "run"
    proc = script("""
        mon = nbwatch.Monitor(model, opt, run_dir=run_dir)
        mon.start(slow, make_batches(), max_steps=200, display=False)
        print("READY", flush=True)
        try:
            mon.wait()
        except KeyboardInterrupt:
            print("INTERRUPTED", mon.running, mon.state, flush=True)
            mon.pause()
            until(lambda: mon.state == "paused", 30, "the pause")
            at = mon.step
            time.sleep(0.3)
            print("PAUSED", mon.state, mon.step == at, flush=True)
            mon.resume()
        mon.wait()
        print("DONE", mon.state, mon.step, flush=True)
    """, str(run))
    assert proc.stdout.readline().strip() == "READY"
    until(lambda: (run / "nbwatch.db").exists() and nbwatch.open_run(run).step >= 20)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "INTERRUPTED True running" in out and "PAUSED paused True" in out
    assert "DONE finished 200" in out
    assert nbwatch.open_run(run).df.index.tolist() == list(range(1, 201))


# 3 ----------------------------------------------------------------------------------------
def test_one_writer_per_run_folder_and_attach_knows_when_it_dies(tmp_path):
    run = tmp_path / "run"
    proc = script("""
        mon = nbwatch.Monitor(model, opt, run_dir=run_dir)
        mon.start(slow, make_batches(), max_steps=100_000, checkpoint_every=10, display=False)
        mon.wait()
    """, str(run))
    try:
        until(lambda: (run / "checkpoints").is_dir() and any((run / "checkpoints").iterdir()))
        model, opt = new_tiny(1)
        with pytest.raises(RunInUse, match=rf"pid {proc.pid} on host .*one writer at a time"):
            nbwatch.Monitor(model, opt, run_dir=run).start(
                tiny_step, make_batches(), max_steps=10, resume=True, display=False)
        assert finite(model)
        # a loop of one's own, without resume: told the folder is in use by that process,
        # not "already holds a run; pass resume=True", as the Monitor is made
        with pytest.raises(RunInUse, match=rf"pid {proc.pid} on host"):
            nbwatch.Monitor(model, opt, run_dir=run, display=False)
        assert nbwatch.attach(run).state == "running"
        proc.kill()
        proc.wait(10)
        # the OS dropped the killed writer's lock: gone at once, not after stale_after
        assert nbwatch.attach(run, stale_after=3600).state == "stale"
    finally:
        proc.kill()


def test_two_monitors_of_one_process_cannot_write_one_folder(tmp_path):
    """A notebook's cells run again: the second Monitor is refused as it is made, so `mon`
    still names the live run, and the message says the writer is this very process (it
    said "another nbwatch run", naming the kernel's own pid)."""
    (m1, o1), (m2, o2) = new_tiny(), new_tiny(1)
    a = nbwatch.Monitor(m1, o1, run_dir=tmp_path / "run")
    a.start(tiny_step, make_batches(), max_steps=10_000, display=False)
    try:
        until(lambda: a.step >= 3)
        for resume in (False, True):
            with pytest.raises(RunInUse, match="a run of this very process .* still trains"):
                nbwatch.Monitor(m2, o2, run_dir=tmp_path / "run", resume=resume)
        assert a.state == "running"
    finally:
        a.stop()
        a.wait()
    assert a.df.index.is_unique


# 4 ----------------------------------------------------------------------------------------
def test_a_nonfinite_val_loss_is_an_alert_and_never_best(tmp_path):
    vals = {0: 9.0, 5: float("nan"), 10: 5.0, 15: float("nan"), 20: 6.0}  # 0: the dry run
    model, opt = new_tiny()
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "run")
    mon.start(tiny_step, make_batches(), max_steps=20, val_fn=lambda m: vals[mon.step],
              eval_every=5, checkpoint_every=5, display=False)
    mon.wait()
    alerts = mon.events.query("kind == 'alert'")
    assert alerts.message.str.startswith("nonfinite_val").sum() == 2
    assert not alerts.message.str.startswith("val_spike").any()
    best = json.loads((tmp_path / "run" / "checkpoints" / "best.json").read_text())
    assert best == {"step": 10, "val_loss": 5.0}


# 5 ----------------------------------------------------------------------------------------
def test_a_deleted_run_folder_fails_the_run_and_says_so(tmp_path):
    run = tmp_path / "run"
    model, opt = new_tiny()
    mon = nbwatch.Monitor(model, opt, run_dir=run)
    mon.start(lambda m, b: (time.sleep(0.01), tiny_step(m, b))[1], make_batches(),
              max_steps=10_000, display=False)
    until(lambda: mon.step >= 5)
    shutil.rmtree(run)
    with pytest.raises(StoreFailed, match=f"run folder {run} was deleted"):
        mon.wait(timeout=60)
    assert mon.state == "failed"


def test_a_run_folder_renamed_mid_run_says_where_it_went_and_reads_failed_there(tmp_path):
    """`mv runs/exp1 runs/exp1-old` under a live run used to be reported as "deleted" and the
    folder then read `stale`: the run stops naming where its records went, and the moved
    folder reads `failed` with that reason."""
    run, moved = tmp_path / "run", tmp_path / "run-old"
    model, opt = new_tiny()
    mon = nbwatch.Monitor(model, opt, run_dir=run)
    mon.start(lambda m, b: (time.sleep(0.01), tiny_step(m, b))[1], make_batches(),
              max_steps=10_000, display=False)
    reader = RunReader(run)
    until(lambda: reader.last_step() >= 5, 30, "step 5 in the store")  # (rows come in batches)
    reader.close()
    run.rename(moved)
    with pytest.raises(StoreFailed, match=f"run folder {run} was moved to {moved}"):
        mon.wait(timeout=60)
    assert mon.state == "failed"
    there = nbwatch.open_run(moved)
    assert there.state == "failed" and there.step >= 5
    assert there.events.message.str.contains(f"was moved to {moved}").any()


def test_a_full_disk_says_disk_full_first(tmp_path):
    """A real full filesystem (a 3 MiB tmpfs) where mounting is allowed; else the
    process's file size limit, which SQLite meets as an I/O error."""
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(small)],
                             capture_output=True).returncode == 0
    try:
        proc = script("""
            import resource, signal
            if sys.argv[2] == "limit":
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                resource.setrlimit(resource.RLIMIT_FSIZE, (3_000_000, 3_000_000))
            mon = nbwatch.Monitor(model, opt, run_dir=run_dir)
            mon.start(tiny_step, itertools.cycle(make_batches()), max_steps=10**6,
                      hist_every=1, display=False)
            try:
                mon.wait(timeout=120)
            except Exception as e:
                print("RAISED", type(e).__name__, str(e).splitlines()[0], flush=True)
            print("STATE", mon.state, flush=True)
        """, str(small / "run"), "disk" if mounted else "limit")
        out, err = proc.communicate(timeout=180)
        on_disk = nbwatch.open_run(small / "run")
        state, events = on_disk.state, on_disk.events
        left = sorted(p.name for p in (small / "run").iterdir())
    finally:
        if mounted:
            subprocess.run(["umount", str(small)], check=False)
    cause = "disk full: " if mounted else "file size limit reached"
    assert f"RAISED StoreFailed {cause}" in out, out + err[-2000:]
    assert "STATE failed" in out
    assert "Logging error" not in err  # one clear error, not a traceback per log line
    assert ".nbwatch-reserve" not in left
    if mounted:  # the space set aside at the start records the end: it read 'stale'
        assert state == "failed"
        said = events[events.kind == "error"].message.tolist()
        assert said and said[-1].startswith("disk full: the run store"), said
        # no checkpoint_every: nothing to resume from, and the message says so
        assert "without one the weights are in memory only" in said[-1], said


# 6 ----------------------------------------------------------------------------------------
def test_a_script_that_exits_without_wait_stops_its_run_gracefully(tmp_path):
    run = tmp_path / "run"
    proc = script("""
        mon = nbwatch.Monitor(model, opt, run_dir=run_dir)
        mon.start(slow, make_batches(), max_steps=100_000, display=False)
        time.sleep(1.0)
    """, str(run))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "nbwatch: the program exited while run 'run' was training" in err
    r = nbwatch.open_run(run)
    assert r.state == "stopped" and r.step > 0
    assert (run / "checkpoints" / f"step_{r.step:08d}.pt").is_file()


# 7 ----------------------------------------------------------------------------------------
def test_uri_characters_in_run_dir(tmp_path):
    run = tmp_path / "lr=3e-4 #1 ?a"
    model, opt = new_tiny()
    mon = nbwatch.Monitor(model, opt, run_dir=run)
    mon.start(tiny_step, make_batches(), max_steps=5, display=False)
    mon.wait()
    assert mon.df.index.tolist() == [1, 2, 3, 4, 5]
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "log.jsonl", "nbwatch.db"]


# 8 ----------------------------------------------------------------------------------------
def test_an_optimizer_that_does_not_cover_the_model(tmp_path):
    model, _ = new_tiny()
    other, other_opt = new_tiny(1)
    with pytest.raises(ValueError, match="holds none of the model's trainable parameters"):
        nbwatch.Monitor(model, other_opt, run_dir=tmp_path / "a")
    half = torch.optim.AdamW(model.blocks[0].parameters(), lr=1e-3)
    with pytest.warns(UserWarning, match=r"not in the optimizer \(.*blocks\.1.*never "
                                         r"changes them.*its own Monitor"):
        nbwatch.Monitor(model, half, run_dir=tmp_path / "b")


# 9 ----------------------------------------------------------------------------------------
def test_export_never_destroys_the_run_and_can_leave_out_the_environment(tmp_path):
    run = tmp_path / "run"
    model, opt = new_tiny()
    mon = nbwatch.Monitor(model, opt, run_dir=run)
    mon.start(tiny_step, make_batches(), max_steps=5, checkpoint_every=5, display=False)
    mon.wait()
    for target in (run / "nbwatch.db", run / "log.jsonl", run / "checkpoints" / "x.html"):
        with pytest.raises(ValueError, match="holds the run itself"):
            nbwatch.export_html(run, target)
    with pytest.raises(FileExistsError, match="not an .html file"):
        nbwatch.export_html(run, Path(__file__).with_name("conftest.py"))
    assert nbwatch.open_run(run).df.index.tolist() == [1, 2, 3, 4, 5]
    out = nbwatch.export_html(run, tmp_path, environment=False)  # a folder: report.html
    assert out == tmp_path / "report.html"
    assert not list(tmp_path.glob("*.tmp"))
    page = out.read_text()
    assert '"argv"' not in page and '"cwd"' not in page and os.getcwd() not in page
    full = nbwatch.export_html(run, tmp_path / "full.html").read_text()
    assert '"argv"' in full and os.getcwd() in full


# 10 ---------------------------------------------------------------------------------------
def test_stopped_while_paused_resumes_running_and_replays_no_command(tmp_path):
    model, opt = new_tiny()
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "run")
    mon.start(lambda m, b: (time.sleep(0.01), tiny_step(m, b))[1], make_batches(),
              max_steps=60, display=False)
    until(lambda: mon.step >= 10)
    mon.pause()
    until(lambda: mon.state == "paused")
    mon.checkpoint()
    mon.stop()
    mon.wait()
    stopped_at = mon.step
    model2, opt2 = new_tiny(1)
    mon2 = nbwatch.Monitor(model2, opt2, run_dir=tmp_path / "run")
    mon2.start(tiny_step, make_batches(), max_steps=60, resume=True, display=False)
    mon2.wait(timeout=60)  # a restored "paused" would hang here
    assert mon2.state == "finished" and mon2.step == 60
    ev = mon2.events
    after = ev[(ev.step > stopped_at) & (ev.kind == "action")]
    assert after.empty, after.message.tolist()  # nothing from the first run replayed


# 12 ---------------------------------------------------------------------------------------
def test_bad_settings_are_refused_before_anything_opens(tmp_path):
    model, opt = new_tiny()
    with pytest.raises(ValueError, match="system_interval must be at least 0.1"):
        nbwatch.Monitor(model, opt, run_dir=tmp_path / "a", system_interval=0)
    loop: dict = {}
    loop["self"] = loop
    with pytest.raises(ValueError, match="config cannot be stored as JSON"):
        nbwatch.Monitor(model, opt, run_dir=tmp_path / "b", config=loop)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_relative_run_dir_survives_chdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model, opt = new_tiny()
    mon = nbwatch.Monitor(model, opt, run_dir="rel")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    mon.start(tiny_step, make_batches(), max_steps=4, display=False)
    mon.wait()
    monkeypatch.chdir("/")
    assert mon.df.index.tolist() == [1, 2, 3, 4]
    assert (tmp_path / "rel" / "nbwatch.db").is_file()


def test_a_damaged_store_is_named_and_ls_and_compare_skip_it(tmp_path):
    for name in ("a", "b"):
        model, opt = new_tiny()
        mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / name)
        mon.start(tiny_step, make_batches(), max_steps=3, display=False)
        mon.wait()
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "nbwatch.db").write_bytes(os.urandom(8192))
    with pytest.raises(RuntimeError, match=f"{bad / 'nbwatch.db'} is not a readable nbwatch"):
        nbwatch.open_run(bad)
    ls = subprocess.run([sys.executable, "-m", "nbwatch.cli", "ls", str(tmp_path)],
                        capture_output=True, text=True, cwd=ROOT)
    assert ls.returncode == 0 and f"skipped {bad}" in ls.stderr
    assert "a " in ls.stdout and "b " in ls.stdout
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cmp = nbwatch.compare(tmp_path, metrics=["loss/train"])
    assert cmp.runs == ["a", "b"] and any(f"skipped {bad}" in str(w.message) for w in caught)
    empty = tmp_path / "empty"
    empty.mkdir()
    sqlite3.connect(empty / "nbwatch.db").close()
    with pytest.raises(RuntimeError, match="holds no nbwatch records"):
        nbwatch.open_run(empty)


def test_a_generator_that_runs_out_is_said_so(tmp_path):
    model, opt = new_tiny()
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "run")
    mon.start(tiny_step, (b for b in make_batches(3)), max_steps=10, display=False)
    with pytest.raises(ValueError, match="ran out after 3 batches, before max_steps=10"):
        mon.wait()


def test_dataloader_workers_do_not_keep_the_run_folder_locked(tmp_path):
    """Forked workers share the writer lock's file description: the child drops it."""
    from nbwatch.store import writer_alive

    model, opt = new_tiny()
    loader = torch.utils.data.DataLoader(make_batches(), batch_size=None, num_workers=1,
                                         persistent_workers=True)
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "run")
    mon.start(tiny_step, loader, max_steps=4, display=False)
    mon.wait()
    assert not writer_alive(tmp_path / "run")
    model2, opt2 = new_tiny(1)
    again = nbwatch.Monitor(model2, opt2, run_dir=tmp_path / "run")
    again.start(tiny_step, make_batches(), max_steps=6, resume=True, display=False)
    again.wait()
    assert again.step == 6
    del loader


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_while_the_run_ends_lets_the_final_checkpoint_finish(tmp_path, presses):
    """Ctrl-C pressed as a `with Monitor(...)` block writes its final checkpoint: the
    checkpoint and the last records finish, then the KeyboardInterrupt reaches the cell;
    the run reads finished and resumes. It was cut mid-write: the run read 'stale' with no
    checkpoint to resume from. A second press abandons the checkpoint, as Ctrl-C does,
    and the run still ends 'stopped' with its steps (it read 'stale', and 'running' in
    memory)."""
    run = tmp_path / "run"
    proc = script("""
        import signal, threading
        presses, main = int(sys.argv[2]), threading.main_thread().ident
        save = torch.save
        def pressed_during(obj, f, *a, **k):  # the user's Ctrl-C, as the checkpoint is written
            for _ in range(presses):
                signal.pthread_kill(main, signal.SIGINT)
                time.sleep(0.01)
            return save(obj, f, *a, **k)
        batches = make_batches(n=8)
        try:
            with nbwatch.Monitor(model, opt, run_dir=run_dir, display=False) as mon:
                for b in batches:
                    loss = nbwatch.masked_cross_entropy(model(b["input_ids"]), b["labels"],
                                                        b["mask"])
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    mon.log(loss=loss)
                torch.save = pressed_during
        except KeyboardInterrupt:
            print("interrupted", mon.state)
        torch.save = save
        print("ended")
    """, str(run), str(presses))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert out.split()[0] == "interrupted", (out, err)
    r = nbwatch.open_run(run)
    if presses == 1:
        assert "Ctrl-C waits until the final checkpoint" in err
        assert out.split()[1] == "finished"
        assert r.state == "finished" and r.step == 8 and list(run.rglob("step_*8.pt"))
        model, opt = new_tiny(1)
        mon = nbwatch.Monitor(model, opt, run_dir=run, display=False, resume=True)
        assert mon.step == 8
    else:  # abandoned: the run ends a stop, every step recorded, no final checkpoint
        assert out.split()[1] == "stopped"
        assert r.state == "stopped" and r.step == 8
        assert any("final checkpoint (step 8) was not written" in m
                   for m in r.events["message"]), list(r.events["message"])
        assert not list(run.rglob("step_*8.pt")), list(run.rglob("*.pt"))
        nbwatch.Monitor(*new_tiny(1), run_dir=run, display=False)  # the folder is free
