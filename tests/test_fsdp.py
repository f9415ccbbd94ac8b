"""FSDP2 (`fully_shard`) under a real `torchrun`, 2 CPU ranks on gloo, as real subprocesses
(tests/scripts/fsdp_train.py): the figures are those of the full model, as torch computes
them on the sharded model in the same run; steering acts on every rank at one step; a
checkpoint is written by every rank and a resumed run continues with the same weights."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import nbwatch
from tests.conftest import until

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "fsdp_train.py"


def env(**extra):
    return {**os.environ, "PYTHONPATH": str(ROOT), **{k: str(v) for k, v in extra.items()}}


def torchrun(run_dir, steps, **extra):
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(SCRIPT), str(run_dir), str(steps)],
        cwd=ROOT, env=env(**extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc, timeout=120):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"torchrun did not end in {timeout} s:\n{out[-3000:]}") from None
    assert proc.returncode == 0, out[-4000:]
    return out


def refs(run_dir, name="ref", ranks=(0, 1)):
    """Each rank's reference figures (torch's, on the sharded model), by step."""
    per = [json.loads((run_dir / f"{name}_rank{r}.json").read_text()) for r in ranks]
    return per


def check_norms(run_dir, name="ref", ranks=(0, 1)):
    """grad_norm/global, grad_norm/<layer> and grad_norm/clipped as stored by rank 0 equal
    torch's figures on the sharded model (clip_grad_norm_(...).full_tensor(), the norms of
    the gathered full gradients, get_total_norm after nbwatch's clip) at every step."""
    df = nbwatch.open_run(run_dir).df
    per = refs(run_dir, name, ranks)
    steps = per[0]["steps"]
    assert steps, "the script recorded no optimizer step"
    for other in per[1:]:  # every rank saw the same full figures
        assert [s["step"] for s in other["steps"]] == [s["step"] for s in steps]
        for a, b in zip(steps, other["steps"]):
            assert a["global"] == pytest.approx(b["global"], rel=1e-6)
    for s in steps:
        row = df.loc[s["step"]]
        assert row["grad_norm/global"] == pytest.approx(s["global"], rel=1e-5), (
            f"step {s['step']}: grad_norm/global is not clip_grad_norm_'s on the sharded model")
        for layer, v in s["layers"].items():
            assert row[f"grad_norm/{layer}"] == pytest.approx(v, rel=1e-4, abs=1e-8), (
                f"step {s['step']}: grad_norm/{layer} is not the full gradient's norm")
        assert row["grad_norm/clipped"] == pytest.approx(s["after_clip"], rel=1e-4)
    return df, steps


def test_fsdp2_start_full_norms_clip_histograms_attention(tmp_path):
    """`start()` on an FSDP2 TinyGPT: norms equal torch's on the sharded model, nbwatch's clip
    acts on both ranks' shards (the full norm after it is the limit), update ratios and
    histograms are of the full weights, attention maps at each eval, and every rank writes
    its shards of each checkpoint."""
    run_dir = tmp_path / "fsdp"
    t0 = time.monotonic()
    finish(torchrun(run_dir, 8, LOOP="start", CLIP=0.3, EVAL_EVERY=4))
    took = time.monotonic() - t0
    run = nbwatch.open_run(run_dir)
    assert run.state == "finished" and run.step == 8, run.events.message.tolist()
    assert run.meta["run"]["world_size"] == 2
    assert [p.name for p in run_dir.glob("*.db")] == ["nbwatch.db"]  # rank 0 alone writes
    df, steps = check_norms(run_dir)
    assert [s["step"] for s in steps] == list(range(1, 9))
    for s in steps:  # clipped at 0.3 on every rank: the full norm after the clip is 0.3
        assert s["global"] > 0.3 and s["after_clip"] == pytest.approx(0.3, rel=1e-4)
    for r in (0, 1):
        assert df[f"rank{r}/loss"].notna().all()
    # update ratios of the full weights: finite and positive at the histogram steps
    ratios = df.loc[3, [c for c in df.columns if c.startswith("update_ratio/")]]
    assert len(ratios) == len(steps[0]["layers"]) and (ratios > 0).all()
    # histograms of the full parameters: every element counted once, over both shards
    full = torch.load(run_dir / "ref_full_end.pt")["state"]
    numel: dict[str, int] = {}
    for k, v in full.items():
        numel[k.rpartition(".")[0]] = numel.get(k.rpartition(".")[0], 0) + v.numel()
    for layer, n in numel.items():
        hs, _, counts = run.histograms(f"weight/{layer}")
        assert len(hs) and (counts.sum(axis=1) == n).all(), layer
    # attention maps and val loss at each eval (steps 4 and 8), recorded by rank 0
    for step in (4, 8):
        maps = run.attention(step=step)
        assert set(maps) == {"blocks.0.attn", "blocks.1.attn"}, maps.keys()
        assert all(m.shape[0] == 2 and m.shape[1] == m.shape[2] for m in maps.values())
    assert df["loss/val"].dropna().index.tolist() == [4, 8]
    # every rank wrote its shards; rank 0 the nbwatch state that names them
    ck = torch.load(run_dir / "checkpoints" / "step_00000008.pt", weights_only=True)
    assert ck["sharded"] == "step_00000008.dcp" and ck["model"] is None
    shards = sorted(p.name for p in (run_dir / "checkpoints" / ck["sharded"]).iterdir())
    assert ".metadata" in shards and len([s for s in shards if s.endswith(".distcp")]) == 2
    print(f"start() FSDP2 run: {took:.1f} s")


