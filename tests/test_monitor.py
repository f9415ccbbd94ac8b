"""End to end on a real (tiny) GPT: the Monitor's thread, controls, failures, resume."""

import math
import os
import time

import numpy as np
import pytest
import torch

import nbwatch
from nbwatch.checkpoint import load
from nbwatch.panels.loss import smooth as smooth_loss
from tests.conftest import make_batches, own_step, tiny_step, until


def slow_step(model, batch):
    time.sleep(0.01)
    return tiny_step(model, batch)


def monitor(tiny, tmp_path, **kw):
    model, opt, _ = tiny
    return nbwatch.Monitor(model, opt, run_dir=tmp_path / "run", **kw)


def test_start_returns_at_once_and_records_every_step(tiny, tmp_path):
    model, opt, batches = tiny
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    mon = nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "run", config={"lr": 1e-3})
    t0 = time.perf_counter()
    mon.start(slow_step, batches, max_steps=40, val_fn=lambda m: 3.0, eval_every=20,
              hist_every=10, display=False)
    assert time.perf_counter() - t0 < 2.0 and mon.running
    mon.wait()
    assert (mon.state, mon.step) == ("finished", 40)
    df = mon.df
    assert df.index.tolist() == list(range(1, 41))
    # the LR a step used, read before scheduler.step(): step s used base * 1/(1 + s - 1)
    assert df["lr"].tolist() == pytest.approx([1e-3 / s for s in range(1, 41)])
    # the epoch from step 1 (0: the first pass over the data), not from the first wrap
    assert df["epoch"].notna().all() and df["epoch"].iloc[0] == 0
    assert df["epoch"].is_monotonic_increasing
    assert df["grad_norm/global"].notna().all() and (df["grad_norm/global"] > 0).all()
    assert df["grad_norm/clipped"].tolist() == df["grad_norm/global"].tolist()  # no clip set
    layer_cols = [c for c in df if c.startswith("grad_norm/") and c not in
                  ("grad_norm/global", "grad_norm/clipped")]
    np.testing.assert_allclose(np.sqrt((df[layer_cols] ** 2).sum(axis=1)),
                               df["grad_norm/global"], rtol=1e-5)
    # padding ratio and tokens of step 1 are those of the first batch's mask
    mask = batches[0]["mask"]
    assert df.loc[1, "data/padding_ratio"] == pytest.approx(1 - mask.float().mean().item())
    assert df.loc[1, "tokens/real"] == mask.sum().item()
    assert df.loc[1, "throughput/tokens_per_s"] == pytest.approx(
        mask.sum().item() / df.loc[1, "time/step"])
    assert df.loc[20, "loss/val"] == 3.0
    # the gap is measured on the smoothed train curve the loss panel draws, at that step
    smooth, _ = smooth_loss(df.loc[1:20, "loss/train"].to_numpy())
    assert df.loc[20, "loss/gap"] == pytest.approx(3.0 - float(smooth[-1]), rel=1e-6)
    assert df["update_ratio/head"].dropna().index.tolist() == [1, 10, 20, 30, 40]
    run = nbwatch.open_run(mon.run_dir)
    assert run.config == {"lr": 1e-3}
    assert run.meta["loss_reduction"].startswith("masked token mean")
    assert run.environment["torch"] == torch.__version__
    steps, edges, counts = run.histograms("weight/blocks.0.attn.qkv")
    assert steps.tolist() == [1, 10, 20, 30, 40]
    assert counts.sum(axis=1).tolist() == [32 * 96 + 96] * 5
    assert run.histograms("data/seq_len")[2].sum() == 40 * 4  # each sequence of 40 steps, once
    # attention of the first batch's first samples at each eval, from the SDPA model
    att = run.attention()
    assert sorted(att) == ["blocks.0.attn", "blocks.1.attn"]
    assert att["blocks.0.attn"].shape[0] == 2  # heads
    assert run.reader.attention_steps() == [20, 40]
    with pytest.raises(KeyError, match="no attention maps at step 30: .* steps 20, 40"):
        run.attention(step=30)  # not {}, which says "no attention in this model"
    with pytest.raises(KeyError, match=r"no attention sample 5 at step 40: .*recorded 2"):
        run.attention(sample=5)
    with pytest.raises(KeyError, match=r"did you mean 'weight/blocks.0.attn.qkv'.*more\)"):
        run.histograms("weight/blocks.0.attn")  # the module, not its layer
    kinds = mon.events.kind.tolist()
    assert kinds.count("checkpoint") == 2 and kinds[-1] == "state"
    lines = (mon.run_dir / "log.jsonl").read_text().splitlines()
    import json

    assert any(json.loads(ln)["message"].startswith("periodic checkpoint") for ln in lines)


