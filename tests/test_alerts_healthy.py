"""Replay a recorded, real 5,000-step demo run through every rule: it must stay quiet.

The fixture (tests/data/healthy_demo.npz, made by tests/data/record_healthy.py) holds the
run's per-step scalars, each layer's weight std at each histogram step, and the attention
maps of every fourth eval.
"""

from pathlib import Path

import numpy as np
import pytest

from nbwatch.alerts import AlertEngine, default_rules

FIXTURE = Path(__file__).parent / "data" / "healthy_demo.npz"


@pytest.fixture(scope="module")
def replayed():
    d = np.load(FIXTURE)
    cols = list(d["columns"])
    eng = AlertEngine(default_rules())
    hist = {int(s): i for i, s in enumerate(d["hist_steps"])}
    att = {int(s): i for i, s in enumerate(d["attention_steps"])}
    layers, modules = list(d["hist_layers"]), list(d["attention_modules"])
    fired = []
    for step, row in zip(d["steps"].tolist(), d["scalars"]):
        values = {c: float(v) for c, v in zip(cols, row) if not np.isnan(v)}
        val = {k: values.pop(k) for k in ("loss/val", "loss/gap", "time/eval") if k in values}
        fired += eng.observe("grads", step, values)
        eng.explain_lr()  # the demo's scheduler steps every step: the recorder says so
        fired += eng.observe("step", step, values)
        if step in hist:
            stds = dict(zip(layers, d["weight_std"][hist[step]].tolist()))
            fired += eng.observe("hist", step, weight_std=stds)
        if val:
            fired += eng.observe("eval", step, val)
        if step in att:
            maps = {m: d["attention"][att[step], j] / 255.0 for j, m in enumerate(modules)}
            fired += eng.observe("attention", step, attention=maps)
    return d, fired


def test_fixture_is_a_real_5000_step_run(replayed):
    d, _ = replayed
    cols = list(d["columns"])
    loss = d["scalars"][:, cols.index("loss/train")]
    assert len(d["steps"]) == 5000 and loss[-100:].mean() < loss[:100].mean() - 1.5


@pytest.mark.parametrize("rule", [r.name for r in default_rules()])
def test_rule_is_quiet_on_the_healthy_run(replayed, rule):
    """Every rule, info-level ones included: the warm-up and the cosine's halvings are the
    scheduler's plan, not news."""
    _, fired = replayed
    assert [a.message for a in fired if a.rule.name == rule] == []


def test_the_same_lr_unexplained_fires_at_a_jump_only(replayed):
    """Without the scheduler's word (a schedule the loop writes itself), the same run's
    warm-up and cosine are quiet; an LR set by hand to a quarter fires there, once."""
    d, _ = replayed
    lr = d["scalars"][:, list(d["columns"]).index("lr")]
    steps = d["steps"].tolist()
    for cut in (None, steps[len(steps) // 2]):
        eng = AlertEngine(default_rules())
        fired = [a.step for step, v in zip(steps, lr.tolist())
                 for a in eng.observe("step", step, {"lr": v / 4 if cut and step >= cut else v})
                 if a.rule.name == "lr_change"]
        assert fired == ([] if cut is None else [cut])
