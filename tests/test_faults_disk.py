"""Disk and file faults (issue 22, items 1–3): a full disk during a checkpoint, a kill at any
instant of the store's close, and a store damaged under a live run. Real parts only: a real
small tmpfs (skipped where mounting is not permitted), real `kill -9` of child processes,
real files truncated, deleted and replaced while a run writes them."""

import contextlib
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import nbwatch
from nbwatch.checkpoint import CheckpointWriteError
from nbwatch.demo import TinyGPT
from nbwatch.records import Event, Scalars
from nbwatch.store import RunReader, RunStore, StoreFailed, writer_alive
from tests.conftest import make_batches, tiny_step, until

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def tiny(d=32, seed=0):
    torch.manual_seed(seed)
    model = TinyGPT(vocab=64, d=d, layers=2, heads=2, ctx=32)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def slow_step(model, batch):
    time.sleep(0.01)
    return tiny_step(model, batch)


def leftovers(run: Path) -> set[str]:
    return {p.name for p in run.iterdir()} & {"nbwatch.db-journal", "nbwatch.db-wal",
                                              "nbwatch.db-shm"}


@pytest.fixture
def small_disk(tmp_path):
    """A real 900 KiB filesystem (tmpfs); skipped where this process may not mount one."""
    disk = tmp_path / "small"
    disk.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=900k", "tmpfs", str(disk)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.strip()[:120]})")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_no_room_to_merge_at_the_close_leaves_a_finished_run_finished(tmp_path, caplog):
    """A run fills a 3 MiB disk and fails; space is freed (a 1.2 MB file removed, as its
    error says) and it resumes to its end. Its close then merges the small blocks through
    the WAL, and folds the WAL into the file, and neither has room: every record is
    committed already, so the run reads `finished` with every step, and the log says why
    its files stay as they are. It read `failed`, "later records are lost", and the
    fold's failure was blamed on "a reader"."""
    disk = tmp_path / "small"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(disk)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        (disk / "filler").write_bytes(bytes(1200 << 10))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                    torch.nn.Linear(16, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

        def train(resume: bool, until_step: int) -> None:
            with nbwatch.Monitor(model, opt, run_dir=disk / "run", display=False,
                                 hist_every=1, checkpoint_every=50, resume=resume) as mon:
                for _ in range(mon.step, until_step):
                    x = torch.randn(4, 8)
                    loss = (model(x) - x.sum(1, keepdim=True)).square().mean()
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    mon.log(loss=loss, **{f"my/k{j}": float(j) for j in range(300)})
                if resume:  # every step committed (a read commits), then the disk filled
                    # to 256 KiB: room for the close's last records, none for its merge
                    # (left to chance, the merge fitted in one run of three)
                    assert len(mon.df) == until_step
                    free = shutil.disk_usage(disk).free
                    (disk / "filler2").write_bytes(bytes(max(free - (256 << 10), 0)))

        # whichever the full disk meets first: the store's records or a checkpoint
        with pytest.raises((StoreFailed, CheckpointWriteError), match="disk full"):
            train(False, 10**6)
        (disk / "filler").unlink()
        with caplog.at_level("WARNING", logger="nbwatch"):
            train(True, nbwatch.open_run(disk / "run").step + 100)
        run = nbwatch.open_run(disk / "run")
        state, steps, kinds = run.state, run.df.index.tolist(), run.events.kind.tolist()
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
    assert state == "finished" and steps == list(range(1, len(steps) + 1))
    assert kinds[-1] == "state"  # no error after "run finished"
    assert "a reader held" not in caplog.text
    assert "no room on its disk to merge" in caplog.text or "could not be folded" in \
        caplog.text, caplog.text


# 1 -- a full disk during a checkpoint -------------------------------------------------------
def test_a_full_disk_during_a_checkpoint_is_recorded_and_frees_its_space(small_disk):
    """~600 KiB free when the first 0.8 MB checkpoint is written: the run fails with
    "disk full", its partial file is gone, and the store (with the space back) says so."""
    run = small_disk / "run"
    model, opt = tiny(d=48)  # model + AdamW state: a 0.8 MB checkpoint
    mon = nbwatch.Monitor(model, opt, run_dir=run)
    mon.start(tiny_step, make_batches(), max_steps=20, checkpoint_every=5, display=False)
    with pytest.raises(CheckpointWriteError, match=r"^disk full: checkpoint .*step_00000005"):
        mon.wait(timeout=120)
    assert mon.state == "failed"
    first = str(mon.error).splitlines()[0]
    assert first.startswith("disk full: ") and "partial file was removed" in first
    assert "CheckpointWriteError: disk full: " in mon.traceback
    assert not [p.name for p in (run / "checkpoints").iterdir()]  # no .tmp-PID eating space
    assert not writer_alive(run)
    r = nbwatch.open_run(run)
    assert r.state == "failed" and r.step == 5
    assert r.df.index.tolist() == [1, 2, 3, 4, 5]  # nothing recorded was lost
    ev = r.events
    error = ev[ev.kind == "error"].message.iloc[0]
    assert error.splitlines()[0].startswith("CheckpointWriteError: disk full: ")
    failed = ev[(ev.kind == "checkpoint") & (ev.severity == "critical")]
    assert failed.message.iloc[0].startswith("periodic checkpoint at step 5 failed: disk full")
    assert failed.data.iloc[0]["failed"] is True
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "log.jsonl", "nbwatch.db"]


