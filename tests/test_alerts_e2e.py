"""Alerts end to end on the demo model: NaN, LR spike, sorted validation, preflight."""

import itertools
import math

import pytest
import torch

import nbwatch
from nbwatch.demo import collate, make_demo, make_samples, masked_cross_entropy, stdlib_text
from nbwatch.recorder import host_copy
from tests.conftest import until


def small_demo(**kw):
    return make_demo(d=64, layers=2, heads=2, ctx=64, **kw)


def wait_state(mon, state, timeout=60):
    until(lambda: mon.state in (state, "failed"), timeout, f"the run to be {state}")
    assert mon.state == state, mon.traceback


@pytest.mark.parametrize("kind,fused,gpu_order", [
    ("adamw", False, False), ("adamw", True, True), ("adamw", False, True),
    ("rmsprop", False, True)])
def test_nan_step_is_skipped_and_the_run_pauses_with_one_critical_alert(
        tmp_path, monkeypatch, kind, fused, gpu_order):
    """On a CPU the step is read at once and skipped exactly. In a GPU's order (decided on
    the device, read a step later: the pause holds after step 31) a fused optimizer skips
    the NaN step in its own kernel (nbwatch's `found_inf`): the weights are those from
    before it; any other gets the step's gradients zeroed on the device: the weights stay
    finite, and the alert says what happened (and that fused=True skips exactly, where
    the optimizer has it: RMSprop has not)."""
    monkeypatch.setattr(host_copy, "DEFER_ON_CPU", gpu_order)
    late = 1 if gpu_order else 0
    demo = small_demo(max_steps=100)
    opt = (torch.optim.AdamW(demo.model.parameters(), lr=1e-3, fused=fused) if kind == "adamw"
           else torch.optim.RMSprop(demo.model.parameters(), lr=1e-4))
    mon = nbwatch.Monitor(demo.model, opt, run_dir=tmp_path / "r")
    calls = {"n": 0}

    def step(model, batch):
        calls["n"] += 1
        out = demo.step_fn(model, batch)
        if calls["n"] == 30:
            out["logits"] = out["logits"] * math.nan  # poison step 30
        return out

    before = {}

    def remember(model, batch):  # weights just before the poisoned step
        if calls["n"] == 29:
            before.update({k: v.clone() for k, v in model.state_dict().items()})
        return step(model, batch)

    mon.start(remember, demo.train, max_steps=100, display=False)
    wait_state(mon, "paused")
    assert mon.step == 30 + late
    for k, v in demo.model.state_dict().items():
        assert torch.isfinite(v).all(), k
    ev = mon.events
    alerts = ev[ev.kind == "alert"]
    critical = alerts[alerts.severity == "critical"]
    assert len(critical) == 1 and critical.step.iloc[0] == 30
    assert critical.message.iloc[0].startswith("nonfinite: non-finite loss/train")
    assert ("zeroed" in critical.message.iloc[0]) == (gpu_order and not fused)
    assert ("fused=True" in critical.message.iloc[0]) == (gpu_order and kind == "adamw"
                                                          and not fused)
    assert mon.df.loc[30, "skipped"] == 1.0
    ck = ev[(ev.kind == "checkpoint") & (ev.step == 30 + late)].iloc[0]
    saved = torch.load(ck.data["path"], weights_only=True)["model"]
    assert all(torch.isfinite(v).all() for v in saved.values() if v.is_floating_point())
    if not late:  # the emergency checkpoint holds the last good weights: before step 30
        assert all(torch.equal(saved[k], before[k]) for k in ("head.weight", "tok_emb.weight"))
    mon.resume()
    wait_state(mon, "finished")
    mon.wait()
    assert mon.step == 100 and math.isfinite(mon.df["loss/train"].iloc[-1])


