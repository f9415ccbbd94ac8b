"""Each loss spike's post-mortem, read from the run store (a reopened run): seeded unstable
runs of the demo's TinyGPT made here, each read for what moved first and how long before
the loss spike; a healthy fresh run stays quiet; the pure functions on series built by
hand."""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pytest
import torch

import nbwatch
from nbwatch.alerts.postmortem import lr_change, postmortem, timeline
from nbwatch.demo import VOCAB, make_demo

QUIET: dict = {r: {"actions": []} for r in ("nonfinite", "grad_explosion", "val_spike")}
# the rules on wall time fire with the machine's load, not the model: the post-mortems
# here are about what the model did
QUIET |= {"throughput_drop": False, "data_bottleneck": False}
BAD = 120  # the corrupt batch's step


def train(tmp_path, demo, sched, data, steps, **options):
    mon = nbwatch.Monitor(demo.model, demo.optimizer, sched, run_dir=tmp_path / "r",
                          alerts=QUIET, **options)
    mon.start(demo.step_fn, data, max_steps=steps, display=False).wait()
    assert mon.state == "finished"
    return mon, nbwatch.open_run(tmp_path / "r")


def poisoned(demo, at=BAD):
    """The demo's batches; the one of step `at` with random labels (a bad shard)."""
    gen = torch.Generator().manual_seed(1)
    for i, b in enumerate(itertools.cycle(demo.train)):
        if i == at - 1:
            b = {**b, "labels": torch.randint(0, VOCAB, b["labels"].shape, generator=gen)}
        yield b


def test_a_corrupt_batch_moves_everything_at_its_own_step_and_nothing_before(tmp_path):
    """What tells a bad batch from an unstable model: no signal moved in the 20 steps before;
    at the spike step the loss, the global gradient norm and the layers' all jump; the
    post-mortem names that step's batch."""
    demo = make_demo(d=64, layers=2, heads=2, ctx=64, max_steps=400)
    mon, run = train(tmp_path, demo, demo.scheduler, poisoned(demo), BAD + 5)
    spikes = run.spikes
    assert spikes.step.tolist() == [BAD]
    row = spikes.iloc[0]
    assert row.lead == 0 and {"loss/train", "grad_norm/global"} <= set(row["first"])
    assert row.grad_rose == row.loss_rose == BAD and row.grad_z > 3
    assert row.first_layers and all(f["step"] == BAD and f["ratio"] > 3
                                    for f in row.first_layers)
    assert row.batches[-1]["index"] == BAD - 1  # the corrupt one
    assert row.lr_change["step"] < 60 and row.lr_change["to"] > row.lr_change["from"]
    assert [a["rule"] for a in row.alerts_before] == ["grad_norm_spike"]  # the same step
    assert row.alerts_before[0]["lead"] == 0
    text = str(mon.diagnose())
    assert f"loss spike at step {BAD}: nothing moved before it" in text
    assert mon.spikes.equals(spikes)
    print(timeline(row))


def test_a_rewind_past_the_spike_keeps_its_post_mortem(tmp_path):
    """The workflow the guide gives: a loss spike rewinds the run past it. The rewind
    replaces the series of the steps it goes back over, and the post-mortem then read the
    replayed steps (grad_z -1.7, no layer rose): it is made as the rewind leaves them, kept
    in the run folder, and read back as the run without the rewind has it."""
    cols = ["step", "first", "lead", "first_layers", "grad_z", "grad_rose", "loss_rose"]
    demo = make_demo(d=64, layers=2, heads=2, ctx=64, max_steps=400)
    _, plain = train(tmp_path / "plain", demo, demo.scheduler, poisoned(demo), BAD + 5)
    demo = make_demo(d=64, layers=2, heads=2, ctx=64, max_steps=400)
    rewinding = {**QUIET, "loss_spike": {"actions": ["rewind"], "rewind_steps": 20,
                                         "rewind_skip": 1}}
    mon = nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler,
                          run_dir=tmp_path / "rewound", alerts=rewinding)
    mon.start(demo.step_fn, poisoned(demo), max_steps=BAD + 5, checkpoint_every=10,
              display=False).wait()
    run = nbwatch.open_run(tmp_path / "rewound")
    assert len(run.branches) and run.step == BAD + 5  # it did go back over the spike
    got, want = run.spikes[cols], plain.spikes[cols]
    assert got.step.tolist() == [BAD] and got.iloc[0].grad_z > 3
    pd.testing.assert_frame_equal(got, want)
    assert (run.events.kind == "postmortem").sum() == 1


