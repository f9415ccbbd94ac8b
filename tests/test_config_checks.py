"""Bad settings and inputs are refused where they are given (`Monitor(...)`, `mon.log()`),
with an error that names the setting, what it accepts and the fix; never deep in the
training thread, or silently."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import nbwatch
from nbwatch.alerts import AlertEngine, configure, default_rules
from nbwatch.demo import TinyGPT
from nbwatch.probes.data import bad_mask, batch_figures, mask_stats

from .conftest import make_batches, until


def setup():
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, ctx=32)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), make_batches(n=8)


def train_step(model, opt, b):
    """One step of a loop of the user's own, up to (not including) mon.log()."""
    loss = nbwatch.masked_cross_entropy(model(b["input_ids"]), b["labels"], b["mask"])
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


# -- alert settings: one schema per rule, checked at Monitor(...) ---------------------------
BAD_ALERTS = [
    # (alerts, error, what the message must say: the rule, the key, the allowed values)
    ({"val_spike": {"lr_factor": -1}}, ValueError,
     r"alerts\['val_spike'\]\['lr_factor'\] must be a number in \(0, 1\], got -1"),
    ({"val_spike": {"lr_factor": 2}}, ValueError, r"'lr_factor'\] must be a number in \(0, 1\]"),
    ({"grad_explosion": {"factor": "20"}}, TypeError,
     r"alerts\['grad_explosion'\]\['factor'\] must be a number ≥ 1, got '20' \(a str\)"),
    ({"grad_explosion": {"factor": True}}, TypeError, r"'factor'\] must be a number.*a bool"),
    ({"plateau": {"every": 0}}, ValueError, r"alerts\['plateau'\]\['every'\] must be an int ≥ 1"),
    ({"nonfinite": {"severity": "high"}}, ValueError,
     r"alerts\['nonfinite'\]\['severity'\] must be one of 'info', 'warning', 'critical', "
     r"got 'high'"),
    ({"loss_spike": {"actions": ["rewind"], "rewind_steps": "ten"}}, TypeError,
     r"alerts\['loss_spike'\]\['rewind_steps'\] must be an int ≥ 1, got 'ten'"),
    ({"loss_spike": {"actions": ["rewind"], "rewind_skip": -5}}, ValueError,
     r"'rewind_skip'\] must be an int ≥ 0"),
    ({"nonfinite": {"keys": []}}, ValueError, r"'keys'\] must be a list of figure names.*False"),
    ({"nonfinite": {"keys": [1]}}, TypeError, r"'keys'\] must be a list of figure names"),
    ({"padding": {"ratio": math.nan}}, ValueError, r"alerts\['padding'\]\['ratio'\] must be a "
                                                  r"number in \[0, 1\)"),
    ({"grad_explosion": {"max_norm": math.inf}}, ValueError, r"'max_norm'\] must be a number > 0"),
    ({"plateau": {"window": 2.5}}, TypeError, r"'window'\] must be an int in \[3, 5000\]"),
    ({"plateau": {"window": 10**6}}, ValueError, r"'window'\] must be an int in \[3, 5000\]"),
    ({"grad_explosion": {"window": 10}}, ValueError,
     r"'window'\] \(10\) is below its 'min_history' \(20\)"),
    ({"plateau": 3}, TypeError, r"alerts\['plateau'\] must be False \(off\), True"),
    ({"plateau": {"actions": "reboot"}}, ValueError, r"unknown action.*'reboot'"),
    ({"loss_spike": {"lr_factor": 0.5}}, KeyError, r"'lr_factor'.*with the cut_lr action"),
    ("all", TypeError, r"alerts must be a dict or None, got 'all'"),
    (["plateau"], TypeError, r"alerts must be a dict or None"),
]


@pytest.mark.parametrize(("alerts", "error", "says"), BAD_ALERTS,
                         ids=[str(a)[:40] for a, _, _ in BAD_ALERTS])
def test_a_bad_alert_setting_fails_monitor_naming_rule_key_and_allowed_values(
        tmp_path, alerts, error, says):
    model, opt, _ = setup()
    with pytest.raises(error, match=says) as e:
        nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", alerts=alerts, display=False)
    assert "e.g." in str(e.value) or error is KeyError  # the fix: a value that is accepted
    assert not (tmp_path / "r").exists()  # refused before anything opens


