"""Rewind after a bad batch (PaLM's remedy): the run reloads an earlier checkpoint, skips the
bad batch and the ones after it, goes on to the end, and keeps the rewound-over steps as a
branch; where nbwatch does not run the loop, the control refuses and says why."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

import nbwatch
from nbwatch.checkpoint import load
from nbwatch.demo import make_demo
from nbwatch.panels import Feed
from nbwatch.recorder import host_copy
from nbwatch.store import RunReader
from tests.test_export import Page

BAD = 150  # the data position of the poisoned batch (0-based: step 151 takes it)


def test_rewind_past_a_bad_batch_restores_skips_and_keeps_the_branch(tmp_path):
    demo = make_demo(d=64, layers=2, heads=2, ctx=64, max_steps=220)
    data = [dict(b, pos=i) for i, b in enumerate(itertools.islice(itertools.cycle(demo.train),
                                                                  400))]
    mon = nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler, run_dir=tmp_path / "r",
                          keep_last=5)
    seen: list[int] = []
    restored: list[bool] = []

    def step(model, batch):
        pos = int(batch["pos"])
        if seen and seen[-1] == BAD:  # the first step after the rewind: the weights of 100
            ref = load(mon.run_dir / "checkpoints" / "step_00000100.pt")["model"]
            restored.append(all(torch.equal(v, ref[k]) for k, v in model.state_dict().items()))
        seen.append(pos)
        out = demo.step_fn(model, batch)
        if pos == BAD:  # garbage labels: the loss spikes; the user (or a rule) rewinds
            out["labels"] = torch.randint(0, 90, out["labels"].shape)
            mon.rewind(steps=40, skip=20)
        return out

    mon.start(step, data, max_steps=220, checkpoint_every=50, display=False)
    mon.wait()
    assert mon.state == "finished" and mon.step == 220, mon.traceback
    # the weights went back to step 100's; the bad batch and the 20 after it never came back
    assert restored == [True]
    i = seen.index(BAD)
    assert seen[i + 1] == BAD + 1 + 20 and seen.count(BAD) == 1
    ev = mon.events
    rw = ev[[(d or {}).get("command") == "rewind" for d in ev.data]]
    assert len(rw) == 1 and rw.step.iloc[0] == 151
    assert rw.data.iloc[0]["to"] == 100 and rw.data.iloc[0]["branch"] == 1
    # the live line: every step once, 101–151 trained again on later batches
    df = mon.df
    assert df["loss/train"].notna().sum() == 220 and df.index.max() == 220
    # the branch: the steps rewound over, with the spike in it
    assert not any(c.startswith("rewind/") for c in df.columns)
    branch = mon.branches["rewind/1/loss/train"].dropna()
    assert list(branch.index) == list(range(101, 152))
    assert branch.loc[151] > 2 * branch.loc[140]
    assert df.loc[151, "loss/train"] < branch.loc[151] / 2  # the live step 151 is healthy
    # the dashboard and the export draw it: the loss panel's faded branch
    feed = Feed(RunReader(mon.run_dir))
    while True:
        feed.update()
        if not feed.more:
            break
    b = feed.full()["loss"]["branches"]["1"]
    assert int(b["x"][0]) == 101 and int(b["x"][-1]) == 151


def test_an_own_loop_is_told_where_the_rewind_went(tmp_path):
    """In a loop of the user's own, the rewind restores model, optimizer and scheduler at
    the next `log`, which returns the checkpoint's step; `mon.rewound` says how many
    batches the loop should skip."""
    demo = make_demo(d=32, layers=1, heads=2, ctx=32, max_steps=60)
    mon = nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler, run_dir=tmp_path / "a",
                          checkpoint_every=10)
    batches = itertools.cycle(demo.train)
    told, after = [], None
    step = 0
    while step < 60:
        out = demo.step_fn(demo.model, next(batches))
        loss = nbwatch.masked_cross_entropy(out["logits"], out["labels"], out["mask"])
        loss.backward()
        demo.optimizer.step()
        demo.scheduler.step()
        demo.optimizer.zero_grad()
        if step == 34 and not told:
            mon.rewind(steps=12, skip=7)  # applied at the next log: after step 35
        step = mon.log(loss=loss)
        if mon.rewound is not None:
            told.append(mon.rewound)
            for _ in range(mon.rewound.skip):
                next(batches)
            ref = load(mon.run_dir / "checkpoints" / "step_00000020.pt")
            after = all(torch.equal(v, ref["model"][k])
                        for k, v in demo.model.state_dict().items())
            lr = demo.optimizer.param_groups[0]["lr"]
            assert demo.scheduler.last_epoch == ref["scheduler"]["last_epoch"]
    mon.close()
    assert told == [(20, 7)] and after and lr > 0
    df = mon.df
    assert df.index.max() == 60 and df["loss/train"].notna().sum() == 60
    assert list(mon.branches["rewind/1/loss/train"].dropna().index) == list(range(21, 36))
    # the events of the steps it went back over are on branch 1; their checkpoint (step
    # 30) is set aside there, beside the kept line's own step 30
    ev = mon.events
    at30 = ev[(ev.kind == "checkpoint") & (ev.step == 30)]
    assert at30["branch"].tolist() == [1, 0]
    assert ev[ev.step <= 20]["branch"].eq(0).all() and ev[ev.step > 35]["branch"].eq(0).all()
    page = Page(mon.export_html(tmp_path / "a.html").read_text(encoding="utf-8"))
    rows = json.loads(page.scripts["nbw-state"])["report"]["checkpoints"]["rows"]
    assert [r[6] for r in rows if r[0] == 30] == ["rotated out", "set aside (rewind 1)"]


def test_rewind_is_refused_where_it_cannot_be_honoured(tmp_path):
    demo = make_demo(d=32, layers=1, heads=2, ctx=32, max_steps=40)
    mon = nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler, run_dir=tmp_path / "b")
    asked = []

    def step(model, batch):
        if not asked and mon.step == 20:
            asked.append(1)
            mon.rewind(steps=15)  # applied after step 21: no checkpoint at or before 6
        return demo.step_fn(model, batch)

    mon.start(step, demo.train, max_steps=40, checkpoint_every=10, display=False).wait()
    ev = mon.events
    refused = ev[ev.message.str.startswith("rewind refused")]
    assert len(refused) == 1 and ("no checkpoint 15 steps back from step 21, at or before step 6"
                                  in refused.message.iloc[0])
    assert mon.state == "finished" and mon.step == 40
    with pytest.raises(ValueError, match="steps must be an int"):
        nbwatch.Monitor.rewind(mon, steps=0)


def test_a_rule_can_rewind(tmp_path):
    """`loss_spike` with the rewind action: the bad batch's spike rewinds the run by itself."""
    demo = make_demo(d=64, layers=2, heads=2, ctx=64, max_steps=200)
    data = [dict(b, pos=i) for i, b in enumerate(itertools.islice(itertools.cycle(demo.train),
                                                                  400))]
    mon = nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler, run_dir=tmp_path / "r",
                          keep_last=5, alerts={"loss_spike": {
                              "actions": ["rewind"], "rewind_steps": 40, "rewind_skip": 20}})
    seen: list[int] = []

    def step(model, batch):
        seen.append(int(batch["pos"]))
        out = demo.step_fn(model, batch)
        if seen[-1] == BAD:
            out["labels"] = torch.randint(0, 90, out["labels"].shape)
        return out

    mon.start(step, data, max_steps=200, checkpoint_every=50, display=False).wait()
    assert mon.state == "finished" and mon.step == 200, mon.traceback
    ev = mon.events
    assert list(ev[ev.message.str.startswith("loss_spike")].step) == [151]
    rw = ev[[(d or {}).get("command") == "rewind" for d in ev.data]]
    assert len(rw) == 1 and rw.data.iloc[0]["source"] == "alert:loss_spike"
    # in a GPU's order the alert acts a step late: step 152 trains on the next batch first
    late = 1 if host_copy.DEFER_ON_CPU else 0
    i = seen.index(BAD)
    assert seen[i + 1:i + 2 + late] == [*range(BAD + 1, BAD + 1 + late), BAD + 1 + late + 20]
    assert seen.count(BAD) == 1