def test_fsdp2_own_loop_stop_at_one_step_then_resume_with_the_same_weights(tmp_path):
    """The script's own loop with `mon.log()`: Cut LR, Clip, Pause and Stop from an attached
    process act on both ranks at one step (a stop while paused ends both loops with a
    checkpoint of their shards); `resume=True` loads the same full weights and continues
    with no hole in the steps."""
    run_dir = tmp_path / "own"
    proc = torchrun(run_dir, 100_000, LOOP="own", STEP_SLEEP=0.15)
    job = nbwatch.attach(run_dir, display=False)
    acts = lambda: (job.events.kind == "action").sum()  # noqa: E731
    try:
        job.wait_started(90)
        until(lambda: job.step >= 3, timeout=90, what="step 3")
        job.scale_lr(0.5)
        until(lambda: acts() >= 1, timeout=60, what="scale_lr acknowledged")
        job.set_clip(0.2)
        until(lambda: acts() >= 2, timeout=60, what="set_clip acknowledged")
        job.pause()
        until(lambda: job.state == "paused", timeout=60, what="paused")
        held = job.step
        time.sleep(1.0)
        assert job.step == held  # both ranks wait: a sharded forward would hang otherwise
        job.stop()  # while paused: both ranks leave their loop at the same log()
        finish(proc)
    finally:
        proc.kill()
        job.close()
    run = nbwatch.open_run(run_dir)
    held = run.step
    assert run.state == "stopped" and run.meta["run"]["mode"] == "loop"
    ends = [r["end"] for r in refs(run_dir)]
    assert ends == [held, held]  # both ranks left their loop at the same log()
    assert held % 2 == 0  # at an exchange step (rank_every=2)
    df, steps = check_norms(run_dir)
    ev = run.events
    scaled, clipped = (ev[ev.message.str.startswith(m)].step.iloc[0]
                       for m in ("LR scaled", "gradient clipping at 0.2"))
    assert scaled % 2 == 0 and clipped % 2 == 0  # applied at an exchange, on both ranks
    assert df["rank0/lr"].tolist() == df["rank1/lr"].tolist()
    assert df.loc[scaled + 1, "lr"] / df.loc[scaled, "lr"] == pytest.approx(0.5 * 0.99)
    for s in steps:  # torch's full norm after nbwatch's clip: clipped on every rank's shard
        want = min(s["global"], 0.2) if s["step"] > clipped else s["global"]
        assert s["after_clip"] == pytest.approx(want, rel=1e-4), s["step"]
    assert (run_dir / "checkpoints" / f"step_{held:08d}.dcp" / ".metadata").is_file()
    assert (run.df["loss/val"].dropna().index % 4 == 0).all()
    assert run.attention(step=4)

    finish(torchrun(run_dir, held + 4, LOOP="own", RESUME=1, REF="resumed"))
    before = torch.load(run_dir / "ref_full_end.pt")
    after = torch.load(run_dir / "resumed_full_start.pt")
    assert before["step"] == after["step"] == held
    assert before["state"].keys() == after["state"].keys()
    for k, v in before["state"].items():
        assert torch.equal(v, after["state"][k]), f"{k} differs after the resume's load"
    run = nbwatch.open_run(run_dir)
    assert run.state == "finished" and run.step == held + 4
    assert run.df.index.tolist() == list(range(1, held + 5))  # no hole, no repeat
    _, steps = check_norms(run_dir, "resumed")
    assert [s["step"] for s in steps] == list(range(held + 1, held + 5))


