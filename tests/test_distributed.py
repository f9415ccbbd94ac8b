"""A real `torchrun --nproc_per_node=2` on CPU (gloo), driven from the test as a user
would from a notebook: through `nbwatch.attach` on the run folder."""

import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import nbwatch
from nbwatch.alerts.signals import straggler
from nbwatch.distributed import merge_ranks
from nbwatch.run import RunNotStarted
from tests.conftest import until


def recorded_step(run_dir: Path) -> int:
    """The run's step, 0 until its writer has created the store (the file can exist a
    moment before its tables do)."""
    try:
        return nbwatch.open_run(run_dir).step if (run_dir / "nbwatch.db").exists() else 0
    except (RunNotStarted, sqlite3.OperationalError):  # "no such table: walls", a moment
        return 0

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "ddp_train.py"


def torchrun(run_dir, steps, cwd=ROOT, **env):
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(SCRIPT), str(run_dir), str(steps)],
        cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_two_ranks_one_store_rank_figures_and_controls_on_every_rank(tmp_path):
    run_dir = tmp_path / "ddp"
    job = nbwatch.launch(SCRIPT, nproc=2, run_dir=run_dir, args=[run_dir, 400], display=False)
    proc = job.process
    try:
        job.wait_started(60)
        until(lambda: job.step >= 30, what="step 30")
        job.scale_lr(0.5)
        until(lambda: (job.events.kind == "action").any(), what="scale_lr acknowledged")
        job.pause()
        until(lambda: job.state == "paused", what="paused")
        held = job.step
        time.sleep(1.0)
        assert job.step == held  # both ranks wait: DDP would hang if only one did
        job.resume()
        assert proc.wait(timeout=120) == 0, (run_dir / "torchrun.log").read_text()[-3000:]
    finally:
        proc.kill()
        job.close()
    run = nbwatch.open_run(run_dir)
    df, ev = run.df, run.events
    assert run.state == "finished" and run.step == 400
    assert run.meta["run"]["world_size"] == 2
    assert [p.name for p in run_dir.glob("*.db")] == ["nbwatch.db"]  # rank 0 alone writes
    for r in (0, 1):
        assert df[f"rank{r}/loss"].notna().all() and df[f"rank{r}/time/step"].notna().all()
    mean = (df["rank0/loss"] + df["rank1/loss"]) / 2
    assert df["loss/train"].tolist() == pytest.approx(mean.tolist())
    for key in ("tokens/real", "throughput/samples_per_s"):  # the job's, not rank 0's
        both = df[f"rank0/{key}"] + df[f"rank1/{key}"]
        assert df[key].dropna().tolist() == pytest.approx(both.dropna().tolist()), key
    # the LR factor changed at the same step on both ranks, and only there
    assert df["rank0/lr"].tolist() == df["rank1/lr"].tolist()
    scaled = ev[(ev.kind == "action") & ev.message.str.startswith("LR scaled")].step.iloc[0]
    ratio = df["lr"] / df["lr"].shift(1)
    assert ratio.loc[scaled + 1] == pytest.approx(0.5 * 0.999)
    assert scaled % 5 == 0  # applied at an exchange step (rank_every=5)
    paused = ev[(ev.kind == "action") & ev.message.str.startswith("paused")].step.iloc[0]
    assert paused % 5 == 0
    # replicas stayed identical to the end
    p0, p1 = (torch.load(run_dir / f"params_rank{r}.pt") for r in (0, 1))
    assert p0["step"] == p1["step"] == 400 and torch.equal(p0["params"], p1["params"])
    # rank 1 sleeps twice as long per step: named as the straggler, once
    strag = ev[ev.message.str.startswith("straggler")]
    assert len(strag) == 1 and "rank 1" in strag.message.iloc[0]


def mine(events, cid):
    """The data of the events naming command `cid`."""
    return [d for d in events.data if isinstance(d, dict) and d.get("id") == cid]