def test_pause_stops_the_step_count_and_resume_restarts_it(tiny, tmp_path):
    mon = monitor(tiny, tmp_path)
    mon.start(slow_step, tiny[2], max_steps=10_000, display=False)
    until(lambda: mon.step >= 3)
    mon.pause()
    until(lambda: mon.state == "paused")
    paused_at = mon.step
    time.sleep(0.5)
    assert mon.step == paused_at
    mon.resume()
    until(lambda: mon.step >= paused_at + 3)
    mon.stop()
    mon.wait()
    assert mon.state == "stopped"
    ev = mon.events
    actions = ev[ev.kind == "action"]
    assert actions.message.str.startswith("paused").any()
    assert actions[actions.message.str.startswith("paused")].step.iloc[0] == paused_at
    assert load(mon.checkpointer.latest())["step"] == mon.step  # stop writes a final checkpoint


def test_scale_lr_holds_under_the_schedule(tiny, tmp_path):
    model, opt, batches = tiny
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=200)
    mon = nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "run")
    mon.start(slow_step, batches, max_steps=10_000, display=False)
    until(lambda: mon.step >= 5)
    mon.scale_lr(0.5)
    until(lambda: any(mon.events.kind == "action"))
    at = int(mon.events.query("kind == 'action'").step.iloc[0])
    until(lambda: mon.step >= at + 12)
    mon.stop()
    mon.wait()
    df = mon.df
    cosine = [1e-3 * (1 + math.cos(math.pi * (s - 1) / 200)) / 2 for s in df.index]
    ratio = df["lr"] / cosine
    assert ratio.loc[:at].tolist() == pytest.approx([1.0] * at)
    assert ratio.loc[at + 1:].tolist() == pytest.approx([0.5] * (len(df) - at))


def test_reduce_lr_on_plateau_is_stepped_by_val_fn_not_the_runner(tiny, tmp_path):
    """start() steps a scheduler after each optimizer step; ReduceLROnPlateau takes a
    metric, so val_fn steps it with its val loss (the runner's step() without one used
    to be refused before the run opened). The dry run's call of val_fn before step 1
    leaves it as it was."""
    model, opt, batches = tiny
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
    worse = iter(range(100))

    def val_fn(m):
        loss = 3.0 + next(worse)  # never better: a cut at each eval but the first
        sched.step(loss)
        return {"loss": loss}

    mon = nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "run")
    mon.start(tiny_step, batches, max_steps=12, val_fn=val_fn, eval_every=4, display=False)
    mon.wait()
    lrs = mon.df["lr"]
    # evals after steps 4, 8 (and 12): the first sets the best, each later one cuts
    assert lrs.tolist() == pytest.approx([1e-3] * 8 + [5e-4] * 4)
    assert not mon.events.message.str.contains("LR changed").any()


def test_clip_bounds_the_post_clip_norm(tiny, tmp_path):
    mon = monitor(tiny, tmp_path)
    mon.start(slow_step, tiny[2], max_steps=10_000, display=False)
    until(lambda: mon.step >= 3)
    df = mon.df
    limit = float(df["grad_norm/global"].median()) / 3
    mon.set_clip(limit)
    until(lambda: any(mon.events.kind == "action"))
    at = int(mon.events.query("kind == 'action'").step.iloc[0])
    until(lambda: mon.step >= at + 5)
    mon.set_clip(None)
    mon.stop()
    mon.wait()
    after = mon.df.loc[at + 1: at + 5]
    assert (after["grad_norm/clipped"] <= limit * (1 + 1e-4)).all()
    assert (after["grad_norm/global"] > limit).all()  # the pre-clip norm is still reported


def test_checkpoint_button_writes_a_loadable_file(tiny, tmp_path):
    mon = monitor(tiny, tmp_path)
    mon.start(slow_step, tiny[2], max_steps=10_000, display=False)
    until(lambda: mon.step >= 2)
    mon.checkpoint()
    until(lambda: any(mon.events.kind == "checkpoint"))
    mon.stop()
    mon.wait()
    ev = mon.events.query("kind == 'checkpoint'").iloc[0]
    assert "manual checkpoint" in ev.message and ev.data["seconds"] >= 0
    ck = torch.load(ev.data["path"], weights_only=True)
    assert ck["step"] == ev.step
    assert ck["controls"] == {"clip": None, "lr_factor": 1.0, "lr_raw": False}


