"""System samples live on their own wall-clock timeline: a long step (a compile, an eval)
keeps every sample taken during it, readable after the run from its folder."""

from __future__ import annotations

import sqlite3
import threading
import time

import numpy as np
import psutil
import pytest

import nbwatch
from nbwatch.panels import Feed
from nbwatch.panels.tail import Tail
from nbwatch.probes.system import CpuMeter
from nbwatch.records import Scalars, SystemSample
from nbwatch.store import DB_NAME, RunReader, RunStore
from tests.conftest import tiny_step

INTERVAL = 0.2
LONG = 3.0


def test_a_long_step_keeps_every_system_sample(tiny, tmp_path):
    model, opt, batches = tiny
    span: dict[str, float] = {}

    def step_fn(m, batch):
        if mon.step == 2:  # the third step: a 3 s "compile"
            span["start"] = time.time()
            time.sleep(LONG)
            span["end"] = time.time()
        return tiny_step(m, batch)

    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "run", system_interval=INTERVAL)
    mon.start(step_fn, batches, max_steps=5, display=False)
    mon.wait()
    assert mon.state == "finished"
    live = mon.system()

    run = nbwatch.open_run(tmp_path / "run")  # reopened from the folder alone
    sys_df = run.system()
    assert sys_df.index.name == "wall" and list(sys_df.columns[:2]) == ["step",
                                                                        "system/cpu/util"]
    assert sys_df.equals(live)
    walls = sys_df.index.to_numpy()
    assert (np.diff(walls) > 0).all(), "two samples share a wall time: one overwrote another"
    during = sys_df[(walls >= span["start"]) & (walls <= span["end"])]
    print(f"{len(during)} samples during the {LONG:.0f} s step at {INTERVAL} s "
          f"({len(sys_df)} in the run)")
    assert len(during) >= 10
    assert set(during["step"]) == {2}  # the steps completed while it ran
    assert during["system/cpu/util"].between(0, 100).all()
    assert (during["system/ram/used_gb"] > 0).all()
    gaps = np.diff(during.index.to_numpy())
    assert np.median(gaps) == pytest.approx(INTERVAL, abs=0.1)  # one per interval

    # `df` keeps its per-step system columns: the newest sample taken at that step
    df = run.df
    assert "system/cpu/util" in df and df.index.tolist() == [1, 2, 3, 4, 5]
    newest = sys_df[sys_df["step"] == 2].iloc[-1]
    assert df.loc[2, "system/ram/used_gb"] == pytest.approx(newest["system/ram/used_gb"])
    assert run.reader.last_value("system/ram/used_gb") == pytest.approx(
        sys_df["system/ram/used_gb"].iloc[-1])
    # a window of the timeline, by wall time
    window = run.system(["system/cpu/util"], start=span["start"], stop=span["end"])
    assert list(window.columns) == ["step", "system/cpu/util"] and len(window) == len(during)


def test_a_run_shorter_than_one_interval_has_a_sample(tiny, tmp_path):
    model, opt, batches = tiny

    def step_fn(m, batch):
        time.sleep(0.1)
        return tiny_step(m, batch)

    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "run", system_interval=30)
    mon.start(step_fn, batches, max_steps=3, display=False)
    mon.wait()
    got = nbwatch.open_run(tmp_path / "run").system()
    assert len(got) == 1  # taken as the sampler stopped: the time since it started
    assert got["step"].iloc[0] == 3 and 0 <= got["system/cpu/util"].iloc[0] <= 100


def test_cpu_meter_keeps_its_own_window():
    """Another caller of psutil.cpu_percent (a second run's sampler, the user) resets
    psutil's one window; the sampler's reading still covers the time since its last."""
    meter = CpuMeter(psutil)
    stop = time.monotonic() + 0.5
    while time.monotonic() < stop:  # keep one core busy, resetting psutil's window
        psutil.cpu_percent(interval=None)
        sum(range(2000))
    assert meter.percent() >= 100 / (psutil.cpu_count() or 1) * 0.5