def test_on_alert_must_be_callable(tmp_path):
    model, opt, _ = setup()
    with pytest.raises(TypeError, match=r"on_alert must be a function.*got 'print'"):
        nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", on_alert="print", display=False)


def test_good_settings_are_taken_as_given_or_normalised(tmp_path):
    model, opt, _ = setup()
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False, on_alert=print,
                          alerts={"nonfinite": {"keys": "loss/train"},  # one name: a list of it
                                  "grad_explosion": {"absolute": math.inf, "factor": 20},
                                  "loss_spike": {"actions": ["cut_lr"], "lr_factor": 0.25},
                                  "plateau": {"window": 2000, "every": 50}})
    rules = {r.name: r for r in mon.rules}
    assert rules["nonfinite"].params["keys"] == ("loss/train",)
    assert rules["grad_explosion"].params["factor"] == 20.0
    assert rules["loss_spike"].params["lr_factor"] == 0.25
    assert rules["plateau"].params["window"] == 2000 and rules["plateau"].every == 50


def test_a_look_back_longer_than_the_default_window_still_fires():
    """plateau over 1500 steps: the engine keeps as many values as a rule looks back."""
    eng = AlertEngine(configure(default_rules(), {"plateau": {"window": 1500}}))
    fired = []
    for s in range(1, 1701):
        fired += eng.observe("step", s, {"loss/train": 2.0 + 0.01 * (s % 5)})
    steps = [a.step for a in fired if a.rule.name == "plateau"]
    assert steps and steps[0] >= 1500


# -- Monitor's own settings -----------------------------------------------------------------
@pytest.mark.parametrize(("kw", "error", "says"), [
    ({"keep_last": "3"}, TypeError, r"keep_last must be an int ≥ 1.*got '3'"),
    ({"keep_last": 1.5}, TypeError, r"keep_last must be an int ≥ 1.*got 1.5"),
    ({"keep_last": True}, TypeError, r"keep_last must be an int"),
    ({"keep_last": 0}, ValueError, r"keep_last must be an int ≥ 1.*got 0"),
    ({"system_interval": "1"}, TypeError, r"system_interval must be at least 0.1 s"),
    ({"system_interval": math.nan}, ValueError, r"system_interval must be .* got nan"),
    ({"system_interval": math.inf}, ValueError, r"system_interval must be .* got inf"),
    ({"system_interval": 0.01}, ValueError, r"system_interval must be at least 0.1 s.*got 0.01"),
    ({"system_interval": None}, TypeError, r"system_interval must be"),
])
def test_bad_monitor_settings_are_refused(tmp_path, kw, error, says):
    model, opt, _ = setup()
    with pytest.raises(error, match=says):
        nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False, **kw)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(("kw", "error", "says"), [
    ({"hist_every": "50"}, ValueError, r"hist_every must be an int ≥ 0 \(0: no histograms\)"),
    ({"hist_every": 2.5}, ValueError, r"hist_every must be an int ≥ 0.*got 2.5"),
    ({"log_every": "10"}, ValueError, r"log_every must be an int ≥ 0"),
    ({"attention_tokens": 0}, ValueError, r"attention_tokens must be an int ≥ 1, got 0"),
    ({"rank_every": 0}, ValueError, r"rank_every must be an int ≥ 1, got 0"),
    ({"dist_timeout": "60"}, ValueError, r"dist_timeout must be seconds"),
    ({"display": "no"}, TypeError, r"display must be True, False or None"),
    ({"probe_fn": 3}, TypeError, r"probe_fn must be callable"),
])
def test_bad_options_are_refused_at_the_call_not_in_the_training_thread(tmp_path, kw, error,
                                                                        says):
    """Given to start() (or Monitor(...)), a bad option is refused at once; it failed the
    run later in the training thread ('>' not supported between 'str' and 'int'), or was
    taken silently (rank_every=0: a division by zero under torchrun)."""
    model, opt, batches = setup()
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False)
    step = lambda m, b: m(b["input_ids"]).mean()  # noqa: E731
    with pytest.raises(error, match=says):
        mon.start(step, batches, max_steps=3, **{"display": False, **kw})
    with pytest.raises(error, match=says):
        nbwatch.Monitor(model, opt, run_dir=tmp_path / "q", **{"display": False, **kw})
    mon.start(step, batches, max_steps=3, display=False).wait()
    assert mon.state == "finished"