def spiked_run(tmp_path, alerts):
    demo = small_demo(max_steps=400)
    opt = torch.optim.SGD(demo.model.parameters(), lr=0.05, momentum=0.9)
    mon = nbwatch.Monitor(demo.model, opt, run_dir=tmp_path / str(bool(alerts)), alerts=alerts)
    calls = {"n": 0}

    def step(model, batch):
        calls["n"] += 1
        if calls["n"] == 150:  # steps 151-153 at 1000× the LR (applied between steps)
            mon.scale_lr(1000.0)
        if calls["n"] == 153:
            mon.scale_lr(0.001)
        return demo.step_fn(model, batch)

    mon.start(step, demo.train, max_steps=400, display=False)
    until(lambda: not mon.running or mon.state == "paused", 120, "the run to end or pause")
    if mon.state == "paused":
        mon.stop()
    mon.wait()
    return mon


def test_lr_spike_explosion_rule_clips_and_the_run_recovers(tmp_path):
    mon = spiked_run(tmp_path, None)
    df, ev = mon.df, mon.events
    assert mon.state == "finished"
    explosion = ev[ev.message.str.startswith("grad_explosion")]
    # the spike is caught while it happens; how many more times the rule fires on the way
    # back depends on the machine's float trajectory, so only the first is pinned
    assert len(explosion) >= 1 and 150 < explosion.step.iloc[0] <= 153
    clip = ev[(ev.kind == "action") & ev.message.str.contains("alert grad_explosion")]
    assert not clip.empty and (clip.step >= explosion.step.iloc[0]).all()
    assert clip.data.iloc[0]["value"] == 1.0
    at = explosion.step.iloc[0]
    assert (df.loc[at:, "grad_norm/clipped"] <= 1.0 + 1e-4).all()
    pre = df.loc[130:150, "loss/train"].mean()
    peak = df.loc[150:, "loss/train"].max()
    end = df["loss/train"].iloc[-20:].mean()
    print(f"pre-spike loss {pre:.3f}, peak {peak:.1f}, last 20 steps {end:.3f}")
    # back within 2% of the spike's excursion, and well below where it stood after it (how
    # it falls in between is the machine's float trajectory, and the order's: a GPU's
    # clips a step later)
    assert math.isfinite(end) and end < pre + 0.02 * (peak - pre)
    assert end < 0.5 * df.loc[at:at + 50, "loss/train"].mean()
    # the same spike without the rule diverges: that is what the rule bought
    bare = spiked_run(tmp_path, {"grad_explosion": False})
    assert not math.isfinite(bare.df["loss/train"].iloc[-1]) or (
        bare.events.message.str.startswith("nonfinite").any())


def test_length_sorted_validation_is_named_as_the_cause_of_val_swings(tmp_path):
    demo = small_demo(max_steps=150)
    val_lines = stdlib_text()[-3000:]
    samples = make_samples(val_lines, 64, seed=5)
    # four batches of increasing length, served in a fixed order: short → long → short …
    batches = [collate([s for s in samples if lo <= len(s) < lo + 10][:16])
               for lo in (10, 25, 40, 55)]
    evals = itertools.count()

    def val_fn(model):  # the seeds' bug: each eval takes the next batch of a fixed order
        b = batches[next(evals) % 4]
        loss = masked_cross_entropy(model(b["input_ids"]), b["labels"], b["mask"])
        return {"loss": float(loss), "seq_len_mean": float(b["mask"].sum(1).float().mean())}

    mon = nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler, run_dir=tmp_path / "r")
    mon.start(demo.step_fn, demo.train, max_steps=150, val_fn=val_fn, eval_every=5,
              display=False).wait()
    alerts = mon.events.query("kind == 'alert'")
    periodic = alerts[alerts.message.str.startswith("val_periodic")]
    assert len(periodic) == 1, mon.df[["loss/val", "val/seq_len_mean"]].dropna()
    assert "validation order is fixed" in periodic.message.iloc[0]
    findings = {f.name: f for f in mon.diagnose()}
    assert findings["val_periodic"].cause and findings["val_periodic"].details["period"] == 4