def samples(store: RunStore, t0: float, n: int, step: int, at: int = 0) -> None:
    for i in range(at, at + n):
        store.put(SystemSample({"system/cpu/util": float(i), "system/ram/used_gb": 1.0},
                               step, wall=t0 + 0.2 * i))


def test_a_follower_reads_each_sample_once_across_the_closing_merge(tmp_path):
    store = RunStore(tmp_path / "run", flush_interval=60)
    t0 = time.time()
    tail = Tail(RunReader(tmp_path / "run"))
    got: list[np.ndarray] = []
    for k in range(5):  # five commits: five rows, merged into one when the writer closes
        samples(store, t0, 10, step=k, at=10 * k)
        store.flush()
        if k in (1, 3):
            got.append(tail.poll().system["system/cpu/util"][1])
    store.close()
    assert len(RunReader(tmp_path / "run").query("SELECT id FROM system_samples")) == 1
    got.append(tail.poll().system["system/cpu/util"][1])
    assert np.concatenate(got).tolist() == [float(i) for i in range(50)]


def test_a_rewind_keeps_the_timeline(tmp_path):
    """Truncating steps (a rewind, a resume) drops their scalars, not the machine's history."""
    store = RunStore(tmp_path / "run")
    t0 = time.time()
    for s in range(1, 6):
        store.put(Scalars(s, {"loss/train": 1.0 / s}, wall=t0 + s))
    samples(store, t0, 20, step=5)
    store.truncate_after(2)
    store.close()
    run = nbwatch.open_run(tmp_path / "run")
    assert run.df.index.tolist() == [1, 2]
    assert len(run.system()) == 20


def test_a_folder_without_the_timeline_still_reads(tmp_path):
    """A run folder an older nbwatch wrote (system figures as step-keyed scalars, no
    timeline table) reads as before; a writer of this version that opens it (a resume)
    adds the timeline."""
    store = RunStore(tmp_path / "run")
    for s in range(1, 4):
        store.put(Scalars(s, {"loss/train": 1.0}))
        store.put(Scalars(s, {"system/cpu/util": 10.0 * s, "system/ram/used_gb": 2.0}))
    store.close()
    con = sqlite3.connect(tmp_path / "run" / DB_NAME)
    con.execute("DROP TABLE system_samples")  # what a writer before the timeline made
    con.commit()
    con.close()

    run = nbwatch.open_run(tmp_path / "run")
    assert run.df["system/cpu/util"].tolist() == [10.0, 20.0, 30.0]
    assert run.system().empty and "system/cpu/util" not in run.system()
    assert run.reader.last_value("system/cpu/util") == 30.0
    feed = Feed(RunReader(tmp_path / "run"))
    assert feed.update()["system"]["cpu_util"] == 30.0  # the gauges, from the old scalars

    store = RunStore(tmp_path / "run")
    samples(store, time.time(), 3, step=3)
    store.close()
    run = nbwatch.open_run(tmp_path / "run")
    assert len(run.system()) == 3
    assert run.df.loc[3, "system/cpu/util"] == 2.0  # the newest sample at step 3


def test_samples_written_while_a_reader_follows(tmp_path):
    """A follower polling while the sampler writes sees every sample, in wall order."""
    store = RunStore(tmp_path / "run", flush_interval=0.05)
    t0 = time.time()
    done = threading.Event()

    def write():
        for i in range(200):
            store.put(SystemSample({"system/cpu/util": float(i)}, 0, wall=t0 + 0.1 * i))
            if i % 7 == 0:
                time.sleep(0.005)
        done.set()

    writer = threading.Thread(target=write)
    writer.start()
    tail = Tail(RunReader(tmp_path / "run"))
    seen: list[float] = []
    while not done.is_set() or tail.system_id < max(
            (r[0] for r in tail.reader.query("SELECT id FROM system_samples")), default=0):
        d = tail.poll()
        if d.system:
            seen += d.system["system/cpu/util"][1].tolist()
        time.sleep(0.01)
    writer.join()
    store.close()
    seen += (tail.poll().system.get("system/cpu/util", ((), np.empty(0)))[1]).tolist()
    assert seen == [float(i) for i in range(200)]