@pytest.mark.parametrize(("kw", "says"), [
    ({"eval_every": 0}, r"eval_every must be a positive int or None, got 0; None .* without a "
                        r"val_fn there is no eval"),
    ({"checkpoint_every": 0}, r"checkpoint_every .* got 0; None .* no periodic checkpoint"),
    ({"eval_every": 2.5}, r"eval_every must be a positive int or None, got 2.5"),
])
def test_every_0_to_turn_a_thing_off_says_what_none_does(tmp_path, kw, says):
    """A newcomer's `eval_every=0` (off, as in other tools) is refused with what None does
    and how evals are turned off; the Monitor starts as asked after it."""
    model, opt, batches = setup()
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False)
    step = lambda m, b: m(b["input_ids"]).mean()  # noqa: E731
    with pytest.raises(ValueError, match=says):
        mon.start(step, batches, max_steps=3, display=False, **kw)
    mon.start(step, batches, max_steps=3, display=False).wait()
    assert mon.state == "finished" and mon.step == 3


def test_a_config_too_deep_or_holding_itself_is_refused_clearly(tmp_path):
    model, opt, _ = setup()
    deep: dict = {}
    node = deep
    for _ in range(5000):
        node["a"] = {}
        node = node["a"]
    with pytest.raises(ValueError, match="config is nested more than 64 levels deep; flatten"):
        nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", config=deep, display=False)
    loop: dict = {"lr": 1e-3}
    loop["self"] = loop
    with pytest.raises(ValueError, match="config cannot be stored as JSON.*Circular"):
        nbwatch.Monitor(model, opt, run_dir=tmp_path / "s", config=loop, display=False)
    ok: dict = {"lr": 1e-3}
    node = ok
    for _ in range(30):  # deep, but within bounds, shared sub-dicts too
        node["sub"] = {"list": [1, [2, {"x": 3}]]}
        node = node["sub"]
    ok["again"] = ok["sub"]
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "t", config=ok, display=False)
    assert mon.config["lr"] == 1e-3


# -- what mon.log() is given ----------------------------------------------------------------
def test_log_refuses_bad_values_at_the_call_and_the_step_is_kept(tmp_path):
    model, opt, batches = setup()
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False)
    b = batches[0]
    with mon:
        loss = train_step(model, opt, b)
        with pytest.raises(TypeError, match=r"loss is a complex tensor.*real"):
            mon.log(loss=torch.tensor(1 + 2j))
        with pytest.raises(TypeError, match=r"loss is a complex .*real number"):
            mon.log(loss=1 + 2j)
        with pytest.raises(TypeError, match=r"val is a str \('x'\); pass the val loss"):
            mon.log(loss=loss, val="x")
        with pytest.raises(ValueError, match=r"val has shape \(3,\), not one value"):
            mon.log(loss=loss, val=torch.ones(3))
        with pytest.raises(TypeError, match=r"val\['acc'\] is a str"):
            mon.log(loss=loss, val={"loss": 2.0, "acc": "high"})
        with pytest.raises(ValueError, match="val is an empty dict"):
            mon.log(loss=loss, val={})
        beside_ones = torch.tensor([[1.0, -1.0] * 4] * 4)  # not additive: it has 1s
        for mask, shown in ((torch.full((4, 8), 2), "2"), (beside_ones, "-1"),
                            (torch.full((4, 8), 0.5), "0.5")):
            with pytest.raises(ValueError, match=rf"mask holds {shown} besides 0 and 1"):
                mon.log(loss=loss, mask=mask)
        with pytest.raises(TypeError, match="mask is a complex tensor"):
            mon.log(loss=loss, mask=torch.ones(4, 8, dtype=torch.complex64))
        assert mon.log(loss=loss, mask=b["mask"].bool(), val=torch.tensor(2.5)) == 1
        for s, batch in enumerate(batches[1:5], start=2):
            loss = train_step(model, opt, batch)
            mask = batch["mask"].clone()
            if s in (3, 4):
                mask[0, :2] = 3  # after the first step: read with the record, not refused
            assert mon.log(loss=loss, mask=mask) == s
    df, ev = mon.df, mon.events
    assert list(df.index) == [1, 2, 3, 4, 5]
    assert df.loc[1, "loss/val"] == 2.5 and df["loss/train"].notna().all()
    good = df.drop(index=[3, 4])
    assert ((good["data/padding_ratio"] >= 0) & (good["data/padding_ratio"] < 1)).all()
    assert (good["throughput/tokens_per_s"].drop(index=1) > 0).all()  # step 1: no time
    assert df.loc[[3, 4], ["data/padding_ratio", "tokens/real"]].isna().all().all()
    said = ev[ev.message.str.contains("entries other than 0 and 1")]  # once a run
    assert len(said) == 1 and said.step.iloc[0] == 3 and said.severity.iloc[0] == "warning"
    assert said.message.iloc[0].startswith("the step's mask holds 2 entries")