def test_a_failing_step_is_recorded_checkpointed_and_reraised(tiny, tmp_path):
    def step(model, batch):
        if step.calls == 7:
            raise ZeroDivisionError("boom at call 7")
        step.calls += 1
        return tiny_step(model, batch)

    step.calls = 0
    mon = monitor(tiny, tmp_path)
    mon.start(step, tiny[2], max_steps=50, display=False)
    with pytest.raises(ZeroDivisionError, match="boom at call 7") as first:
        mon.wait()
    with pytest.raises(ZeroDivisionError) as again:  # each wait() says it, the same way
        mon.wait()
    assert len(again.traceback) == len(first.traceback)  # it grew a frame a call
    assert again.traceback[-1].name == "step"  # where it was raised, kept
    assert mon.state == "failed" and mon.step == 7
    assert "ZeroDivisionError" in mon.traceback
    err = mon.events.query("kind == 'error'").iloc[0]
    assert err.severity == "critical" and "boom" in err.data["traceback"]
    assert mon.df.index.max() == 7  # nothing recorded was lost
    assert load(mon.checkpointer.latest())["step"] == 7  # emergency checkpoint
    assert nbwatch.open_run(mon.run_dir).state == "failed"


def test_resume_continues_numbering_and_curves(tiny, tmp_path):
    model, opt, batches = tiny
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.99**s)
    mon = nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "run")
    mon.start(tiny_step, batches, max_steps=20, checkpoint_every=10, display=False)
    mon.wait()
    first = mon.df
    torch.manual_seed(123)
    from nbwatch.demo import TinyGPT

    model2 = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 0.99**s)
    mon2 = nbwatch.Monitor(model2, opt2, sched2, run_dir=tmp_path / "run")
    with pytest.raises(FileExistsError, match="pass resume=True"):
        mon2.start(tiny_step, batches, max_steps=30, display=False)
    mon2.start(tiny_step, batches, max_steps=30, resume=True, display=False)
    mon2.wait()
    df = mon2.df
    assert df.index.tolist() == list(range(1, 31))
    assert df.loc[:20, "loss/train"].tolist() == first["loss/train"].tolist()
    assert df["lr"].tolist() == pytest.approx([1e-3 * 0.99 ** (s - 1) for s in range(1, 31)])
    assert mon2.events.message.str.contains("run running at step 20").any()


def test_resume_after_a_crash_drops_records_past_the_checkpoint(tiny, tmp_path):
    def step(model, batch):
        step.calls += 1
        if step.calls == 16:
            raise RuntimeError("crash")
        return tiny_step(model, batch)

    step.calls = 0
    mon = monitor(tiny, tmp_path)
    mon.start(step, tiny[2], max_steps=30, checkpoint_every=10, display=False)
    with pytest.raises(RuntimeError):
        mon.wait()
    ck = mon.checkpointer
    ck.latest().unlink()  # pretend the emergency checkpoint was never written
    mon2 = nbwatch.Monitor(tiny[0], tiny[1], run_dir=tmp_path / "run")
    mon2.start(tiny_step, tiny[2], max_steps=12, resume=True, display=False)
    mon2.wait()
    assert mon2.df.index.tolist() == list(range(1, 13))
    # the curve goes back: one warning says which steps were dropped, and why
    said = mon2.events[mon2.events.message.str.startswith("the folder held steps")]
    assert said.message.tolist() == ["the folder held steps 11–15, recorded after the "
                                     "checkpoint this run resumes from (step 10): dropped, "
                                     "and trained again"]
    assert said.step.tolist() == [10]


def test_gradient_accumulation_equals_one_big_batch(tmp_path):
    from nbwatch.demo import TinyGPT, collate

    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(1, 60, (13,), generator=g).tolist() for _ in range(8)]
    full, half_a, half_b = collate(rows), collate(rows[:4]), collate(rows[4:])
    norms = []
    for accumulate, data in ((1, [full]), (2, [half_a, half_b])):
        torch.manual_seed(0)
        model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / f"acc{accumulate}")
        mon.start(tiny_step, data, max_steps=1, accumulate=accumulate, display=False).wait()
        norms.append(mon.df.loc[1, ["loss/train", "grad_norm/global", "tokens/real"]].tolist())
    assert norms[0] == pytest.approx(norms[1], rel=1e-5)