@pytest.mark.parametrize("gpu_order", [False, True])
def test_rewind_under_torchrun_reloads_the_same_checkpoint_on_every_rank(tmp_path, gpu_order):
    """A rewind from an attached process: rank 0 picks the checkpoint, every rank reloads it
    at the same step, the replicas stay identical, the rewound-over steps are a branch (in
    a GPU's order too, where the step the rewind is taken at is still under way when the
    ranks meet: its rows meet again before the branch is set aside)."""
    run_dir = tmp_path / "ddp"
    proc = torchrun(run_dir, 90, CKPT_EVERY="10", STEP_SLEEP="0.04",
                    NBWATCH_GPU_ORDER="1" if gpu_order else "0")
    try:
        until(lambda: recorded_step(run_dir) >= 36, timeout=90, what="step 36", poll=0.2)
        with nbwatch.attach(run_dir) as job:
            cid = job.rewind(steps=5, skip=3)
            until(lambda: mine(job.events, cid), timeout=60, what="its outcome", poll=0.2)
        assert proc.wait(timeout=120) == 0, proc.stdout.read()[-3000:]
    finally:
        proc.kill()
    run = nbwatch.open_run(run_dir)
    ev = run.events
    done = mine(ev, cid)
    assert len(done) == 1 and done[0]["outcome"] == "applied", done
    frm, to = int(done[0]["from"]), int(done[0]["to"])
    assert frm % 5 == 0 and to == (frm - 5) // 10 * 10  # at an exchange; the checkpoint ≤ target
    msg = ev[ev.data.map(lambda d: isinstance(d, dict) and d.get("id") == cid)].message.iloc[0]
    assert "on all 2 ranks" in msg
    assert run.state == "finished" and run.step == 90
    df = run.df
    assert df["loss/train"].loc[1:90].notna().all()  # no hole: the branch replaced, not lost
    branch = run.branches["rewind/1/loss/train"].dropna()
    assert branch.index.tolist() == list(range(to + 1, frm + 1))
    aside = run_dir / "checkpoints" / "rewind" / "1"  # the abandoned branch's, if it had any
    assert sorted(p.name for p in aside.glob("*.pt")) == sorted(done[0]["set_aside"])
    p0, p1 = (torch.load(run_dir / f"params_rank{r}.pt") for r in (0, 1))
    assert p0["step"] == p1["step"] == 90 and torch.equal(p0["params"], p1["params"])


@pytest.mark.parametrize("loop", ["start", "own"])
def test_sigterm_to_the_launcher_stops_the_run_with_a_checkpoint_that_resumes(tmp_path, loop):
    """`kill` of torchrun (a scheduler's preemption), which forwards SIGTERM to every rank:
    rank 0 asks a stop the ranks take at their next meeting: the run ends `stopped` with a
    stop checkpoint, the replicas equal, and (a loop of one's own) resume=True goes on with
    every step once. It read `failed` ("the launcher stops
    the job when a rank fails") with no checkpoint: rank 0 took it for a rank's failure,
    and the other ranks died at once."""
    run_dir = tmp_path / "ddp"
    env = {"LOOP": loop, "STEP_SLEEP": "0.02"}
    proc = torchrun(run_dir, 100_000, **env)
    try:
        until(lambda: recorded_step(run_dir) >= 20, timeout=60, what="step 20")
        proc.send_signal(15)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    run = nbwatch.open_run(run_dir)
    assert run.state == "stopped", out[-3000:]
    assert run.meta["stopped_by"].startswith("terminated by SIGTERM at step")
    stopped = run.step
    assert sorted(run_dir.glob("checkpoints/step_*.pt"))[-1].name == f"step_{stopped:08d}.pt"
    p0, p1 = (torch.load(run_dir / f"params_rank{r}.pt") for r in (0, 1))
    assert p0["step"] == p1["step"] == stopped and torch.equal(p0["params"], p1["params"])
    if loop == "start":
        return
    proc = torchrun(run_dir, stopped + 10, LOOP="own", RESUME="1")
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0, out[-3000:]
    run = nbwatch.open_run(run_dir)
    assert run.state == "finished" and run.df.index.tolist() == list(range(1, stopped + 11))
    p0, p1 = (torch.load(run_dir / f"params_rank{r}.pt") for r in (0, 1))
    assert p0["step"] == p1["step"] == stopped + 10 and torch.equal(p0["params"], p1["params"])