def test_fsdp2_a_nan_step_in_the_gpus_order_is_zeroed_on_every_ranks_shards(tmp_path):
    """In the GPU's order (the skip decided on the device, nothing read before the
    optimizer), a step whose loss is NaN on both ranks is zeroed on each rank's gradient
    shards (AdamW without `fused` takes no found_inf): the full weights stay finite, the
    step reads `skipped`, and training goes on."""
    run_dir = tmp_path / "nan"
    finish(torchrun(run_dir, 10, LOOP="own", DEFER=1, NAN_AT=5))
    run = nbwatch.open_run(run_dir)
    assert run.state == "finished" and run.step == 10
    df = run.df
    assert df.loc[5, "skipped"] == 1.0 and df["skipped"].fillna(0).sum() == 1
    assert df.loc[6:, "loss/train"].between(0, 100).all()  # finite, training on
    end = torch.load(run_dir / "ref_full_end.pt")["state"]
    assert end and all(torch.isfinite(v).all() for v in end.values())
    (msg,) = run.events.query("kind == 'alert'").message
    assert msg.startswith("nonfinite") and "zeroed" in msg


def test_fsdp2_hugging_face_gpt2(tmp_path):
    """A tiny GPT2LMHeadModel (no download; tied embeddings; eager attention) sharded per
    block: the same figures as torch's, and its attention maps at the evals."""
    run_dir = tmp_path / "gpt2"
    finish(torchrun(run_dir, 6, LOOP="start", MODEL="gpt2", EVAL_EVERY=3))
    run = nbwatch.open_run(run_dir)
    assert run.state == "finished" and run.step == 6
    _, steps = check_norms(run_dir)
    assert "transformer.wte" in steps[0]["layers"]
    maps = run.attention(step=6)
    assert {"transformer.h.0.attn", "transformer.h.1.attn"} <= set(maps), maps.keys()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp2_rewind_reloads_every_ranks_shards_at_one_step(tmp_path):
    """A rewind of a sharded model: every rank reloads its shards of the checkpoint rank 0
    picked, at one exchange step (a rank that did not would hang the collective load); the
    rewound-over steps are a branch, the live history has no hole, and the norms recorded
    after the reload are still torch's."""
    run_dir = tmp_path / "rw"
    finish(torchrun(run_dir, 16, LOOP="start", CKPT_EVERY=4, REWIND_AT=9, STEP_SLEEP=0.05,
                    EVAL_EVERY=100))
    run = nbwatch.open_run(run_dir)
    ev = run.events
    done = ev[(ev.kind == "action") & ev.message.str.startswith("rewound")]
    assert len(done) == 1 and "on all 2 ranks" in done.message.iloc[0], ev.message.tolist()
    frm, to = done.data.iloc[0]["from"], done.data.iloc[0]["to"]
    assert frm >= 9 and frm % 2 == 0 and to == (frm - 3) // 4 * 4  # rank_every=2, every 4
    assert run.state == "finished" and run.step == 16
    assert run.df["loss/train"].loc[1:16].notna().all()
    assert run.branches["rewind/1/loss/train"].dropna().index.tolist() == list(
        range(to + 1, frm + 1))
    df = run.df
    for r in refs(run_dir):
        last = {s["step"]: s for s in r["steps"]}  # the live branch's, after the reload
        assert sorted(last) == list(range(1, 17))
        for step, s in last.items():
            assert df.loc[step, "grad_norm/global"] == pytest.approx(s["global"], rel=1e-5)