def test_preflight_passes_on_the_demo_and_restores_the_model(tmp_path):
    demo = small_demo(max_steps=1000)
    mon = nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler, run_dir=tmp_path / "r")
    before = {k: v.clone() for k, v in demo.model.state_dict().items()}
    lr_before = demo.optimizer.param_groups[0]["lr"]
    result = mon.preflight(demo.step_fn, demo.train, steps=80)
    assert result.ok, result
    assert result["loss falls"].status == "pass" and result["grad norm"].status == "pass"
    assert result["LR schedule"].status == "pass"
    assert all(torch.equal(v, before[k]) for k, v in demo.model.state_dict().items())
    assert demo.optimizer.param_groups[0]["lr"] == lr_before and not demo.optimizer.state
    assert demo.scheduler.last_epoch == 0
    assert "preflight passed" in result._repr_html_()
    assert not list((tmp_path / "r").glob("*"))  # the trial wrote nothing into run_dir


class Zeroed(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, idx):
        return self.inner(idx) * 0.0


def test_preflight_fails_on_zero_gradients_and_on_lr_10(tmp_path):
    demo = small_demo()
    model = Zeroed(demo.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    result = nbwatch.Monitor(model, opt, run_dir=tmp_path / "z").preflight(
        demo.step_fn, demo.train, steps=30)
    assert not result.ok
    assert result["grad norm"].status == "fail"
    assert "all gradients are zero" in result["grad norm"].reason

    demo = small_demo()
    opt = torch.optim.SGD(demo.model.parameters(), lr=10.0)
    result = nbwatch.Monitor(demo.model, opt, run_dir=tmp_path / "lr").preflight(
        demo.step_fn, demo.train, steps=60)
    assert not result.ok
    assert result["loss falls"].status == "fail"
    assert "LR" in result["loss falls"].reason or "non-finite" in result["loss falls"].reason


def test_on_alert_callback_and_log_records_at_the_alert_level(tmp_path, caplog):
    import logging

    demo = small_demo(max_steps=40)
    seen = []

    def poison(model, batch):
        out = demo.step_fn(model, batch)
        if poison.calls == 10:
            out["logits"] = out["logits"] * math.nan
        poison.calls += 1
        return out

    poison.calls = 0

    def broken_callback(ev):
        seen.append(ev)
        raise ValueError("a user's callback bug must not stop the run")

    mon = nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler, run_dir=tmp_path / "r",
                          alerts={"nonfinite": {"actions": ["skip_step"]}},
                          on_alert=broken_callback)
    with caplog.at_level(logging.INFO, logger="nbwatch"):
        mon.start(poison, demo.train, max_steps=40, display=False).wait()
    assert mon.state == "finished"  # no pause: the override kept only skip_step
    critical = [e for e in seen if e.severity == "critical"]
    assert len(critical) == 1 and critical[0].step == 11 and critical[0].kind == "alert"
    records = [r for r in caplog.records if r.getMessage().startswith("nonfinite")]
    assert [r.levelno for r in records] == [logging.CRITICAL]
    assert any("on_alert callback failed" in r.getMessage() for r in caplog.records)


def lr_alerts(mon):
    ev = mon.events
    return ev[(ev.kind == "alert") & ev.message.str.startswith("lr_change")]