def test_sigterm_to_the_launcher_while_paused_stops_the_run_with_its_checkpoint(tmp_path):
    """A preemption while the run is paused from an attached process (a loop of one's own,
    every rank waiting in `log()`): the ranks take the stop at their next pause meeting,
    with a stop checkpoint. No next `log()` came to ask it, so the ranks waited paused
    until torchrun's SIGKILL 30 s on: the run read `stale`, with no checkpoint."""
    run_dir = tmp_path / "ddp"
    proc = torchrun(run_dir, 100_000, LOOP="own", STEP_SLEEP="0.02")
    try:
        until(lambda: recorded_step(run_dir) >= 10, timeout=60, what="step 10")
        with nbwatch.attach(run_dir) as job:
            job.pause()
            until(lambda: job.state == "paused", timeout=60, what="paused")
        t0 = time.monotonic()
        proc.send_signal(15)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert time.monotonic() - t0 < 20, out[-3000:]  # not torchrun's SIGKILL, 30 s on
    run = nbwatch.open_run(run_dir)
    assert run.state == "stopped", out[-3000:]
    assert run.meta["stopped_by"] == f"terminated by SIGTERM at step {run.step}"
    assert (run_dir / "checkpoints" / f"step_{run.step:08d}.pt").is_file()


@pytest.mark.parametrize("loop", ["start", "own"])
def test_a_killed_rank_stops_the_other_and_the_store_stays_readable(tmp_path, loop):
    """A loop of one's own (`with mon:`) too: rank 0's backward raises as the connection
    drops, and torchrun's SIGTERM came while rank 0 recorded it, in the same thread; the
    handler waited 20 s for that recording, which it had itself interrupted, and the run
    read `stale` with no event."""
    run_dir = tmp_path / "ddp"
    t0 = time.monotonic()
    proc = torchrun(run_dir, 10_000, KILL_RANK="1", KILL_AT="40",
                    **({"LOOP": "own"} if loop == "own" else {}))
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode != 0 and time.monotonic() - t0 < 90
    run = nbwatch.open_run(run_dir)
    assert run.state == "failed" and 35 <= run.step < 45
    err = run.events.query("kind == 'error'").message.iloc[0]
    # whichever reaches rank 0 first, gloo's closed connection or torchrun's SIGTERM, rank
    # 0 records the failure, naming the rank that died, and its emergency checkpoint
    assert err.startswith("[rank 0/2] rank 1 died (its process ended)"), err
    assert run.meta.get("stopped_by") is None
    assert run.df.index.max() == run.step
    ck = max((run_dir / "checkpoints").glob("step_*.pt"))
    assert torch.load(ck, weights_only=True)["step"] == run.step


@pytest.mark.parametrize("loop,ask", [("start", "sigterm"), ("own", "sigterm"),
                                       ("start", "stop")])
def test_a_rank_killed_after_a_stop_was_asked_fails_the_run_naming_it(tmp_path, loop, ask):
    """A stop asked at step 41 (a SIGTERM to rank 0, as a scheduler sends every process of
    the job; or mon.stop()), then rank 1 killed at step 43, before the ranks meet at 45:
    the run reads `failed`, naming rank 1 as dead, the stop kept as context (`stop_asked`,
    the error's words, the stop command expired). It read `stopped` by "terminated by
    SIGTERM" (under start(), torchrun's second SIGTERM ended rank 0 before it could record
    the failure) or `failed` with that stale `stopped_by`, and said only "lost contact with
    another rank"."""
    run_dir = tmp_path / "ddp"
    env = {"STEP_SLEEP": "0.05", "KILL_RANK": "1", "KILL_AT": "43",
           ("SIGTERM_AT" if ask == "sigterm" else "STOP_AT"): "41"}
    proc = torchrun(run_dir, 10_000, **env, **({"LOOP": "own"} if loop == "own" else {}))
    out, _ = proc.communicate(timeout=90)
    run = nbwatch.open_run(run_dir)
    assert run.state == "failed" and 41 <= run.step <= 43, out[-3000:]
    assert run.meta.get("stopped_by") is None
    ev = run.events
    err = ev[ev.kind == "error"]
    assert len(err) == 1, err.message.tolist()
    msg, data = err.message.iloc[0], err.data.iloc[0]
    assert msg.startswith("[rank 0/2] rank 1 died (its process ended), so this rank stops: "), msg
    assert data["dead_ranks"] == [1]
    if ask == "sigterm":
        asked = run.meta["stop_asked"]
        assert asked.startswith("terminated by SIGTERM at step 4"), asked
        assert msg.endswith(f"(a stop had been asked, not taken yet: {asked})")
        assert data["stop_asked"] == asked
    expired = ev[(ev.kind == "command") & ev.message.str.startswith("stop expired")]
    # the stop asked (the SIGTERM's is the process exit's), never taken; after a Stop
    # button's, torchrun's SIGTERM on the death may ask one more as the process exits
    sources = sorted(d["source"] for d in expired.data)
    assert sources in ([["api"], ["api", "exit"]] if ask == "stop" else [["exit"]]), \
        expired[["step", "message", "data"]].to_string()