def test_a_failed_checkpoint_write_leaves_no_temp_file_and_names_the_file(tmp_path):
    """A write that fails part way (the file size limit, in a child process) removes its
    temp file; a checkpoint before it is kept."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    code = textwrap.dedent("""
        import resource, signal, sys, torch
        from pathlib import Path
        from nbwatch.checkpoint import atomic_save
        folder = Path(sys.argv[1])
        atomic_save({"w": torch.zeros(1000)}, folder / "step_00000001.pt")
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
        try:
            atomic_save({"w": torch.zeros(1_000_000)}, folder / "step_00000002.pt")
        except Exception as e:
            print(type(e).__name__, str(e).splitlines()[0])
    """)
    out = subprocess.run([sys.executable, "-c", code, str(folder)], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith(f"CheckpointWriteError checkpoint {folder / 'step_00000002.pt'}"
                                 " could not be written"), out.stdout
    assert "partial file was removed" in out.stdout
    assert sorted(p.name for p in folder.iterdir()) == ["step_00000001.pt"]
    assert torch.load(folder / "step_00000001.pt", weights_only=True)["w"].shape == (1000,)


KILLED_SAVE = textwrap.dedent("""
    import sys, time, torch
    from pathlib import Path
    from nbwatch.checkpoint import atomic_save

    class Slow:  # pickled before torch writes the tensors: the temp file is open by then
        def __reduce__(self):
            print("WRITING", flush=True)
            time.sleep(60)
            return (int, ())

    atomic_save({"w": torch.zeros(10), "slow": Slow()}, Path(sys.argv[1]) / "step_00000007.pt")