def test_bf16_autocast_inside_step_fn(tiny, tmp_path):
    def step(model, batch):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return tiny_step(model, batch)

    mon = monitor(tiny, tmp_path)
    mon.start(step, tiny[2], max_steps=5, display=False).wait()
    assert np.isfinite(mon.df["grad_norm/global"]).all()


def test_grad_scaler_norms_are_unscaled(tmp_path):
    from nbwatch.demo import TinyGPT

    norms = []
    for use_scaler in (False, True):
        torch.manual_seed(0)
        model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12) if use_scaler else None
        mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / str(use_scaler), scaler=scaler)
        mon.start(tiny_step, make_batches(), max_steps=3, display=False).wait()
        norms.append(mon.df["grad_norm/global"].tolist())
    assert norms[1] == pytest.approx(norms[0], rel=1e-4)


# -- bad input: each gets an error that names the problem and the fix ----------------------
def test_bad_constructor_inputs(tiny, tmp_path):
    model, opt, _ = tiny
    with pytest.raises(TypeError, match="torch.nn.Module"):
        nbwatch.Monitor("model", opt, run_dir=tmp_path / "a")
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no parameters that require grad"):
        nbwatch.Monitor(frozen, torch.optim.SGD([torch.zeros(1, requires_grad=True)]),
                        run_dir=tmp_path / "b")
    other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1)
    sched = torch.optim.lr_scheduler.StepLR(other, 1)
    with pytest.raises(ValueError, match="scheduler was built on another optimizer"):
        nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "c")
    foreign = tmp_path / "tb"
    foreign.mkdir()
    (foreign / "events.out.tfevents.1").write_text("x")
    with pytest.raises(FileExistsError, match="did not write .*events.out.tfevents.1"):
        nbwatch.Monitor(model, opt, run_dir=foreign)
    locked = tmp_path / "locked"
    locked.mkdir()
    os.chmod(locked, 0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as a user who can write anywhere (root)")
        with pytest.raises(PermissionError, match="not writable"):
            nbwatch.Monitor(model, opt, run_dir=locked / "run")
    finally:
        os.chmod(locked, 0o700)


def test_a_run_dir_under_a_file_names_the_file(tiny, tmp_path):
    model, opt, _ = tiny
    (tmp_path / "afile").write_text("x")
    for under in (tmp_path / "afile" / "run", tmp_path / "afile" / "a" / "run"):
        with pytest.raises(NotADirectoryError, match=f"under {tmp_path / 'afile'}, which is a "
                                                      "file, not a folder"):
            nbwatch.Monitor(model, opt, run_dir=under)


@pytest.mark.parametrize(
    "returned, error, match",
    [
        (lambda m, b: None, TypeError, "returned None"),
        (lambda m, b: 1.5, TypeError, "not a tensor"),
        (lambda m, b: m(b["input_ids"]).mean(-1), ValueError, "not a scalar"),
        (lambda m, b: {"logits": m(b["input_ids"]), "labels": b["labels"],
                       "mask": b["mask"][:, :-1]}, ValueError, "does not match"),
    ],
)
def test_bad_step_fn_output_fails_the_run(tiny, tmp_path, returned, error, match):
    mon = monitor(tiny, tmp_path)
    mon.start(returned, tiny[2], max_steps=3, display=False)
    with pytest.raises(error, match=match):
        mon.wait()
    assert mon.state == "failed"


def test_second_start_and_resume_without_checkpoint(tiny, tmp_path):
    mon = monitor(tiny, tmp_path)
    with pytest.raises(FileNotFoundError, match="holds no checkpoint"):
        mon.start(tiny_step, tiny[2], max_steps=3, resume=True, display=False)
    mon.start(slow_step, tiny[2], max_steps=10_000, display=False)
    with pytest.raises(RuntimeError, match="already running"):
        mon.start(slow_step, tiny[2], max_steps=10, display=False)
    mon.stop()
    mon.wait()
    with pytest.raises(RuntimeError, match="cannot pause: the run is stopped"):
        mon.pause()


def test_corrupt_checkpoint_on_resume(tiny, tmp_path):
    mon = monitor(tiny, tmp_path)
    mon.start(tiny_step, tiny[2], max_steps=4, display=False).wait()
    mon.checkpointer.latest().write_bytes(b"garbage")
    mon2 = nbwatch.Monitor(tiny[0], tiny[1], run_dir=tmp_path / "run")
    with pytest.raises(RuntimeError, match="step_00000004.pt cannot be read.*delete it"):
        mon2.start(tiny_step, tiny[2], max_steps=8, resume=True, display=False)


def test_empty_data_and_bad_arguments(tiny, tmp_path):
    mon = monitor(tiny, tmp_path)
    with pytest.raises(ValueError, match="max_steps must be a positive int.*max_steps=1000"):
        mon.start(tiny_step, tiny[2], max_steps=0, display=False)
    with pytest.raises(ValueError, match=r"got '10'; pass int\('10'\)"):  # read from a config
        mon.start(tiny_step, tiny[2], max_steps="10", display=False)
    with pytest.raises(TypeError, match="train_data must be iterable"):
        mon.start(tiny_step, 5, max_steps=3, display=False)
    mon.start(tiny_step, [], max_steps=3, display=False)
    with pytest.raises(ValueError, match="yielded no batches"):
        mon.wait()


def test_grad_scaler_overflow_is_routine_not_an_alert(tmp_path):
    from nbwatch.demo import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)  # overflows at first

    def big_loss(model, batch):  # gradients × 1e3 × 2^127: beyond float32
        out = tiny_step(model, batch)
        return {"loss": nbwatch.masked_cross_entropy(out["logits"], out["labels"],
                                                     out["mask"]) * 1e3}

    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", scaler=scaler)
    mon.start(big_loss, make_batches(), max_steps=6, display=False).wait()
    assert mon.state == "finished"
    assert mon.df.loc[1, "amp/overflow"] == 1.0
    assert not (mon.events.severity == "critical").any()
    assert scaler.get_scale() < 2.0**127  # the scaler lowered its scale, as it should