@pytest.mark.parametrize("dtype", [torch.long, torch.bfloat16])
def test_a_step_fn_mask_that_turns_bad_later_leaves_its_figures_out(tmp_path, dtype):
    """start(): a mask read with the record (after the first step) that holds other values
    than 0 and 1 leaves that step's data figures out, said once; the run goes on (a
    bfloat16 mask too, which numpy cannot read: its copy is float32)."""
    model, opt, batches = setup()
    seen = []

    def step(m, b):
        seen.append(1)
        mask = b["mask"].to(dtype)
        mask = mask * 2 if len(seen) == 4 else mask
        return {"logits": m(b["input_ids"]), "labels": b["labels"], "mask": mask}

    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False)
    mon.start(step, batches, max_steps=6, display=False).wait()
    assert mon.state == "finished", mon.error
    df, ev = mon.df, mon.events
    assert df.loc[4, ["data/padding_ratio", "tokens/real"]].isna().all()
    assert df.drop(index=4)["data/padding_ratio"].between(0, 1).all()
    assert df["train_logits/log_z"].notna().all()  # the logits' figures are not the mask's
    said = ev[ev.message.str.contains("entries other than 0 and 1")]
    assert len(said) == 1 and said.step.iloc[0] == 4


def test_a_step_fn_mask_that_is_not_0_1_fails_the_run_naming_the_mask(tmp_path):
    model, opt, batches = setup()

    def step(m, b):
        return {"logits": m(b["input_ids"]), "labels": b["labels"], "mask": b["mask"] * 2}

    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False)
    mon.start(step, batches, max_steps=3, display=False)
    with pytest.raises(ValueError, match="mask holds 2 besides 0 and 1"):
        mon.wait()
    assert mon.state == "failed"


def test_a_gpu_mask_counts_its_bad_entries_and_its_figures_are_dropped():
    """A GPU mask is checked without a sync of its own: its bad entries are counted with the
    step's other figures (here computed on the CPU), and the host drops what it gave."""
    mask = torch.tensor([[1, 1, 0], [2, 1, -1]])
    figs = mask_stats(mask, count_bad=True)
    values = {"loss/train": 1.0, "tokens/real": float(figs["tokens"]), "_padded": 6.0,
              "data/seq_len_mean": 1.0, "data/seq_len_max": 2.0,
              "_mask_bad": float(figs["_mask_bad"])}
    said = bad_mask(values)
    assert said is not None and "2 entries other than 0 and 1" in said
    assert values == {"loss/train": 1.0}
    good = {"tokens/real": 3.0, "_mask_bad": 0.0}
    assert bad_mask(good) is None and good == {"tokens/real": 3.0}
    mf = batch_figures([torch.ones(2, 3, dtype=torch.long)])  # CPU: checked on the host
    assert "_mask_bad" not in mf.names and mf.host["tokens/real"] == 6.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_bad_gpu_mask_fails_the_first_log_and_is_said_later(tmp_path):
    model, opt, batches = setup()
    model.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = [{k: v.cuda() for k, v in b.items()} for b in batches]
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False)
    with mon:
        loss = train_step(model, opt, batches[0])
        with pytest.raises(ValueError, match="mask holds 2 besides 0 and 1"):
            mon.log(loss=loss, mask=batches[0]["mask"] * 2)  # the first step: checked, once
        mon.log(loss=loss, mask=batches[0]["mask"])
        for i, b in enumerate(batches[1:6], start=2):
            loss = train_step(model, opt, b)
            mon.log(loss=loss, mask=b["mask"] * 2 if i == 4 else b["mask"])  # counted only
    df, ev = mon.df, mon.events
    assert math.isnan(df.loc[4, "data/padding_ratio"]) and df["loss/train"].notna().all()
    assert df.drop(index=4)["data/padding_ratio"].between(0, 1).all()
    said = ev[ev.message.str.contains("entries other than 0 and 1")]
    assert len(said) == 1 and said.step.iloc[0] == 4 and said.severity.iloc[0] == "warning"