def test_own_loop_under_torchrun_rank0_records_controls_on_every_rank(tmp_path, monkeypatch):
    """The script's own loop with `mon.log()` under torchrun: rank 0 records, pause and
    cut LR from an attached process act on both ranks at one step, stop ends both loops,
    and the straggler rule names the slow rank (it never fired in a loop of one's own)."""
    run_dir = tmp_path / "own"
    monkeypatch.setenv("LOOP", "own")
    job = nbwatch.launch(SCRIPT, nproc=2, run_dir=run_dir, args=[run_dir, 100_000],
                         display=False)
    proc = job.process
    try:
        job.wait_started(60)
        until(lambda: job.step >= 30, what="step 30")
        job.scale_lr(0.5)
        until(lambda: (job.events.kind == "action").any(), what="scale_lr acknowledged")
        job.pause()
        until(lambda: job.state == "paused", what="paused")
        held = job.step
        time.sleep(1.0)
        assert job.step == held
        job.stop()  # while paused: both ranks leave their loop at the same log()
        assert proc.wait(timeout=120) == 0, (run_dir / "torchrun.log").read_text()[-3000:]
    finally:
        proc.kill()
        job.close()
    run = nbwatch.open_run(run_dir)
    df, ev = run.df, run.events
    assert run.state == "stopped" and run.step == held
    assert run.meta["run"]["mode"] == "loop" and run.meta["run"]["world_size"] == 2
    mean = (df["rank0/loss"] + df["rank1/loss"]) / 2
    assert df["loss/train"].tolist() == pytest.approx(mean.tolist())
    assert df["rank0/lr"].tolist() == df["rank1/lr"].tolist()
    scaled = ev[(ev.kind == "action") & ev.message.str.startswith("LR scaled")].step.iloc[0]
    assert scaled % 5 == 0
    assert df.loc[scaled + 1, "lr"] / df.loc[scaled, "lr"] == pytest.approx(0.5 * 0.999)
    p0, p1 = (torch.load(run_dir / f"params_rank{r}.pt") for r in (0, 1))
    assert p0["step"] == p1["step"] == held and torch.equal(p0["params"], p1["params"])
    # rank 1 sleeps twice as long before its forward: its own time (step start to forward
    # end) tells it, where step times alike (its peer waits in the gradient sync) did not
    assert df["rank1/time/busy"].median() > 1.3 * df["rank0/time/busy"].median()
    strag = ev[ev.message.str.startswith("straggler")]
    assert len(strag) == 1 and "rank 1" in strag.message.iloc[0], ev.message.tolist()


def test_a_wait_at_the_ranks_meeting_is_not_the_fast_ranks_busy_time(tmp_path):
    """Rank 1 works 0.1 s after each optimizer step (before `log()`), and the ranks meet
    at every step (as steps of 2 s or more do): rank 0 waits for it at the meeting. That
    wait was counted in rank 0's next `time/busy`, so the straggler rule named the fast
    rank 0 ("straggler: rank 0 is …% slower")."""
    run_dir = tmp_path / "own"
    job = torchrun(run_dir, 30, LOOP="own", STEP_SLEEP="0", AFTER_SLEEP="0.1", RANK_EVERY="1")
    out, _ = job.communicate(timeout=120)
    assert job.returncode == 0, out[-3000:]
    run = nbwatch.open_run(run_dir)
    df, ev = run.df, run.events
    assert df["rank0/time/sync"].loc[5:].median() > 0.05  # it did wait there
    assert df["rank0/time/busy"].median() < 0.05, df["rank0/time/busy"].describe()
    assert not ev.message.str.startswith("straggler: rank 0").any(), ev.message.tolist()