""")


def test_the_next_open_sweeps_the_temp_file_of_a_killed_checkpoint(tmp_path):
    run = tmp_path / "run"
    model, opt = tiny()
    mon = nbwatch.Monitor(model, opt, run_dir=run)
    mon.start(tiny_step, make_batches(), max_steps=6, checkpoint_every=3, display=False)
    mon.wait()
    ckpts = run / "checkpoints"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_SAVE, str(ckpts)], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "WRITING"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        proc.kill()
    killed = ckpts / f".step_00000007.pt.tmp-{proc.pid}"
    assert killed.is_file()
    old_own = ckpts / f".step_00000004.pt.tmp-{os.getpid()}"  # a live pid, older than the open
    old_own.write_bytes(b"x")
    os.utime(old_own, (time.time() - 60, time.time() - 60))
    keep = ckpts / "notes.tmp"  # not nbwatch's
    keep.write_text("mine")
    model2, opt2 = tiny(seed=1)
    again = nbwatch.Monitor(model2, opt2, run_dir=run)
    again.start(tiny_step, make_batches(), max_steps=9, checkpoint_every=3, resume=True,
                display=False)
    again.wait()
    assert again.step == 9
    assert not killed.exists() and not old_own.exists() and keep.read_text() == "mine"
    assert sorted(p.name for p in ckpts.glob(".*")) == []


# 2 -- kill -9 at any instant of the store's close -----------------------------------------
FORK_SERVER = textwrap.dedent("""
    import os, sys
    from nbwatch.store import RunStore
    from nbwatch.records import Event, Scalars
    print("READY", flush=True)
    for line in sys.stdin:  # one writer per line, forked: no interpreter start per kill
        pid = os.fork()
        if pid == 0:
            store = RunStore(line.strip(), flush_interval=0.05)
            for step in range(1, 2001):
                store.put(Scalars(step, {f"k{i}": float(step + i) for i in range(16)}))
                if step % 10 == 0:  # many small blocks: the close compacts them
                    store.flush()
            store.put(Event(2000, "state", "info", "run finished at step 2000", {}))
            store.set_meta("state", "finished")
            store.flush()
            os.write(1, b"CLOSING\\n")
            store.close()
            os.write(1, b"CLOSED\\n")
            os._exit(0)
        print(pid, flush=True)
        os.waitpid(pid, 0)
        print("EXIT", flush=True)