@pytest.mark.parametrize("defer", [False, True])
def test_a_rewind_leaves_the_steps_it_went_back_over_out_of_the_length_histogram(
        tmp_path, monkeypatch, defer):
    """Rewound from step 55 to 50 (a histogram step): the next `data/seq_len` histogram
    counts the sequences of steps 51–60 of the branch that goes on, not those of the 5
    steps rewound over; in either order of a step's copy (tests/test_deferred_steps.py)."""
    monkeypatch.setattr(host_copy, "DEFER_ON_CPU", defer)
    demo = make_demo(d=32, layers=2, heads=2, ctx=32, batch_size=4)
    data = [dict(b, pos=i) for i, b in
            enumerate(itertools.islice(itertools.cycle(demo.train), 100))]
    mon = nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler, run_dir=tmp_path / "r")

    def step(model, batch):
        if int(batch["pos"]) == 54:  # step 55's batch: the rewind is taken after it
            mon.rewind(steps=5, skip=0)
        return demo.step_fn(model, batch)

    mon.start(step, data, max_steps=70, checkpoint_every=10, hist_every=10,
              display=False).wait()
    assert mon.state == "finished", mon.error
    steps, _, counts = nbwatch.open_run(tmp_path / "r").histograms("data/seq_len")
    assert {int(s): int(c.sum()) for s, c in zip(steps, counts)} == {
        1: 4, 10: 36, **{s: 40 for s in range(20, 71, 10)}}  # 4 sequences a step