# -- a NaN loss the loop reports after its optimizer step -----------------------------------
def test_a_nan_loss_with_finite_gradients_in_an_own_loop_raises_nonfinite(tmp_path):
    model, opt, batches = setup()
    # keys given as one string (was: never fired); no pause, so the loop runs on here
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False,
                          alerts={"nonfinite": {"keys": "loss/train", "actions": []}})
    with mon:
        for s, b in enumerate(batches[:6], start=1):
            loss = train_step(model, opt, b)  # finite gradients
            mon.log(loss=math.nan if s in (3, 5) else loss)
    ev = mon.events
    alerts = ev[(ev.kind == "alert") & ev.message.str.startswith("nonfinite")]
    assert list(alerts.step) == [3, 5]
    assert alerts.message.str.contains("after the optimizer step").all()
    assert alerts.message.str.contains("the step was applied").all()
    assert mon.state == "finished"


def test_the_default_nonfinite_rule_pauses_an_own_loop_on_a_nan_loss(tmp_path):
    model, opt, batches = setup()
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False)

    def train():
        for s, b in enumerate(batches, start=1):
            loss = train_step(model, opt, b)
            mon.log(loss=torch.tensor(math.nan) if s == 2 else loss)

    mon.run(train)
    until(lambda: mon.state == "paused", what="the pause of the nonfinite alert")
    ev = mon.events
    fired = ev[(ev.kind == "alert") & ev.message.str.startswith("nonfinite")]
    assert list(fired.step) == [2] and fired.severity.iloc[0] == "critical"
    mon.resume()
    mon.wait()
    assert mon.state == "finished" and mon.step == len(batches)
    assert ev.message.str.contains("emergency").any() or (mon.events.kind == "checkpoint").any()


def test_numbers_from_a_config_numpy_ints_and_floats_are_taken_as_python_ones(tmp_path):
    """Counts read from a YAML/NumPy config are numpy scalars: `max_steps=np.int64(6)` was
    refused ('must be a positive int'), and a numpy count kept as given broke the run's
    meta (not JSON). Each is taken as the int or float it stands for."""
    np = pytest.importorskip("numpy")
    model, opt, batches = setup()
    cfg = {"max_steps": np.int64(6), "eval_every": np.int64(3),
           "checkpoint_every": np.int32(3), "hist_every": np.int64(2),
           "update_every": np.int64(2), "log_every": np.uint8(2),
           "dist_timeout": np.float64(30.0), "clip": np.float32(1.0)}
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False)
    step = lambda m, b: m(b["input_ids"]).mean()  # noqa: E731
    mon.start(step, batches, val_fn=lambda m: 1.0, display=False, **cfg).wait()
    assert mon.state == "finished" and mon.step == 6
    opts = nbwatch.open_run(tmp_path / "r").meta["run"]["options"]
    assert opts["hist_every"] == 2 and type(opts["hist_every"]) is int
    assert opts["max_steps"] == 6 and type(opts["max_steps"]) is int  # start()'s, not None
    assert type(opts["dist_timeout"]) is float
    ev = mon.events
    assert set(ev[ev.kind == "checkpoint"].step) >= {3, 6}
    from nbwatch.controls import _rewind
    assert _rewind(np.int64(2), np.int64(0)) == {"steps": 2, "skip": 0}
    mon2 = nbwatch.Monitor(model, opt, run_dir=tmp_path / "q", display=False,
                           max_steps=np.int64(4), keep_last=np.int64(2))
    with mon2:
        for b in batches[:4]:
            mon2.log(loss=train_step(model, opt, b))
    assert nbwatch.open_run(tmp_path / "q").meta["run"]["options"]["max_steps"] == 4