@pytest.mark.parametrize("loop, steps", [("start", 20), ("own", 22)])
def test_a_stop_after_the_ranks_last_meeting_ends_the_run_stopped(tmp_path, loop, steps):
    """A stop asked within the last `rank_every` steps reaches the other ranks only at
    their final meeting, as the run ends: it ends stopped, with a stop checkpoint, on
    every rank (it failed with stopping → finished)."""
    run_dir = tmp_path / loop
    # start() meets at steps 5, 10, 15 and at its end; an own loop at 5, …, 20 and at its end
    job = torchrun(run_dir, steps, STOP_AT=str(steps - 1), LOOP=loop, STEP_SLEEP="0")
    out, _ = job.communicate(timeout=120)
    assert job.returncode == 0, out[-3000:]
    run = nbwatch.open_run(run_dir)
    assert run.state == "stopped" and run.step == steps, run.events.message.tolist()
    saved = run.events[run.events.kind == "checkpoint"].message
    assert saved.str.startswith(f"stop checkpoint at step {steps}").any(), saved.tolist()
    assert not (run.events.kind == "error").any()


def test_a_default_run_dir_is_rank_0s_on_every_rank(tmp_path):
    """`Monitor(run_dir=None)` names runs/<date-time> from the clock: rank 1, a second
    later, would name another folder (FSDP2's shards would then be split over two)."""
    job = torchrun("unused", 10, cwd=tmp_path, RUN_DIR="default", STEP_SLEEP="0")
    out, _ = job.communicate(timeout=120)
    assert job.returncode == 0, out[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert nbwatch.open_run(run_dir).state == "finished"
    assert sorted(p.name for p in run_dir.glob("params_rank*.pt")) == [
        "params_rank0.pt", "params_rank1.pt"]  # each rank's mon.run_dir


def test_a_monitor_on_rank_0_alone_is_refused_in_words(tmp_path):
    job = torchrun(tmp_path / "r", 10, ONLY_RANK0="1", DIST_TIMEOUT="4", STEP_SLEEP="0")
    out, _ = job.communicate(timeout=120)
    assert job.returncode != 0
    assert "every rank creates its Monitor" in out, out[-3000:]


def test_the_run_says_which_rank_failed_and_why(tmp_path):
    """rank 1's step raises: rank 0 only sees its peer gone, yet the run's error names rank
    1's ValueError, with its traceback (it said only "lost contact with another rank")."""
    run_dir = tmp_path / "r"
    job = torchrun(run_dir, 40, RAISE_RANK="1", RAISE_AT="7", STEP_SLEEP="0")
    out, _ = job.communicate(timeout=120)
    assert job.returncode != 0
    run = nbwatch.open_run(run_dir)
    assert run.state == "failed"
    (err,) = run.events[run.events.kind == "error"].itertuples()
    assert "ValueError: rank 1 failed on purpose at call 7" in err.message, out[-3000:]
    assert err.message.startswith("[rank 0/2] another rank failed")
    (peer,) = err.data["rank_errors"]
    assert peer["rank"] == 1 and "failed on purpose" in peer["traceback"]


def test_ranks_whose_loops_end_at_different_steps_are_told_so(tmp_path):
    """Uneven data: rank 0's own loop ends at step 23, rank 1's goes on. The run fails
    saying the ranks are out of step and what to do (rank 0's final meeting paired with
    rank 1's step-25 one, and the run read finished at 23 while rank 1 failed)."""
    run_dir = tmp_path / "r"
    job = torchrun(run_dir, 30, LOOP="own", NO_DDP="1", R0_STEPS="23", STEP_SLEEP="0")
    out, _ = job.communicate(timeout=120)
    assert job.returncode != 0
    run = nbwatch.open_run(run_dir)
    assert run.state == "failed" and run.step == 23
    err = run.events[run.events.kind == "error"].message.iloc[0]
    assert "out of step (rank 0 ended at step 23, rank 1 was at step 25)" in err, out[-3000:]
    assert "drop_last=True" in err


def test_the_same_script_runs_alone_without_torchrun(tmp_path):
    run_dir = tmp_path / "single"
    out = subprocess.run([sys.executable, str(SCRIPT), str(run_dir), "30"], cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    run = nbwatch.open_run(run_dir)
    assert run.state == "finished" and run.step == 30
    assert not [c for c in run.df.columns if c.startswith("rank")]
    assert run.meta["run"]["world_size"] == 1


def test_merge_ranks_means_the_loss_and_names_columns():
    rows = [[(1, {"loss": 2.0, "time/step": 0.1})], [(1, {"loss": 4.0, "time/step": 0.3})]]
    (sc,) = merge_ranks(rows)
    assert sc.step == 1 and sc.values["loss/train"] == 3.0
    assert sc.values["rank1/time/step"] == 0.3
    assert straggler({0: 0.10, 1: 0.11, 2: 0.10}) is None
    assert straggler({0: 0.10, 1: 0.13, 2: 0.10}) == (1, pytest.approx(0.3))
    # 30% slower, but 3 ms of a 1 s step (5% at least: noise, it costs the job nothing)
    assert straggler({0: 0.010, 1: 0.013}, step=1.0) is None
    assert straggler({0: 0.010, 1: 0.013}, step=0.05) == (1, pytest.approx(0.3))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 1,
                    reason="needs a CUDA device (NCCL path)")
def test_gpu_rank_figures_include_memory():
    from nbwatch.distributed import rank_figures

    torch.ones(1024, 1024, device="cuda")
    assert rank_figures({"loss/train": 1.0})["gpu/mem_gb"] > 0


def test_slow_steps_meet_more_often_so_a_command_waits_seconds_not_steps(tmp_path):
    """rank_every=5 with 0.8 s steps: a command waited up to 5 steps (with minute-long
    steps, 5 minutes). Rank 0 plans each next meeting about 2 s of steps on (here every 3
    steps), the same step on every rank; their figures still meet."""
    run_dir = tmp_path / "slow"
    proc = torchrun(run_dir, 14, STEP_SLEEP="0.8")
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out[-3000:]
    df = nbwatch.open_run(run_dir).df
    met = df.index[df["rank0/time/sync"] > 0].tolist()
    assert len(met) >= 4, met  # every 5 steps: 2 meetings in 14 steps
    assert max(b - a for a, b in zip(met, met[1:])) <= 3, met
    assert df["rank1/loss"].notna().all() and df["loss/train"].notna().all()


DATA = ROOT / "tests" / "scripts" / "data_ranks.py"


def data_run(tmp_path, case):
    """tests/scripts/data_ranks.py's `case` under torchrun: its run, and what it printed."""
    run_dir = tmp_path / case
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(DATA), str(run_dir), case], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240)
    assert out.returncode == 0, out.stdout[-3000:]
    return nbwatch.open_run(run_dir), out.stdout