def test_two_nodes_on_localhost_one_store_and_a_stop_on_every_rank(tmp_path):
    """Two simulated nodes (`--nnodes=2 --node_rank=0|1`, 1 process each: 4 processes are
    too slow on this 2-core machine), started side by side: global rank 0 alone writes the
    store, with figures of both ranks; a stop from an attached process ends both nodes at
    the same step. The loop clips with clip_grad_norm_ itself: the norms before its clip
    are recorded, as without FSDP."""
    run_dir = tmp_path / "nodes"
    port = free_port()
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={n}",
         "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}",
         str(SCRIPT), str(run_dir), "100000"],
        cwd=ROOT, env=env(LOOP="own", STEP_SLEEP=0.1, LOOP_CLIP=0.3), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True) for n in (0, 1)]
    job = nbwatch.attach(run_dir, display=False)
    try:
        job.wait_started(90)
        until(lambda: job.step >= 4, timeout=90, what="step 4")
        job.stop()
        for p in nodes:
            finish(p)
    finally:
        for p in nodes:
            p.kill()
        job.close()
    run = nbwatch.open_run(run_dir)
    assert run.state == "stopped" and run.meta["run"]["world_size"] == 2
    assert [p.name for p in run_dir.glob("*.db")] == ["nbwatch.db"]
    assert [r["end"] for r in refs(run_dir)] == [run.step, run.step]
    for r in (0, 1):
        assert run.df[f"rank{r}/loss"].notna().all()
    # the loop clips at 0.3 itself: the norms recorded are those before its clip
    _, steps = check_norms(run_dir)
    assert all(s["global"] > 0.3 and s["after_clip"] == pytest.approx(0.3, rel=1e-4)
               for s in steps)
    assert run.events.message.str.contains("the loop clips its gradients itself").any()


def test_a_run_folder_a_rank_does_not_share_is_refused_before_step_1(tmp_path):
    """Every rank writes its FSDP2 shards into the checkpoint folder: where a rank sees
    another folder (a node with its own disk), checkpoints would hold rank 0's shards only
    and never resume. Both ranks refuse as the run opens, naming the rank and the fix."""
    run_dir = tmp_path / "r"
    proc = torchrun(run_dir, 4, LOOP="start", OWN_DISK=1)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0
    said = "rank(s) 1 do not see what rank 0 writes there"
    assert out.count(said) >= 2 and "a filesystem every node shares" in out, out[-3000:]
    assert not list((tmp_path / "r_node1").rglob("*.partial"))
    assert not (run_dir / "nbwatch.db").exists() and not list(run_dir.rglob(".shared-check-*"))


def test_a_full_disk_under_one_ranks_shards_fails_the_run_with_its_cause(tmp_path):
    """torch's CheckpointException is a BaseException: it went past nbwatch's handling,
    leaving a half-written step_N.dcp.partial, no failed-checkpoint event and a raw
    traceback as the run's error. Now: the disk-full rank named, the partial removed."""
    run_dir = tmp_path / "r"
    proc = torchrun(run_dir, 12, LOOP="own", CKPT_EVERY=4, DISK_FULL_AT=8)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0
    run = nbwatch.open_run(run_dir)
    assert run.state == "failed"
    failed = run.events[(run.events.kind == "checkpoint") & (run.events.severity == "critical")]
    said = failed.message.iloc[0]
    assert failed.step.iloc[0] == 8 and said.startswith("periodic checkpoint at step 8 failed: "
                                                         "disk full: sharded checkpoint")
    assert "rank 1: OSError" in said and "resume=True continues from step 4" in said, said
    error = run.events[run.events.kind == "error"].message.iloc[0]
    assert "Traceback" not in error and len(error) < 600, error
    assert not list((run_dir / "checkpoints").glob("*.partial"))
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == [
        "step_00000004.dcp", "step_00000004.pt"]


def test_fsdp1_is_refused_with_the_fsdp2_alternative(tmp_path):
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        model = FullyShardedDataParallel(torch.nn.Linear(4, 4), device_id=torch.device("cpu"))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(TypeError, match=r"FSDP1 .*fully_shard") as e:
            nbwatch.Monitor(model, opt, run_dir=tmp_path / "fsdp1")
        assert "\n" not in str(e.value)
        assert not (tmp_path / "fsdp1").exists()
    finally:
        dist.destroy_process_group()