def test_a_store_that_stops_writing_fails_the_run_loudly(tiny, tmp_path):
    mon = monitor(tiny, tmp_path)
    mon.start(slow_step, tiny[2], max_steps=10_000, display=False)
    # steps are recorded in batches (within RECORD_EVERY_S of their end): wait for some
    until(lambda: len(nbwatch.open_run(mon.run_dir).df) >= 3, what="3 steps committed")
    mon._session.store.flush()
    with pytest.raises(TypeError, match="cannot store a object"):
        mon._session.store.put(object())  # refused at once, not lost with a whole batch
    mon._session.store._wcon.close()  # the disk goes away: the writer thread fails
    # closing the last connection also deletes the WAL: the writer may see that first
    with pytest.raises(RuntimeError, match="stopped writing|write-ahead log .* was deleted"):
        mon.wait()
    assert mon.state == "failed"
    assert nbwatch.open_run(mon.run_dir).df.index.max() >= 3  # what was committed stays


def test_a_torch_compiled_model_is_probed_and_named_as_the_model(tmp_path):
    """torch.compile wraps the model (`_orig_mod`) and would trace the probe's hooks."""
    from nbwatch.demo import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-3)
    mon = nbwatch.Monitor(compiled, opt, run_dir=tmp_path / "r")
    mon.start(tiny_step, make_batches(), max_steps=4, eval_every=2, display=False).wait()
    assert mon.state == "finished"
    assert not [c for c in mon.df if "_orig_mod" in c]
    assert "grad_norm/blocks.0.attn.qkv" in mon.df
    assert sorted(nbwatch.open_run(tmp_path / "r").attention()) == [
        "blocks.0.attn", "blocks.1.attn"]
    # its checkpoints hold the plain module: they load into the uncompiled model, and a
    # compiled model resumes from them
    ck = load(mon.checkpointer.latest())
    assert not [k for k in ck["model"] if k.startswith("_orig_mod.")]
    TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32).load_state_dict(ck["model"])
    again = torch.compile(TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32), backend="eager")
    mon2 = nbwatch.Monitor(again, torch.optim.AdamW(again.parameters(), lr=1e-3),
                           run_dir=tmp_path / "r", resume=True)
    assert mon2.step == 4
    assert torch.equal(again._orig_mod.head.weight, model.head.weight)


def test_a_model_without_attention_says_so_once(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "r")
    data = [torch.randn(4, 4) for _ in range(4)]
    mon.start(lambda m, x: m(x).square().mean(), data, max_steps=6, eval_every=2,
              display=False).wait()
    probes = mon.events.query("kind == 'probe'")
    assert len(probes) == 1 and "no attention weights" in probes.message.iloc[0]
    # nothing went wrong: an info, where an attention the probe cannot see warns
    assert probes.severity.iloc[0] == "info" and "no attention layer" in probes.message.iloc[0]