def test_the_jobs_tokens_and_samples_are_both_ranks_packed_and_padded_batches(tmp_path):
    """`log(loss, batch=...)`, rank 0's rows packed (its documents the samples), rank 1's
    padded (its rows): the job's tokens/real and samples/s are the sum of both ranks', and
    its lengths and padding are the job's batch's (rank 0's alone before)."""
    from tests.scripts.data_ranks import PACKED, PADDED

    run, _ = data_run(tmp_path, "counts")
    df = run.df
    assert df["tokens/real"].tolist() == [sum(a) + sum(b) for a, b in zip(PACKED, PADDED)]
    for step in (2, 3, 4):
        row, docs, rows = df.loc[step], PACKED[step - 1], PADDED[step - 1]
        assert row["rank0/throughput/samples_per_s"] == pytest.approx(
            len(docs) / row["rank0/time/step"], rel=1e-4)
        assert row["rank1/throughput/samples_per_s"] == pytest.approx(
            len(rows) / row["rank1/time/step"], rel=1e-4)
        assert row["throughput/samples_per_s"] == pytest.approx(
            row["rank0/throughput/samples_per_s"] + row["rank1/throughput/samples_per_s"])
        real = sum(docs) + sum(rows)
        assert row["data/seq_len_mean"] == pytest.approx(real / (len(docs) + len(rows)))
        assert row["data/seq_len_max"] == max(docs + rows)
        padding = 12 * len(rows) - sum(rows)  # rank 1's rows padded to 12, rank 0's none
        assert row["data/padding_ratio"] == pytest.approx(padding / (real + padding))
        assert row["rank0/data/seq_len_mean"] == pytest.approx(sum(docs) / len(docs))