def test_an_lr_ramp_shows_its_ramp_and_a_rise_before_the_spike(tmp_path):
    """The LR ×1.05 a step from 3e-3, no warm-up: the post-mortem names the ramp as the
    LR's last move (from its first step, over the whole run), and something moved before
    the loss spike fired, unlike a bad batch."""
    demo = make_demo(d=64, layers=2, heads=2, ctx=64, lr=3e-3, warmup=1, max_steps=200)
    sched = torch.optim.lr_scheduler.LambdaLR(demo.optimizer, lambda s: 1.05 ** s)
    _, run = train(tmp_path, demo, sched, demo.train, 125)
    spikes = run.spikes
    assert len(spikes), run.events[run.events.kind == "alert"].message.tolist()
    row = spikes.iloc[0]
    ramp = row.lr_change
    assert ramp["step"] <= 3 and ramp["steps"] >= row.step - 5 and ramp["to"] > 20 * ramp["from"]
    assert row.lead >= 1, timeline(row)
    rose = [s for s in (row.grad_rose, row.loss_rose, row.log_z_rose)
            if s is not None and s == s]
    assert min(rose + [f["step"] for f in row.first_layers]) == row.step - row.lead
    # the training batch's log Z, every step: it rose with the ramp, by the loss spike
    # (before it on some CPUs, at its step on others: a ramp's trajectory is chaotic, so
    # float rounding moves it), and when it rose before, the per-step rule said so then
    assert row.step - 20 <= row.log_z_rose <= row.step, timeline(row)
    drift = [a for a in row.alerts_before if a["rule"] == "logz_drift"]
    if row.log_z_rose < row.step:
        assert drift and drift[0]["lead"] >= 1, row.alerts_before
    assert "log Z 3 robust SD above its median" in timeline(row)
    assert row.first_updates is None  # ratios with the histograms only: not looked at
    assert not any(f.startswith("update_ratio/") for f in row["first"])
    print(timeline(row))


def test_an_lr_ramp_with_update_ratios_every_step(tmp_path):
    """The same LR ramp, the update ratios ‖ΔW‖/‖W‖ recorded every step (`update_every=1`):
    the post-mortem looks at them (`first_updates` a list, not None). Every layer's ratio
    stood far above the 1e-2 of an LR too high in the 20 steps before the spike. Under
    AdamW (its step normalised by the gradient's own scale) the ratios follow the LR more
    than the gradient; whether one moves with the loss or after the gradient norms
    depends on the run's trajectory (the demo's data is the local standard library's
    source), so the test holds the post-mortem to its definition: `first` names the
    earliest of every signal it lists, ratios included, and `lead` counts from there."""
    demo = make_demo(d=64, layers=2, heads=2, ctx=64, lr=3e-3, warmup=1, max_steps=200)
    sched = torch.optim.lr_scheduler.LambdaLR(demo.optimizer, lambda s: 1.05 ** s)
    _, run = train(tmp_path, demo, sched, demo.train, 125, update_every=1)
    spikes = run.spikes
    assert len(spikes), run.events[run.events.kind == "alert"].message.tolist()
    row = spikes.iloc[0]
    ratios = run.df.filter(like="update_ratio/")
    window = ratios.loc[row.step - 20:row.step - 1]
    text = timeline(row)
    print(text, "\nfirst_updates:", row.first_updates)
    print("update ratios, median of steps 1-20:", ratios.loc[1:20].median().round(4).to_dict())
    print("median of the 20 steps before:", window.median().round(4).to_dict())
    print("at the spike / median before:", (ratios.loc[row.step] / window.median()).round(2)
          .to_dict())
    assert isinstance(row.first_updates, list), text
    assert window.notna().all().all() and len(ratios.columns) > 4
    assert (window.median() > 1e-2).all(), window.median()
    for f in row.first_updates:
        assert row.step - 20 <= f["step"] <= row.step and f["ratio"] > 3
        assert f"update ratio of {f['layer']}" in text
    assert row.lead >= 1 and row["first"], text
    rose = {"grad_norm/global": row.grad_rose, "loss/train": row.loss_rose,
            "train_logits/log_z": row.log_z_rose}
    moved = {k: s for k, s in rose.items() if s is not None and s == s}
    moved |= {f"grad_norm/{f['layer']}": f["step"] for f in row.first_layers}
    moved |= {f"update_ratio/{f['layer']}": f["step"] for f in row.first_updates}
    moved |= {a["rule"]: a["step"] for a in row.alerts_before if a["step"] >= row.step - 20}
    earliest = min(moved.values())
    assert row.lead == row.step - earliest, text
    # (the row lists 3 layers at most; `first` names every signal at the earliest step)
    named = [k for k in row["first"] if k in moved]
    assert named and all(moved[k] == earliest for k in named), text