def test_an_attention_the_probe_cannot_see_warns(tmp_path):
    class Attn(torch.nn.Module):  # hand-written: no SDPA, no weights returned
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(4, 12)

        def forward(self, x):
            q, k, v = self.qkv(x).chunk(3, -1)
            return (q @ k.transpose(-1, -2)).softmax(-1) @ v

    torch.manual_seed(0)
    model = torch.nn.Sequential(Attn(), torch.nn.Linear(4, 1))
    mon = nbwatch.Monitor(model, torch.optim.SGD(model.parameters(), lr=0.1),
                          run_dir=tmp_path / "r")
    data = [torch.randn(2, 3, 4) for _ in range(4)]
    mon.start(lambda m, x: m(x).square().mean(), data, max_steps=4, eval_every=2,
              display=False).wait()
    probes = mon.events.query("kind == 'probe'")
    assert len(probes) == 1 and probes.severity.iloc[0] == "warning", probes.message.tolist()
    assert "F.scaled_dot_product_attention" in probes.message.iloc[0]


def test_blocks_whose_attention_the_probe_cannot_see_keep_their_health_figures(tmp_path):
    """A language model of one's own whose blocks compute attention by hand (no SDPA, no
    weights returned): the probe says once, as a warning, that it sees no attention
    weights, and goes on for the residual stream and the output logits at every eval (it
    switched itself off at the first, leaving each of those figures one point)."""
    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(16, 48)

        def forward(self, x):
            q, k, v = self.qkv(x).chunk(3, -1)
            return x + (q @ k.transpose(-1, -2) / 4).softmax(-1) @ v

    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(32, 16)
            self.blocks = torch.nn.ModuleList([Attn(), Attn()])
            self.head = torch.nn.Linear(16, 32)

        def forward(self, ids):
            x = self.emb(ids)
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    torch.manual_seed(0)
    model = LM()
    mon = nbwatch.Monitor(model, torch.optim.SGD(model.parameters(), lr=0.1),
                          run_dir=tmp_path / "r")
    data = [torch.randint(0, 32, (2, 8)) for _ in range(4)]

    def step_fn(m, ids):
        return torch.nn.functional.cross_entropy(m(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    mon.start(step_fn, data, max_steps=6, eval_every=2, probe_batch=data[0],
              display=False).wait()
    probes = mon.events.query("kind == 'probe'")
    assert len(probes) == 1 and probes.severity.iloc[0] == "warning", probes.message.tolist()
    assert "F.scaled_dot_product_attention" in probes.message.iloc[0]
    assert "goes on for the residual stream" in probes.message.iloc[0]
    df = mon.df
    for key in ("act/rms/blocks.1", "logits/z_mean"):
        assert df[key].dropna().index.tolist() == [2, 4, 6], key


def test_a_monitor_let_go_frees_its_model_and_optimizer(tmp_path):
    """A notebook makes many Monitors (a cell run again): one no longer referenced, used or
    not, must not keep its model, optimizer and their memory alive."""
    import gc
    import weakref

    from nbwatch.demo import TinyGPT

    refs = []
    for run in ("unused", "ran"):
        model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / run)
        if run == "ran":
            mon.start(tiny_step, make_batches(4), max_steps=3, display=False).wait()
        refs += [weakref.ref(model), weakref.ref(opt), weakref.ref(mon)]
        del model, opt, mon
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)