@pytest.mark.parametrize("case, said", [("zeros", "float mask of zeros alone"),
                                        ("bad", "1 entries other than 0 and 1")])
def test_a_mask_warning_of_rank_1s_batch_is_said_once_by_rank_0(tmp_path, case, said):
    """A step mask of zeros alone (start()) or of other values than 0 and 1 (log(mask=))
    on rank 1 alone: the run says so once, naming the rank, at its step (rank 1 said it
    to its own stderr alone, and rank 0, its batch good, nothing); rank 0's own at a
    later step is not said again, and the counts make no column. The warning that one
    micro-batch's loss was logged is printed once for the job (every rank printed it)."""
    run, printed = data_run(tmp_path, case)
    ev = run.events
    told = ev[ev.message.str.contains(said)]
    assert len(told) == 1 and told.step.iloc[0] == 3, ev.message.tolist()
    assert told.message.iloc[0].startswith("rank 1's batch: ")
    assert told.severity.iloc[0] == "warning" and run.state == "finished"
    assert said not in printed  # not a rank's own word besides
    if case == "bad":  # two backward passes a step, one loss logged: warned by rank 0 alone
        assert printed.count("got one forward's loss") == 1, printed[-3000:]
    assert not [c for c in run.df.columns if "_mask" in c]


@pytest.mark.parametrize("case", ["probe", "kernel", "unseen"])
def test_the_fsdp2_probe_pass_speaks_once_for_the_job_and_switches_kernels_together(
        tmp_path, case):
    """FSDP2, every rank's probe pass together: a model without attention keeps its pass
    for act/rms and logits at each eval, said once for the job; a Llama on a kernel that
    returns no weights (as flash attention) runs it as SDPA on both ranks, its maps
    recorded, its kernel back after (the script asserts it), no rank held."""
    run, out = data_run(tmp_path, case)
    df, ev = run.df, run.events
    assert run.state == "finished" and run.step == 4
    assert not (ev.severity == "critical").any()
    probe = ev[ev.kind == "probe"].message.tolist()
    if case == "probe":
        assert len(probe) == 1 and "no attention layer" in probe[0], probe
        assert df.loc[[2, 4], ["act/rms/blocks.0", "logits/z_mean"]].notna().all().all()
    elif case == "unseen":  # a warning, in the run once; no rank prints it on the console
        assert len(probe) == 1 and "saw no attention weights" in probe[0], probe
        assert (ev[ev.kind == "probe"].severity == "warning").all()
        assert "saw no attention weights" not in out, out[-2000:]
        assert df.loc[[2, 4], "logits/z_mean"].notna().all()
    else:
        assert not probe
        assert df.loc[[2, 4], "attn/entropy/model.layers.0.self_attn"].notna().all()


def test_ranks_failing_as_the_first_ones_wait_runs_out_agree_on_the_checkpoint(monkeypatch):
    """FSDP2's emergency checkpoint is a collective: the failing ranks must all try it or
    none. Rank 1 says it failed just after rank 0, whose 5 s wait is running out, looked
    for it: rank 1 finds every rank failed, and rank 0 (its last look stale) must not give
    up alone, or rank 1 waits in the checkpoint's collective out the group's timeout. One
    answer holds for both: the first one written in the store."""
    import torch.distributed as dist

    from nbwatch.distributed import Dist

    shared = dist.HashStore()
    ranks = [Dist(r, 2, 10, None, "gloo", key="nbwatch/host:1/0") for r in (0, 1)]
    said: dict[int, list[str]] = {}

    class Late:  # rank 0's store: rank 1 fails in the moment after rank 0 looked
        def __getattr__(self, name):
            return getattr(shared, name)

        def check(self, keys):
            seen = shared.check(keys)
            if keys == ["nbwatch/host:1/0/failed/1"] and 1 not in said:
                stores.append(shared)
                said[1] = ranks[1].not_failed(wait=0.0)
            return seen

    stores: list = [Late()]
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: stores.pop())
    said[0] = ranks[0].not_failed(wait=0.0)
    assert (said[0] == []) == (said[1] == []), said
