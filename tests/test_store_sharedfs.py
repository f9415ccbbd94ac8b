"""Run folders on a shared filesystem (NFS, Lustre, GPFS): the store's "network" mode.

A forced mode (`NBWATCH_STORE_MODE=network`) stands in for a real network filesystem: the
writer is a real training subprocess, the follower this process (attach, `nbwatch ls`, the
dashboard's reader), and kill -9 hits the real writer."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import nbwatch
from nbwatch.store import RunInUse, RunReader, RunStore, blocks, check_no_writer, writer_alive
from nbwatch.store.liveness import run_state
from nbwatch.store.lock import DEAD_AFTER, HEARTBEAT_NAME, _lock_dir, read_heartbeat, unlock
from nbwatch.store.mode import ENV, choose, fs_type, is_network_type, mount_of, probe
from nbwatch.store.recover import hot_journal, journal_of
from nbwatch.widget import Dashboard
from tests.conftest import until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TRAIN = textwrap.dedent("""
    import sys, time, torch
    import nbwatch
    from nbwatch.demo import TinyGPT
    from tests.conftest import make_batches, tiny_step

    def step(model, batch):
        time.sleep(float(sys.argv[4]))
        return tiny_step(model, batch)

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = nbwatch.Monitor(model, opt, run_dir=sys.argv[1], config={"lr": 1e-3})
    mon.start(step, make_batches(), max_steps=int(sys.argv[3]), checkpoint_every=3,
              resume=sys.argv[2] == "resume", display=False)
    mon.wait()
""")


def env_for(mode: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": ROOT, ENV: mode}


def train(run: Path, mode: str, how: str = "new", steps: int = 100_000,
          sleep: float = 0.02) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", TRAIN, str(run), how, str(steps), str(sleep)],
                            cwd=ROOT, env=env_for(mode))


def ls(root: Path) -> str:
    """`nbwatch ls ROOT`, run as a user runs it (another process)."""
    out = subprocess.run([sys.executable, "-c", "import sys; from nbwatch.cli import main;"
                          " sys.exit(main(sys.argv[1:]))", "ls", str(root)],
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, check=True,
                         capture_output=True, text=True, timeout=120)
    return out.stdout


def ls_state(root: Path, name: str) -> str:
    lines = [ln.split() for ln in ls(root).splitlines()[1:]]
    return {ln[0]: ln[1] for ln in lines}[name]


def header_versions(db: Path) -> tuple[int, int]:
    """The file format's write/read versions (bytes 18, 19): 2 is WAL, 1 a rollback journal."""
    with open(db, "rb") as f:
        head = f.read(20)
    return head[18], head[19]


def store_files(run: Path) -> list[str]:
    """The store's files in a run folder (the database, its journals, the heartbeat)."""
    return sorted(p.name for p in run.iterdir() if p.name.startswith("nbwatch."))


def steps_recorded(reader: RunReader) -> list[int]:
    got = [blocks.decode(first, steps, values, reader.layout(lid))[0]
           for _, lid, first, steps, values, _ in reader.block_rows(["loss/train"])]
    return sorted(np.concatenate(got).tolist()) if got else []


# -- choosing the mode -------------------------------------------------------------------
MOUNTINFO = textwrap.dedent("""\
    22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
    40 22 0:40 / /home rw,relatime shared:20 - nfs4 filer:/home rw,vers=4.2
    41 22 0:41 / /lustre rw shared:21 - lustre 10.0.0.1@o2ib:/scratch rw
    42 41 0:42 / /lustre/local rw shared:22 - xfs /dev/nvme0n1 rw
    43 22 0:43 / /mnt/my\\040box rw - fuse.sshfs me@box:/ rw
    44 22 8:2 / /mnt/usb rw - fuseblk /dev/sdb1 rw
""")