def test_a_config_as_training_scripts_hold_it_is_stored_as_plain_values(tmp_path):
    """`config=args` (argparse), a dataclass, or a Hugging Face style object with to_dict():
    they were refused ('config must be a dict'); numpy values in them were stored as the
    strings '12' and 'True', which compare() then diffed as text."""
    import argparse
    import dataclasses

    np = pytest.importorskip("numpy")

    @dataclasses.dataclass
    class Train:
        lr: float = 3e-4
        layers: int = 12

    class HFStyle:
        def to_dict(self):
            return {"n_layer": np.int64(12), "tie": np.bool_(True)}

    args = argparse.Namespace(lr=np.float64(1e-3), layers=np.int64(12), amp=np.bool_(True),
                              betas=(0.9, 0.95), warmup=torch.tensor(100))
    expected = [{"lr": 1e-3, "layers": 12, "amp": True, "betas": [0.9, 0.95], "warmup": 100},
                {"lr": 3e-4, "layers": 12}, {"n_layer": 12, "tie": True}]
    for i, (config, want) in enumerate(zip([args, Train(), HFStyle()], expected)):
        model, opt, batches = setup()
        mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / str(i), config=config,
                              display=False)
        mon.start(lambda m, b: m(b["input_ids"]).mean(), batches, max_steps=2,
                  display=False).wait()
        stored = nbwatch.open_run(tmp_path / str(i)).meta["config"]
        assert stored == want and [type(v) for v in stored.values()] == [
            type(v) for v in want.values()]
    with pytest.raises(TypeError, match=r"config must be a dict \(or an argparse Namespace, "
                                        r"a dataclass.*got int"):
        nbwatch.Monitor(*setup()[:2], run_dir=tmp_path / "x", config=3)


def test_log_takes_host_scalars_as_it_takes_tensors(tmp_path):
    """A bool tensor was taken as 0/1 while `True`, `np.bool_` and a numpy 0-d array were
    refused; an int past float's range was a bare OverflowError. The host forms are taken
    as the tensors are, and the too-large int is refused naming the keyword."""
    model, opt, batches = setup()
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False)
    with mon:
        loss = train_step(model, opt, batches[0])
        with pytest.raises(ValueError, match=r"huge= is 1000.*too large for a float"):
            mon.log(loss=loss, huge=10**400)
        with pytest.raises(ValueError, match=r"arr= has shape \(2,\), not one value"):
            mon.log(loss=loss, arr=np.ones(2))
        with pytest.raises(ValueError, match=r"loss is a meta tensor"):
            mon.log(loss=torch.tensor(1.0, device="meta"))
        mon.log(loss=loss, flag=True, npflag=np.bool_(False), zero_d=np.array(2.5),
                t=torch.tensor(True))
    df = mon.df
    assert df.loc[1, "train/flag"] == 1.0 and df.loc[1, "train/npflag"] == 0.0
    assert df.loc[1, "train/zero_d"] == 2.5 and df.loc[1, "train/t"] == 1.0


def test_start_refuses_an_optimizer_that_needs_a_closure(tmp_path):
    """LBFGS's step needs a closure, which `start()` does not pass: refused before the run
    opens, with the way that works (a loop of your own), not torch's 'missing closure' at
    step 1."""
    model, _, batches = setup()
    opt = torch.optim.LBFGS(model.parameters())
    mon = nbwatch.Monitor(model, opt, run_dir=tmp_path / "r", display=False)
    with pytest.raises(TypeError, match=r"without a closure, which LBFGS.step needs.*own"):
        mon.start(lambda m, b: m(b["input_ids"]).mean(), batches, max_steps=3)
    assert not (tmp_path / "r" / "nbwatch.db").exists()


def test_a_run_dir_that_is_a_link_to_a_folder_not_made_yet_is_made_there(tmp_path):
    """`runs/exp1 -> /scratch/exp1` before /scratch/exp1 exists: the run is written where the
    link leads (it was refused as "not writable (File exists)")."""
    model, opt, batches = setup()
    link = tmp_path / "exp1"
    link.symlink_to(tmp_path / "scratch" / "exp1")
    mon = nbwatch.Monitor(model, opt, run_dir=link, display=False)
    with mon:
        train_step(model, opt, batches[0])
        mon.log(loss=1.0)
    assert (tmp_path / "scratch" / "exp1" / "nbwatch.db").is_file() and link.is_symlink()
    assert nbwatch.open_run(link).step == 1