def test_a_failure_on_every_rank_writes_an_emergency_checkpoint_that_resumes(tmp_path):
    """An error on every rank at one step: every rank writes its shards of the emergency
    checkpoint; `resume=True` (here from a loop of the script's own) loads those weights."""
    run_dir = tmp_path / "fail"
    proc = torchrun(run_dir, 50, LOOP="start", RAISE_AT=6, EVAL_EVERY=100)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0
    run = nbwatch.open_run(run_dir)
    assert run.state == "failed" and run.step == 5, out[-3000:]
    ev = run.events
    assert "failed on purpose" in ev[ev.kind == "error"].message.iloc[0]
    ck = ev[(ev.kind == "checkpoint") & ev.message.str.startswith("emergency")]
    assert len(ck) == 1 and ck.step.iloc[0] == 5, ev.message.tolist()
    assert (run_dir / "checkpoints" / "step_00000005.dcp" / ".metadata").is_file()

    finish(torchrun(run_dir, 7, LOOP="own", RESUME=1, REF="resumed"))
    before = torch.load(run_dir / "ref_full_end.pt")
    after = torch.load(run_dir / "resumed_full_start.pt")
    assert before["step"] == after["step"] == 5
    for k, v in before["state"].items():
        assert torch.equal(v, after["state"][k]), f"{k} differs after the resume's load"
    run = nbwatch.open_run(run_dir)
    assert run.state == "finished" and run.df.index.tolist() == list(range(1, 8))


def test_one_rank_failing_alone_ends_the_job_without_waiting_out_the_timeout(tmp_path):
    """Rank 1 raises at a step where rank 0 trains on (blocked in the next sharded
    forward's all-gather until rank 1's process ends): rank 1 tries no sharded emergency
    checkpoint, a collective rank 0 cannot join (it waited out the group's 30 s timeout),
    and the run reads failed with rank 1's error and why no checkpoint was written (rank
    0's words: its peer is gone)."""
    run_dir = tmp_path / "one"
    proc = torchrun(run_dir, 10_000, LOOP="start", RAISE_AT=6, RAISE_RANK=1, EVAL_EVERY=100)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0
    run = nbwatch.open_run(run_dir)
    assert run.state == "failed" and run.step == 5, out[-3000:]
    ev = run.events
    err = ev[ev.kind == "error"].message.iloc[0]
    assert "[rank 1/2] RuntimeError: the step function failed on purpose" in err, err
    ck = ev[ev.kind == "checkpoint"].message.tolist()
    assert len(ck) == 1 and "checkpoint needs every rank" in ck[0], ck
    failed_at = json.loads((run_dir / "rank_errors" / "rank1.json").read_text())
    # rank 1's failure and the end of the run, by the run's own clocks: seconds, not 30
    ended = ev[ev.kind == "state"].wall.iloc[-1]
    rank1_wall = (run_dir / "rank_errors" / "rank1.json").stat().st_mtime
    assert failed_at["step"] == 5 and ended - rank1_wall < 20, (ended - rank1_wall, out[-2000:])


def test_a_killed_rank_ends_the_other_with_a_clear_error(tmp_path):
    """Rank 1 dies (SIGKILL) mid-run: rank 0, waiting in a sharded forward's all-gather or
    in nbwatch's exchange, ends too and the run reads failed, saying why; no emergency
    checkpoint can be written without every rank's shards, and the event says so."""
    run_dir = tmp_path / "killed"
    t0 = time.monotonic()
    proc = torchrun(run_dir, 10_000, LOOP="start", KILL_RANK=1, KILL_AT=6, EVAL_EVERY=100)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0 and time.monotonic() - t0 < 120
    run = nbwatch.open_run(run_dir)
    assert run.state == "failed" and 4 <= run.step <= 6, out[-3000:]
    err = run.events.query("kind == 'error'").message.iloc[0]
    # whichever reaches rank 0 first, gloo's closed connection or torchrun's SIGTERM, rank
    # 0 records the failure, naming the rank that died
    assert err.startswith("[rank 0/2] rank 1 died (its process ended)"), err
    ck = run.events[run.events.message.str.startswith("emergency checkpoint")]
    if len(ck):  # rank 0 had the time to try: the shards of rank 1 are gone
        assert "needs every rank" in ck.message.iloc[0], ck.message.iloc[0]
        assert not list((run_dir / "checkpoints").glob("*.partial"))  # nothing left over
    assert not list((run_dir / "checkpoints").glob("step_*.pt"))