def test_the_mount_and_its_type_come_from_mountinfo():
    assert mount_of("/home/me/runs/exp1", MOUNTINFO) == ("/home", "nfs4")
    assert mount_of("/lustre/proj/run", MOUNTINFO) == ("/lustre", "lustre")
    assert mount_of("/lustre/local/run", MOUNTINFO) == ("/lustre/local", "xfs")  # nested
    assert mount_of("/homework/run", MOUNTINFO) == ("/", "ext4")  # a prefix is not a parent
    assert mount_of("/mnt/my box/run", MOUNTINFO) == ("/mnt/my box", "fuse.sshfs")
    for t in ("nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "beegfs", "ceph",
              "fuse.sshfs", "fuse.ceph-fuse"):
        assert is_network_type(t), t
    for t in ("ext4", "xfs", "btrfs", "tmpfs", "overlay", "zfs", "fuseblk"):
        assert not is_network_type(t), t


def test_the_mode_is_forced_by_the_environment_or_the_store_option(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    mode, why = choose(tmp_path)  # auto, on this machine's own filesystem
    network = is_network_type(fs_type(tmp_path) or "") or probe(tmp_path) is not None
    assert mode == ("network" if network else "local"), why
    assert not list(tmp_path.iterdir()), "the probe left a file behind"
    monkeypatch.setenv(ENV, "network")
    assert choose(tmp_path) == ("network", f"forced by {ENV}=network")
    assert choose(tmp_path, "local")[0] == "local"  # the store's own option wins
    monkeypatch.setenv(ENV, "wal")
    with pytest.raises(ValueError, match=f"{ENV}='wal' is not a store mode: use 'local'"):
        RunStore(tmp_path / "run")
    monkeypatch.setenv(ENV, "network")
    store = RunStore(tmp_path / "run")
    store.close()
    reader = RunReader(tmp_path / "run")
    assert reader.store_mode() == "network" and store.mode == "network"
    assert reader.meta()["store_mode_why"] == f"forced by {ENV}=network"


# -- liveness without flock ----------------------------------------------------------------
def beat_file(run: Path, host: str, age: float, pid: int = 4242) -> None:
    (run / HEARTBEAT_NAME).write_text(json.dumps(
        {"pid": pid, "host": host, "wall": time.time() - age, "every": 1.0,
         "dead_after": DEAD_AFTER, "token": "t"}).ljust(512))


def test_a_writer_on_another_host_is_alive_while_it_beats_and_dead_after(tmp_path):
    run = tmp_path / "run"
    store = RunStore(run, mode="network")
    store.set_meta("state", "running")
    store.close()
    meta = {"state": "running", "store_mode": "network", "pid": 4242, "host": "node-17"}

    beat_file(run, "node-17", age=1.0)  # a writer on a compute node, beating
    assert writer_alive(run) and run_state(run, meta, None, 3600) == "running"
    with pytest.raises(RunInUse, match="pid 4242 on host node-17, last heartbeat"):
        check_no_writer(run)
    with pytest.raises(RunInUse, match="node-17"):
        RunStore(run, mode="network")

    beat_file(run, "node-17", age=DEAD_AFTER + 1)  # that node went down
    assert not writer_alive(run) and run_state(run, meta, None, 3600) == "stale"
    store = RunStore(run, mode="network")  # takes the stale claim over
    try:
        first = read_heartbeat(run)
        assert first["pid"] == os.getpid() and first["host"] == socket.gethostname()
        until(lambda: read_heartbeat(run)["wall"] > first["wall"], 5, "a second beat")
        assert writer_alive(run)
    finally:
        store.close()
    assert read_heartbeat(run) is None  # a closed writer leaves the one file
    assert store_files(run) == ["nbwatch.db"]


def test_one_writer_at_a_time_across_the_two_modes(tmp_path):
    """A folder seen as local from one host and network from another (or forced) still
    has one writer: each mode's writer respects the other's claim."""
    run = tmp_path / "run"
    net = RunStore(run, mode="network")
    try:
        with pytest.raises(RunInUse, match=f"pid {os.getpid()} on host"):
            RunStore(run, mode="local")
    finally:
        net.close()
    local = RunStore(run, mode="local")
    try:
        with pytest.raises(RunInUse, match="being written by a run of this very process"):
            RunStore(run, mode="network")  # (this test's own, local-mode writer)
    finally:
        local.close()
    beat_file(run, "node-17", age=DEAD_AFTER + 1)  # a network-mode writer that died
    local = RunStore(run, mode="local")  # takes over, and removes the dead heartbeat
    try:
        assert read_heartbeat(run) is None and writer_alive(run)  # by the flock again
        assert RunReader(run).store_mode() == "local"
    finally:
        local.close()
    assert not writer_alive(run)


# -- a run written and followed, in both modes ---------------------------------------------
@pytest.mark.parametrize("mode", ["local", "network"])
def test_a_subprocess_run_is_followed_live_in_both_modes(tmp_path, mode):
    run = tmp_path / "run"
    db = run / "nbwatch.db"
    proc = train(run, mode)
    att = nbwatch.attach(run, timeout=60, stale_after=3.0, display=False)
    dash = None
    try:
        until(lambda: att.step >= 1, 60, "the subprocess's first step")
        dash = Dashboard.for_monitor(att)  # the dashboard's reader, polling the folder
        assert att.meta["store_mode"] == mode
        seen, wal_seen, journal_seen = [att.step], False, False
        end = time.monotonic() + 3.0
        while time.monotonic() < end:  # followed live: the step goes up while we watch
            seen.append(att.step)
            wal_seen |= db.with_name("nbwatch.db-wal").exists()
            journal_seen |= journal_of(db).exists()
            time.sleep(0.005)
        assert len(set(seen)) >= 4, f"the follower saw the steps {sorted(set(seen))} in 3 s"
        assert seen == sorted(seen)
        until(lambda: dash.refreshes > 0 and dash._feed is not None
              and dash._feed.step >= seen[-1], 10, "the dashboard to show the new steps")
        assert att.state == "running" and ls_state(tmp_path, "run") == "running"
        if mode == "network":
            assert not wal_seen and header_versions(db) == (1, 1)  # a rollback journal
            assert read_heartbeat(run)["pid"] == proc.pid
            fd = _lock_dir(run, exclusive=True)  # the writer took no flock, yet …
            assert fd is not None
            unlock(fd)
            with pytest.raises(RunInUse, match=f"pid {proc.pid}"):
                check_no_writer(run)  # … its heartbeat says it is alive
            print(f"rollback journal seen while following: {journal_seen}")
        else:
            assert wal_seen and header_versions(db) == (2, 2)
            assert not (run / HEARTBEAT_NAME).exists()

        dash.command("pause")  # a button, through the store, back to the writer
        until(lambda: att.state == "paused", 10, "the subprocess to pause")
        att.stop()
        assert proc.wait(60) == 0
        assert att.wait(timeout=10).state == "stopped"
        assert len(att.df) == att.step and att.df["loss/train"].notna().all()
        assert RunReader(run).walls().index.tolist() == list(range(1, att.step + 1))
        assert ls_state(tmp_path, "run") == "stopped"
        left = store_files(run)
        assert left == ["nbwatch.db"], left  # a finished run is one file in both modes
    finally:
        proc.kill()
        if dash is not None:
            dash.close()
        att.close()


# -- kill -9 in network mode ---------------------------------------------------------------
def kill_mid_commit(proc: subprocess.Popen, db: Path, within: float = 10.0) -> bool:
    """kill -9 the writer at a moment a commit changes the database file (its rollback
    journal hot: the header holds the magic number), if one comes within `within` s, else
    at the end of it; True when that moment came."""
    end = time.monotonic() + within
    hit = False
    while time.monotonic() < end and proc.poll() is None:
        if hot_journal(db):
            hit = True
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    return hit


def test_network_mode_kill_9_reads_as_crashed_and_resume_leaves_no_hole(tmp_path):
    run = tmp_path / "run"
    db = run / "nbwatch.db"
    proc = train(run, "network", sleep=0.0)
    try:
        att = nbwatch.attach(run, timeout=60, stale_after=3600, display=False)
        until(lambda: att.step >= 60, 90, "the subprocess to reach step 60")
        hit = kill_mid_commit(proc, db)
    finally:
        proc.kill()
    hot = hot_journal(db)
    print(f"kill -9 during a commit: {hit}; hot journal left: {hot}")
    # what a follower on another host is told: the writer is gone (its heartbeat's pid),
    # however long stale_after is; the store still says what the writer last recorded
    until(lambda: att.state == "stale", 10, "the attached run to read as crashed")
    assert not att.running and "stale" in att.message
    assert att.meta["state"] == "running" and att.meta["store_mode"] == "network"
    assert nbwatch.open_run(run).state == "stale"
    assert ls_state(tmp_path, "run") == "stale"
    assert not hot_journal(db)  # the first reader rolled a hot journal back
    reader = RunReader(run)
    killed_at = reader.last_step()
    assert killed_at >= 60
    assert reader.walls().index.tolist() == list(range(1, killed_at + 1))
    assert (run / HEARTBEAT_NAME).exists()  # the dead writer's, kept as the record

    end = killed_at + 20
    subprocess.run([sys.executable, "-c", TRAIN, str(run), "resume", str(end), "0"], cwd=ROOT,
                   env=env_for("network"), check=True, timeout=180)
    reader = RunReader(run)
    assert reader.meta()["state"] == "finished" and reader.store_mode() == "network"
    assert steps_recorded(reader) == list(range(1, end + 1))  # every step, once
    assert reader.walls().index.tolist() == list(range(1, end + 1))
    assert reader.df()["loss/train"].notna().all()
    assert att.state == "finished" and att.step == end
    assert store_files(run) == ["nbwatch.db"]
    att.close()


WRITER = textwrap.dedent("""
    import sys, time
    import numpy as np
    from nbwatch.records import Histogram, Scalars
    from nbwatch.store import RunStore

    store = RunStore(sys.argv[1], flush_interval=0.01)
    step = store.last_step()
    store.truncate_after(step)
    edges = np.linspace(0, 1, 65537)
    while True:
        step += 1
        store.put(Scalars(step, {"loss/train": 1.0 / step}))
        store.put(Histogram(step, "weight/w", edges, np.arange(65536, dtype=np.int64)))
        if step % 4 == 0:
            store.flush()
""")


def committed(run: Path) -> int:
    """The newest step a reader sees committed (0 before the store has its tables)."""
    db = run / "nbwatch.db"
    try:
        return RunReader(run).last_step() if db.exists() and not hot_journal(db) else 0
    except sqlite3.OperationalError:
        return 0


def test_a_hot_journal_a_killed_network_writer_left_is_rolled_back(tmp_path):
    """The kill lands while a commit runs (its journal on disk), until one leaves the
    journal hot: a reader then rolls it back and reads every step committed before."""
    run = tmp_path / "run"
    db = run / "nbwatch.db"
    for attempt in range(10):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(run)], cwd=ROOT,
                                env=env_for("network"))
        try:
            want = 8 * (attempt + 1)
            until(lambda: committed(run) >= want, 60, "the writer's commits")  # noqa: B023
            kill_mid_commit(proc, db)
        finally:
            proc.kill()
        if hot_journal(db):
            break
    else:
        pytest.fail("no kill in 10 left a hot journal")
    print(f"a hot journal after {attempt + 1} kill(s)")
    assert not writer_alive(run)  # its pid is gone: no flock needed to tell
    reader = RunReader(run)  # rolls it back: one read-write open
    assert not hot_journal(db)
    last = reader.last_step()
    assert last >= 8 * (attempt + 1)
    assert reader.walls().index.tolist() == list(range(1, last + 1))
    assert len(reader.histograms("weight/w")[0]) >= last - 4
    store = RunStore(run, mode="network")  # the next writer takes the dead one's claim
    try:
        assert store.last_step() == last and read_heartbeat(run)["pid"] == os.getpid()
    finally:
        store.close()