def test_a_rewind_keeps_the_steering_in_force_and_its_branch_ends_with_a_checkpoint(
        tmp_path):
    """An LR cut and a clip asked with a rewind hold after it (the checkpoint's own did
    not); a stop at a step whose checkpoint the rewind set aside writes the stop's, so that
    resume=True continues from there, not from the checkpoint rewound to. The run's step is
    the live line's 8, not the 10 its branch reached."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(64, 4)
    with nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False) as mon:
        step, i = 0, 0
        while True:
            model(data[i % 64:i % 64 + 4]).square().mean().backward()
            opt.step()
            opt.zero_grad()
            i += 1
            if step + 1 in (3, 8) and i == step + 1:
                mon.checkpoint()  # taken at this log(), first branch only
            if i == 10:
                mon.scale_lr(0.5)
                mon.set_clip(0.25)
                mon.rewind(steps=7, skip=0)  # after step 10: back to step 3
            if i == 15:  # step 8 of the branch that goes on
                mon.stop()
            step = mon.log(loss=torch.tensor(1.0))
    run = nbwatch.open_run(tmp_path / "r")
    assert run.state == "stopped" and run.step == 8
    df, ev = run.df, run.events
    assert df.loc[4:8, "lr"].tolist() == [0.05] * 5  # the cut, on the branch that goes on
    assert (df.loc[4:8, "grad_norm/clipped"] <= 0.25 + 1e-6).all()
    assert ev.message.str.contains("LR ×0.5 and clip 0.25 kept").any()
    assert ev[ev.kind == "checkpoint"].message.str.startswith("stop checkpoint at step 8").any()
    again = nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", resume=True, display=False)
    assert again.step == 8 and again.control.lr_factor == 0.5 and again.control.clip == 0.25


def test_a_stop_right_after_a_rewind_resumes_past_the_batches_it_skipped(tmp_path):
    """Rewind and stop pressed together (start()): the run stops at the checkpoint it went
    back to. resume=True then trained again on the batches the rewind left behind and
    skipped (the spike's, in practice): that checkpoint said where the data stood when it
    was first written, and the stop wrote none of its own."""
    demo = make_demo(d=32, layers=1, heads=2, ctx=32, max_steps=60)
    data = [dict(b, pos=i) for i, b in enumerate(itertools.islice(itertools.cycle(demo.train),
                                                                  200))]
    mon = nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler, run_dir=tmp_path / "r")
    seen: list[int] = []

    def step(model, batch):
        seen.append(int(batch["pos"]))
        if seen[-1] == 25 and len(seen) == 26:  # step 26: back to step 20, skip 5, stop
            mon.rewind(steps=6, skip=5)
            mon.stop()
        return demo.step_fn(model, batch)

    mon.start(step, data, max_steps=60, checkpoint_every=10, display=False).wait()
    assert mon.state == "stopped" and mon.step == 20, mon.traceback
    seen.clear()
    mon.start(step, data, max_steps=60, resume=True, display=False).wait()
    assert mon.state == "finished" and mon.step == 60, mon.traceback
    assert seen[0] == 26 + 5  # batches 0–25 trained before, 26–30 skipped
    assert len(seen) == 40 and seen == list(range(31, 71))