def tiny_gpt2(seed=0):
    """A 2-layer GPT-2 built from a config (nothing downloaded), the demo's 128-character
    vocabulary, no dropout."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2,
                                  n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def test_a_high_lr_without_warm_up_names_the_rule_that_fired_before_the_spike(tmp_path):
    """A tiny Hugging Face GPT-2, AdamW at a constant LR of 1.0 from the first step (no
    warm-up; weight decay 0.1 on every parameter, LayerNorms' included): the loss blows up
    in the first 50 steps, settles near 3, and spikes again after step 100. The
    post-mortem names a first signal, no LR move (the LR never changed), and a health rule
    that fired steps before: `weight_collapse` on a LayerNorm's weights (seeds 0, 1, 2:
    spikes at 120, 138, 135 on one machine, at 153, 144, 150 on another, one thread each:
    the trajectory is chaotic, float rounding moves the spike; that rule at 100 in each).
    `loss_spike` looks at 60 steps, not
    200: over 200 its noise is the no-warm-up's first 50 steps (losses of 20-60), so the
    later spike is no 6-SD news there."""
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1.0, weight_decay=0.1, betas=(0.9, 0.95))
    demo = make_demo(d=64, layers=2, heads=2, ctx=64, max_steps=400)

    def step_fn(m, b):
        return {"logits": m(b["input_ids"]).logits, "labels": b["labels"], "mask": b["mask"]}

    mon = nbwatch.Monitor(model, opt, None, run_dir=tmp_path / "r",
                          alerts={**QUIET, "loss_spike": {"window": 60}})
    mon.start(step_fn, demo.train, max_steps=200, display=False).wait()
    assert mon.state == "finished"
    run = nbwatch.open_run(tmp_path / "r")
    spikes = run.spikes
    assert len(spikes), run.events[run.events.kind == "alert"].message.tolist()
    row = spikes.iloc[0]
    assert row.step > 60 and row.lr_change is None, timeline(row)
    assert row.lead >= 0 and row["first"], timeline(row)
    collapse = [a for a in row.alerts_before if a["rule"] == "weight_collapse"]
    assert collapse and collapse[0]["lead"] >= 1, row.alerts_before
    assert "weight_collapse fired" in timeline(row)
    assert f"loss spike at step {row.step}" in str(mon.diagnose())
    print(timeline(row))


def test_a_healthy_fresh_run_has_no_spike_and_a_zero_score(tmp_path):
    """300 steps of warm-up and cosine: no alert about the model, the per-step log Z
    rule's included, while the training batch's log Z climbs slowly (the healthy replay's
    fixture predates that series)."""
    demo = make_demo(d=64, layers=2, heads=2, ctx=64, max_steps=400)
    mon, run = train(tmp_path, demo, demo.scheduler, demo.train, 300)
    assert run.spikes.empty and (run.df["spike/score"] == 0).all()
    assert "loss spike" not in str(mon.diagnose())
    # throughput_drop watches the machine, not the model: a loaded CI runner trips it
    fired = {a["rule"] for a in run.events[run.events.kind == "alert"].data}
    assert fired <= {"throughput_drop"}, fired
    log_z = run.df["train_logits/log_z"]
    assert log_z.notna().all() and log_z.iloc[-20:].median() > log_z.iloc[:20].median()


def series(values, start=1):
    return pd.Series(values, index=pd.RangeIndex(start, start + len(values)), dtype=float)


def test_the_layer_that_rose_first_and_the_lr_cut_from_series_by_hand():
    """A layer whose gradient norm climbs from 10 steps before the spike, one that jumps
    only at it, one whose noise swings 4× (no news), an LR cut 30 steps before, an alert
    at 95."""
    rng = np.random.default_rng(0)
    n, spike = 200, 180
    calm = 1.0 + 0.05 * rng.standard_normal(n)
    climbing = calm.copy()
    climbing[spike - 10 - 1:] *= np.geomspace(4, 40, n - spike + 11)
    jumping = calm.copy()
    jumping[spike - 1] *= 10
    noisy = np.exp(rng.normal(0, 0.9, n))  # a LayerNorm's: 4× swings are its noise
    lr = np.where(np.arange(1, n + 1) < spike - 30, 1e-3, 5e-4)
    frame = pd.DataFrame({"grad_norm/a": series(climbing), "grad_norm/b": series(jumping),
                          "grad_norm/ln": series(noisy), "lr": series(lr),
                          "loss/train": series(2.0 + 0.01 * rng.standard_normal(n))})
    events = pd.DataFrame({"step": [95, spike], "kind": ["alert", "alert"],
                           "data": [{"rule": "grad_norm_spike"}, {"rule": "loss_spike"}]})
    pm = postmortem(frame, events, spike)
    assert [f["layer"] for f in pm["first_layers"]] == ["a", "b"]
    assert pm["first_layers"][0]["step"] == spike - 10 and pm["first"] == ["grad_norm/a"]
    assert pm["lead"] == 10
    assert pm["lr_change"] == {"step": spike - 30, "steps": 1, "from": 1e-3, "to": 5e-4}
    assert pm["alerts_before"] == [{"rule": "grad_norm_spike", "step": 95, "lead": 85}]
    assert lr_change(series([1.0, 1.0, 1.0]), 3) is None
    assert pm["first_updates"] is None  # no update ratios recorded


def hand_frame(n=200, spike=180, every=1):
    """A layer whose gradient norm climbs from 5 steps before the spike; the update ratio
    of another climbing from 10 before, recorded every `every` steps."""
    rng = np.random.default_rng(1)
    grad = 1.0 + 0.05 * rng.standard_normal(n)
    grad[spike - 5 - 1:] *= np.geomspace(4, 40, n - spike + 6)
    upd = 1e-3 * (1.0 + 0.05 * rng.standard_normal(n))
    upd[spike - 10 - 1:] *= np.geomspace(4, 40, n - spike + 11)
    steps = np.arange(1, n + 1)
    upd = np.where((steps == 1) | (steps % every == 0), upd, np.nan)
    return pd.DataFrame({"grad_norm/a": series(grad), "update_ratio/b": series(upd),
                         "loss/train": series(2.0 + 0.01 * rng.standard_normal(n))})


NO_EVENTS = pd.DataFrame({"step": [180], "kind": ["alert"], "data": [{"rule": "loss_spike"}]})


def test_dense_update_ratios_can_move_first():
    """Every step: the update ratio that rose 10 steps before the spike moved first, ahead
    of the gradient norm (5 before); the timeline says so."""
    pm = postmortem(hand_frame(), NO_EVENTS, 180)
    assert pm["first_updates"] == [{"layer": "b", "step": 170, "ratio": pytest.approx(4, rel=0.2)}]
    assert pm["first"] == ["update_ratio/b"] and pm["lead"] == 10
    assert [f["layer"] for f in pm["first_layers"]] == ["a"]
    row = {"step": 180, "loss": 3.0, "median": 2.0, "z": 8.0, "batches": [], **pm}
    assert "-10  step 170: update ratio of b 4." in timeline(row)
    assert "update_ratio/b moved first, 10 steps before" in timeline(row)


def test_sparse_update_ratios_leave_the_post_mortem_as_it_was():
    """Ratios every 50 steps (with the histograms), or every 2: not looked at; the
    post-mortem is the one made without the ratios at all, `first_updates` None."""
    without = postmortem(hand_frame().drop(columns="update_ratio/b"), NO_EVENTS, 180)
    assert without["first"] == ["grad_norm/a"] and without["lead"] == 5
    for every in (50, 10, 2):
        pm = postmortem(hand_frame(every=every), NO_EVENTS, 180)
        assert pm == without, every
        assert pm["first_updates"] is None


def test_post_mortems_of_many_spikes_read_together_equal_each_read_alone(tmp_path):
    """A converged run's thousands of spikes took 15-25 ms each, one store read each and
    a scan of every event: `spikes_of` now reads spikes near each other at once, and the
    alerts once. Its rows equal those made one spike at a time (spikes 10 steps apart,
    and one far away; an alert before each)."""
    from nbwatch.alerts.postmortem import _SPAN, spikes_of
    from nbwatch.records import Event, Scalars
    from nbwatch.store import RunReader, RunStore

    rng = np.random.default_rng(0)
    at = [400, 410, 420, 2000]
    store = RunStore(tmp_path / "r")
    for s in range(1, 2101):
        jump = 8.0 if s in at else 1.0
        store.put(Scalars(s, {"loss/train": (2 + 0.05 * rng.standard_normal()) * jump,
                              "grad_norm/global": (1 + 0.1 * rng.standard_normal()) * (
                                  3.0 if s + 2 in at else jump),
                              "grad_norm/blocks.0": 0.5 + 0.05 * rng.standard_normal(),
                              "lr": 1e-3 if s < 1000 else 5e-4}))
    for s in at:
        store.put(Event(s - 2, "alert", "warning", "grad_norm_spike", {"rule": "grad_norm_spike"}))
        store.put(Event(s, "alert", "warning", "loss_spike",
                        {"rule": "loss_spike", "loss": 16.0, "median": 2.0, "z": 9.0}))
    store.close()
    reader = RunReader(tmp_path / "r")
    events, keys = reader.events(), reader.keys()
    together = spikes_of(events, lambda k, a, b: reader.scalars(k, a, b), keys)
    assert together.step.tolist() == at
    for s in at:
        alone = spikes_of(events, lambda k, a, b: reader.scalars(k, a, b), keys, [s]).iloc[0]
        row = together[together.step == s].iloc[0]
        for col in together.columns:
            assert str(row[col]) == str(alone[col]), (s, col)
        assert row.alerts_before == [{"rule": "grad_norm_spike", "step": s - 2, "lead": 2}]
    assert _SPAN < 1600  # the far spike is read on its own