def test_a_resumed_start_goes_on_from_where_its_data_stood(tmp_path):
    """start(resume=True) trains on from the checkpoint's place in the data (its epoch and
    batch), as the Trainer does: not the first batches again. Here 8 batches an epoch, 2 a
    step: step 10 ends at epoch 2, batch 4; step 11 takes batches 4 and 5 of epoch 2."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = [torch.full((1, 2), float(i)) for i in range(8)]
    seen: list[int] = []

    def step(m, x):
        seen.append(int(x[0, 0]))
        return m(x).square().mean()

    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False)
    mon.start(step, data, max_steps=10, accumulate=2, checkpoint_every=10).wait()
    assert seen == [*range(8), *range(8), 0, 1, 2, 3]
    seen.clear()
    mon.start(step, data, max_steps=14, accumulate=2, resume=True).wait()
    assert seen == [4, 5, 6, 7, 0, 1, 2, 3]  # the epoch's last 4, then the next epoch's
    df = mon.df
    assert df.loc[11, "epoch"] == 2 and df.loc[13, "epoch"] == 3
    assert mon.events.message.str.contains("resumed at epoch 2, batch 4 of the data").any()


@pytest.mark.parametrize("own_generator, workers", [(False, 0), (True, 0), (False, 1)])
def test_a_resumed_start_skips_the_batches_a_shuffled_loader_trained_on(tmp_path,
                                                                       own_generator, workers):
    """A shuffled DataLoader draws each epoch's order when its pass starts (from its
    generator, or torch's RNG): a resume used to skip the right count of batches of a new
    order, so some samples were trained on twice and others never, while the event said
    "not trained on again". The pass is opened again under the RNG states it was first
    opened with: the resumed run (a new process's model, optimizer and loader) trains on the
    same samples, with the same losses, as a run never stopped. With persistent workers
    (one iterator, reset at each later epoch: it draws its sampler's seed alone) too."""

    def make():
        torch.manual_seed(0)  # what a script does first, in each process
        model = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Dropout(0.2),
                                    torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        loader = torch.utils.data.DataLoader(
            torch.arange(16.0), batch_size=2, shuffle=True, num_workers=workers,
            persistent_workers=workers > 0,
            generator=torch.Generator().manual_seed(2) if own_generator else None)
        return model, opt, loader

    def train(run, steps, resume=False, **kw):
        seen: list[list[int]] = []

        def step(m, x):
            seen.append([int(v) for v in x])
            return m(x[:, None]).square().mean()

        model, opt, loader = make()
        mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / run, display=False)
        mon.start(step, loader, max_steps=steps, resume=resume, **kw).wait()
        return seen, mon

    whole, ref = train("whole", 20)  # 8 batches an epoch: step 12 ends at epoch 1, batch 4
    first, _ = train("stopped", 12, checkpoint_every=12)
    assert first == whole[:12]
    rest, mon = train("stopped", 20, resume=True)
    assert rest == whole[12:]
    assert mon.df["loss/train"].tolist() == pytest.approx(ref.df["loss/train"].tolist())
    said = mon.events[mon.events.message.str.startswith("resumed at epoch 1, batch 4")]
    assert said.message.str.contains("the batches trained on before").all() and len(said) == 1


@pytest.mark.parametrize("returned, error, match", [
    ({"loss": {"a": 1.0}}, TypeError, r"val_fn\(\)\['loss'\] is a dict .*a real number"),
    (torch.tensor([1.0, 2.0]), ValueError, r"val_fn\(\) has shape \(2,\).*reduce it first"),
    ({3: 1.0}, TypeError, r"val_fn\(\)'s key 3 is a int.*name each val figure by a str"),
])
def test_a_bad_val_fn_result_fails_at_step_0_naming_val_fn_and_the_key(
        tiny, tmp_path, returned, error, match):
    """val_fn's result is checked as `mon.log(val=...)` is: start()'s dry run before step 1
    fails the run with the one line that names val_fn, the key and what it may return."""
    mon = monitor(tiny, tmp_path)
    mon.start(tiny_step, tiny[2], max_steps=4, val_fn=lambda m: returned, eval_every=2,
              display=False)
    with pytest.raises(RuntimeError, match=match) as got:
        mon.wait()
    assert isinstance(got.value.__cause__, error)
    assert (mon.state, mon.step) == ("failed", 0)
    assert "dry run before step 1" in str(mon.error)


def test_a_val_fn_that_raises_is_named_in_the_runs_error(tiny, tmp_path):
    """The error of a val_fn that raises at an eval said only "KeyError: 'val_loader'": it
    names val_fn and the eval's step now (as sample_fn's does), the cause kept."""
    calls = []

    def val_fn(model):
        calls.append(1)
        if len(calls) > 1:  # (the first call: start()'s dry run)
            raise KeyError("val_loader")
        return 1.0

    mon = monitor(tiny, tmp_path)
    mon.start(tiny_step, tiny[2], max_steps=8, val_fn=val_fn, eval_every=4, display=False)
    with pytest.raises(RuntimeError, match=r"val_fn raised at the eval of step 4: KeyError"):
        mon.wait()
    assert isinstance(mon.error.__cause__, KeyError)
    err = mon.events[mon.events.kind == "error"].message.iloc[0]
    assert "val_fn raised at the eval of step 4: KeyError: 'val_loader'" in err


def test_a_val_fn_returning_numpy_values_is_taken(tiny, tmp_path):
    """A one-element numpy value (what `np.mean` returns) is a val figure, as `float()` and
    `log()`'s scalars take it."""
    import numpy as np

    mon = monitor(tiny, tmp_path)
    mon.start(tiny_step, tiny[2], max_steps=4, eval_every=2, display=False,
              val_fn=lambda m: {"loss": np.array(2.5), "acc": np.float32(0.5)})
    mon.wait()
    assert mon.df["loss/val"].dropna().tolist() == [2.5, 2.5]
    assert mon.df["val/acc"].dropna().tolist() == [0.5, 0.5]


def test_a_refused_monitor_leaves_no_run_folder_behind(tiny, tmp_path):
    """The folder is tried (made, written, removed) as the Monitor is made, and made for
    good as its run opens: one refused meanwhile (its optimizer watched by a running
    Monitor) left an empty folder that `open_run` then called no run."""
    model, opt, batches = tiny
    first = nbwatch.Monitor(model, opt, run_dir=tmp_path / "a")
    first.start(slow_step, batches, max_steps=10_000, display=False)
    try:
        until(lambda: first.step >= 2)
        with pytest.raises(RuntimeError, match="watched by a running Monitor"):
            nbwatch.Monitor(model, opt, run_dir=tmp_path / "deep" / "b")
        assert not (tmp_path / "deep").exists()
    finally:
        first.stop()
        first.wait()


def test_a_new_optimizer_on_a_model_a_running_monitor_trains_is_refused(tiny, tmp_path):
    """A cell that makes the optimizer and the Monitor, run again while its run trains: the
    new Monitor was made and started, two threads trained one model, and the first run, of
    hours maybe, failed ("a second optimizer ... steps parameters of the monitored model")."""
    model, opt, batches = tiny
    again = torch.optim.AdamW(model.parameters(), lr=1e-3)
    later = nbwatch.Monitor(model, again, run_dir=tmp_path / "c")  # made before it trains
    first = nbwatch.Monitor(model, opt, run_dir=tmp_path / "a")
    first.start(slow_step, batches, max_steps=10_000, display=False)
    try:
        until(lambda: first.step >= 2)
        with pytest.raises(RuntimeError, match=r"weights are trained, with another optimizer, "
                           r"by a running Monitor \('a', running at step \d+\); stop\(\)"):
            nbwatch.Monitor(model, torch.optim.AdamW(model.parameters()), run_dir=tmp_path / "b")
        with pytest.raises(RuntimeError, match="weights are trained, with another optimizer"):
            later.start(slow_step, batches, max_steps=3, display=False)
        step = first.step
        until(lambda: first.step >= step + 2)
        assert first.running and first.error is None
        assert not (tmp_path / "b").exists()
    finally:
        first.stop()
        first.wait()
    later.start(slow_step, batches, max_steps=3, display=False).wait()  # once it ended
    assert later.state == "finished"


def test_a_loop_a_cell_left_open_is_said_to_be_left_open_not_training(tiny, tmp_path):
    """A cell's own loop that raised mid-loop (an error, Ctrl-C) leaves its run open; the cell
    run again, on a new optimizer over the same model, is refused: said as what it is, with
    what ends it (the refusal said it trains on and that attach(RUN_DIR).stop() stops it,
    a command no loop would ever apply)."""
    model, _, batches = tiny
    made = []

    def cell(run_dir):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        mon = nbwatch.Monitor(model, opt, run_dir=run_dir, display=False)
        made.append(mon)
        for i, b in enumerate(batches[:3]):
            own_step(mon, model, opt, b)
            if i == 1:
                raise KeyboardInterrupt  # the cell interrupted mid-loop
        return mon

    with pytest.raises(KeyboardInterrupt):
        cell(tmp_path / "a")
    first = made[0]
    try:
        assert first.running
        with pytest.raises(RuntimeError) as refused:
            cell(tmp_path / "b")
        said = str(refused.value)
        assert "left it open (the cell ended mid-loop" in said and "nothing trains it" in said
        assert "it trains on" not in said and "attach(RUN_DIR).stop()" not in said
    finally:
        first.stop()
        first.wait()  # on its loop's thread: ends its run
    assert first.state == "stopped"
    with nbwatch.Monitor(model, torch.optim.AdamW(model.parameters()), run_dir=tmp_path / "c",
                         display=False):
        pass