""")


class ForkServer:
    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", FORK_SERVER], cwd=ROOT, env=ENV,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     bufsize=1)
        assert self.proc.stdout.readline().strip() == "READY"

    def write_run(self, run: Path, kill_after: float | None) -> tuple[float, bool]:
        """Write a run in a forked child; kill -9 it `kill_after` s into its close. Returns
        (seconds from the close's start to the child's end, whether the close finished)."""
        self.proc.stdin.write(f"{run}\n")
        self.proc.stdin.flush()
        pid = int(self.proc.stdout.readline())
        assert self.proc.stdout.readline().strip() == "CLOSING"
        t0 = time.perf_counter()
        if kill_after is not None:
            time.sleep(kill_after)
            with contextlib.suppress(ProcessLookupError):  # it may have finished
                os.kill(pid, signal.SIGKILL)
        lines = []
        while (line := self.proc.stdout.readline().strip()) != "EXIT":
            assert line, "the fork server died"
            lines.append(line)
        return time.perf_counter() - t0, "CLOSED" in lines

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(30)


def all_readers_open(run: Path, tmp: Path, steps: int) -> None:
    """Every reader API (and the writer's open a resume makes) on its own copy of `run` as
    the kill left it: each must meet the leftover files itself."""
    def copy(name: str) -> Path:
        dest = tmp / name
        shutil.copytree(run, dest)
        return dest

    assert RunReader(copy("reader")).last_step() == steps
    r = nbwatch.open_run(copy("open_run"))
    assert r.step == steps and len(r.df) == steps and r.state == "finished"
    a = nbwatch.attach(copy("attach"))
    assert a.state == "finished" and len(a.df) == steps
    listed = copy("ls")
    ls = subprocess.run([sys.executable, "-m", "nbwatch.cli", "ls", str(listed.parent)],
                        capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=120)
    assert ls.returncode == 0 and "ls " in ls.stdout and "skipped" not in ls.stderr, ls.stderr
    html = nbwatch.export_html(copy("export"), tmp / "report.html")
    assert html.stat().st_size > 10_000
    resumed = copy("resume")
    store = RunStore(resumed)
    assert store.last_step() == steps
    store.put(Scalars(steps + 1, {"k0": 1.0}))
    store.close()
    assert RunReader(resumed).last_step() == steps + 1
    for name in ("reader", "open_run", "attach", "ls", "export", "resume"):
        assert not leftovers(tmp / name), name  # the first open made it one file again


def test_kill_9_at_random_instants_of_the_close_never_leaves_an_unreadable_store(tmp_path):
    """A writer killed at random instants of its close (compaction, WAL checkpoint, leaving
    WAL mode) until one leaves a -wal or -journal behind: never a hot journal, and every
    reader opens what it left with all 2000 steps."""
    server = ForkServer()
    try:
        spans = [server.write_run(tmp_path / f"calibrate{i}", None)[0] for i in range(2)]
        span = max(spans)
        rng = random.Random()
        left, journals, kills = None, 0, 0
        for i in range(60):
            run = tmp_path / f"kill{i}"
            _, closed = server.write_run(run, rng.uniform(0, span * 1.1))
            kills += not closed
            found = leftovers(run)
            journals += "nbwatch.db-journal" in found
            if found - {"nbwatch.db-shm"}:
                left = run
                break
    finally:
        server.close()
    print(f"close takes {span * 1000:.0f} ms; {kills} kills until one left {sorted(found)}")
    assert journals == 0
    assert left is not None, "60 kills during the close never left a WAL behind"
    all_readers_open(left, tmp_path / "copies", 2000)


HOT_JOURNAL = textwrap.dedent("""
    import sqlite3, sys, time
    con = sqlite3.connect(sys.argv[1], isolation_level=None)
    con.execute("PRAGMA cache_size=1")  # spill changed pages into the file mid-transaction
    con.execute("BEGIN IMMEDIATE")
    con.execute("DELETE FROM blocks")
    con.execute("DELETE FROM walls")
    con.execute("UPDATE meta SET value = '\\"damaged\\"' WHERE key = 'state'")
    print("WRITING", flush=True)
    time.sleep(60)
""")


def finished_run(run: Path, steps: int) -> None:
    store = RunStore(run)
    for step in range(1, steps + 1):
        store.put(Scalars(step, {"loss/train": 1.0 / step, "lr": 1e-3}))
        if step % 50 == 0:
            store.flush()
    store.put(Event(steps, "state", "info", f"run finished at step {steps}", {}))
    store.set_meta("state", "finished")
    store.close()


def test_a_hot_journal_left_by_a_killed_writer_is_rolled_back_by_the_first_reader(tmp_path):
    """A writer killed inside a rollback-journal transaction (an older nbwatch's close, a
    migration's VACUUM) leaves a hot journal that read-only opens cannot get past."""
    run = tmp_path / "run"
    finished_run(run, 400)
    proc = subprocess.Popen([sys.executable, "-c", HOT_JOURNAL, str(run / "nbwatch.db")],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "WRITING"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        proc.kill()
    assert (run / "nbwatch.db-journal").stat().st_size > 0
    ro = sqlite3.connect(f"file:{run / 'nbwatch.db'}?mode=ro", uri=True)
    with pytest.raises(sqlite3.OperationalError, match="readonly database"):
        ro.execute("SELECT COUNT(*) FROM walls").fetchall()  # what readers met before
    ro.close()

    # a live writer holds the folder: no reader touches its journal, the error says why
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); "
        "fcntl.flock(fd, fcntl.LOCK_EX); print('HELD', flush=True); time.sleep(60)"),
        str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "HELD"
        with pytest.raises(StoreFailed, match=r"nbwatch.db-journal.*live writer.*nbwatch "
                                              r"recover"):
            nbwatch.open_run(run)
        assert (run / "nbwatch.db-journal").stat().st_size > 0
    finally:
        holder.kill()
        holder.wait(10)

    copies = tmp_path / "copies"
    all_readers_open(run, copies, 400)  # each copy: its first reader rolls the journal back
    assert nbwatch.open_run(copies / "open_run").meta["state"] == "finished"


def test_where_the_folder_cannot_be_written_the_error_names_the_command(tmp_path):
    run = tmp_path / "run"
    finished_run(run, 100)
    proc = subprocess.Popen([sys.executable, "-c", HOT_JOURNAL, str(run / "nbwatch.db")],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "WRITING"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        proc.kill()
    view = tmp_path / "readonly"
    view.mkdir()
    if subprocess.run(["mount", "--bind", "-o", "ro", str(run), str(view)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot bind-mount a read-only view here")
    try:
        if os.access(view, os.W_OK) and subprocess.run(
                ["touch", str(view / "probe")], capture_output=True).returncode == 0:
            pytest.skip("the bind mount is not read-only here")
        with pytest.raises(StoreFailed, match=r"rollback journal.*nbwatch recover "
                                              r".*copy the whole folder"):
            nbwatch.open_run(view)
    finally:
        subprocess.run(["umount", str(view)], check=False)
    fixed = subprocess.run([sys.executable, "-m", "nbwatch.cli", "recover", str(run)],
                           capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=120)
    assert fixed.returncode == 0 and "recovered" in fixed.stdout, fixed.stderr
    assert not fixed.stderr  # no runpy warning, nothing else
    assert sorted(p.name for p in run.iterdir()) == ["nbwatch.db"]
    assert nbwatch.open_run(run).step == 100


# 3 -- a store damaged under a live run -----------------------------------------------------
def live_run(run: Path):
    model, opt = tiny()
    mon = nbwatch.Monitor(model, opt, run_dir=run)
    mon.start(slow_step, make_batches(), max_steps=100_000, display=False)
    # steps are recorded in batches (within RECORD_EVERY_S of their end): 20 of them in
    until(lambda: len(nbwatch.open_run(run).df) >= 20, 60, "20 steps recorded")
    return mon


def test_a_store_truncated_mid_run_fails_the_run_naming_the_file(tmp_path):
    run = tmp_path / "run"
    mon = live_run(run)
    os.truncate(run / "nbwatch.db", 0)
    with pytest.raises(StoreFailed, match=rf"run store {run / 'nbwatch.db'} was truncated"):
        mon.wait(timeout=60)
    assert mon.state == "failed"
    assert "OperationalError" not in str(mon.error).splitlines()[0]
    assert "start the run again" in str(mon.error) or "resume" in str(mon.error)


def test_a_deleted_wal_mid_run_is_rebuilt_and_nothing_is_lost(tmp_path):
    run = tmp_path / "run"
    mon = live_run(run)
    os.unlink(run / "nbwatch.db-wal")
    at = mon.step
    until(lambda: mon.step >= at + 30, 60, "30 more steps")
    mon.stop()
    mon.wait(timeout=60)
    assert mon.state == "stopped"
    r = nbwatch.open_run(run)
    assert r.df.index.tolist() == list(range(1, mon.step + 1))
    ev = r.events
    said = ev[ev.message.str.contains("write-ahead log")].message.tolist()
    assert said and "nothing was lost" in said[0]


def test_a_store_replaced_mid_run_fails_loudly_and_keeps_the_run_elsewhere(tmp_path):
    other = tmp_path / "other"
    finished_run(other, 7)
    run = tmp_path / "run"
    mon = live_run(run)
    shutil.copy(other / "nbwatch.db", run / "nbwatch.db.new")
    os.replace(run / "nbwatch.db.new", run / "nbwatch.db")  # another run's file over it
    with pytest.raises(StoreFailed, match=rf"run store {run / 'nbwatch.db'} was replaced by "
                                          "another file"):
        mon.wait(timeout=60)
    assert mon.state == "failed"
    kept = str(mon.error).split("were saved to ")[1].split(":")[0]
    saved = nbwatch.open_run(kept)
    assert saved.state == "failed" and saved.step >= 20
    assert saved.df.index.tolist() == list(range(1, saved.step + 1))
    assert "was replaced by another file" in saved.events.query("kind == 'error'").message.iloc[0]
    # the file put in its place is left as it was: this run's WAL was not applied to it
    theirs = nbwatch.open_run(run)
    assert theirs.step == 7 and theirs.meta["state"] == "finished"
    con = sqlite3.connect(run / "nbwatch.db")
    assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    con.close()