def test_lr_change_is_quiet_for_the_schedule_and_controls_and_reports_a_hand_set_lr(tmp_path):
    """The demo's warm-up (LR ×100 over 100 steps) and a Cut LR click are planned changes; an
    own loop that sets the LR by hand, with no scheduler to explain it, is reported once."""
    demo = small_demo(max_steps=120)
    mon = nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler, run_dir=tmp_path / "a")
    mon.start(max_steps=120, eval_every=100, display=False, **demo.start_kwargs())
    until(lambda: mon.step >= 60, 60, "step 60")
    mon.scale_lr(0.1)
    mon.wait()
    lrs = mon.df["lr"]
    assert lrs.iloc[5] / lrs.iloc[0] > 2 and lrs.iloc[-1] / lrs.iloc[58] < 0.5  # it moved
    assert lr_alerts(mon).empty, list(lr_alerts(mon).message)

    model = small_demo().model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    own = nbwatch.Monitor(model, opt, run_dir=tmp_path / "b")
    batches = itertools.cycle(demo.train)
    for step in range(1, 41):
        if step == 20:
            for g in opt.param_groups:
                g["lr"] = 1e-2  # by hand, no scheduler
        b = next(batches)
        loss = masked_cross_entropy(model(b["input_ids"]), b["labels"], b["mask"])
        loss.backward()
        opt.step()
        opt.zero_grad()
        own.log(loss=loss)
    own.close()
    fired = lr_alerts(own)
    assert list(fired.step) == [20], list(fired.message)
    assert "not by the scheduler or a control" in fired.message.iloc[0]


def test_wait_called_from_on_alert_is_refused_not_a_deadlock(tmp_path):
    """`mon.wait()` inside `on_alert` runs on the training thread: it would wait for itself.
    It raises at once, the callback's failure is an event the dashboard shows, and the run
    goes on to finish (it used to hang, then read `stale`)."""
    demo = small_demo(max_steps=20)
    errors = []

    def poison(model, batch):
        out = demo.step_fn(model, batch)
        if poison.calls == 5:
            out["logits"] = out["logits"] * math.nan
        poison.calls += 1
        return out

    poison.calls = 0

    def waits(ev):
        try:
            mon.wait()
        except RuntimeError as e:
            errors.append(str(e))
            raise

    mon = nbwatch.Monitor(demo.model, demo.optimizer, demo.scheduler, run_dir=tmp_path / "r",
                          alerts={"nonfinite": {"actions": ["skip_step"]}}, on_alert=waits)
    mon.start(poison, demo.train, max_steps=20, display=False).wait(timeout=120)
    assert mon.state == "finished"
    assert errors and "training thread" in errors[0] and "mon.stop()" in errors[0], errors
    said = mon.events[mon.events.kind == "callback"].message.tolist()
    assert said and "on_alert callback failed for nonfinite" in said[0], said


def test_lora_warming_up_is_no_vanishing_gradient(tmp_path):
    """PEFT's LoRA on a Llama config, a slow warm-up (1e-4 over 500 steps): the A matrices'
    gradients are B's, which starts at zero, so they start ~1e4× below the other layers and
    climb as B grows. vanishing_gradients fired at step 20 ("lora_A ... over 1000× below the
    median layer's for 20 steps"): a layer that climbs is not vanishing. One that stays down
    still fires (tests/test_alerts.py)."""
    peft = pytest.importorskip("peft")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=200,
                      max_position_embeddings=64)
    model = peft.get_peft_model(LlamaForCausalLM(cfg), peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 500))
    fired: list[str] = []
    with nbwatch.Monitor(model, opt, sched, run_dir=tmp_path / "r", display=False,
                         on_alert=lambda ev: fired.append(ev.message)) as mon:
        for _ in range(100):
            x = torch.randint(0, 200, (8, 32))
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            mon.log(loss=loss)
    df = nbwatch.open_run(tmp_path / "r").df
    a = df[[c for c in df.columns if c.startswith("grad_norm/") and "lora_A" in c]]
    others = df[[c for c in df.columns if c.startswith("grad_norm/") and "lora_B" in c]]
    # the case itself: A's gradients far below B's at first, then climbing
    assert (a.iloc[2:20].max(axis=1) < 1e-3 * others.iloc[2:20].median(axis=1)).all()
    assert (a.iloc[-5:].mean() > 10 * a.iloc[5:10].mean()).all()
    assert fired == []
