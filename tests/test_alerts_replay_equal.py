"""The alert engine fires exactly what it fired before its per-step work was cut (issue 23).

tests/data/alert_reference.json was recorded by tests/data/record_alert_reference.py with
main's engine before the change: every alert (rule, step, message, data) on the healthy
fixture and on a perturbed copy of it (spikes, NaNs, a throughput drop, a vanishing layer,
... and custom rules reading the Window every 3 and 7 steps), the spike figures the engine
added, and a digest of every series the window kept.
"""

import importlib.util
import json
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def replayed():
    spec = importlib.util.spec_from_file_location("record_alert_reference",
                                                  DATA / "record_alert_reference.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return json.loads((DATA / "alert_reference.json").read_text()), mod.reference()


@pytest.mark.parametrize("run", ["healthy", "perturbed"])
@pytest.mark.parametrize("part", ["alerts", "spike_steps", "final_score", "window",
                                  "window_latest", "window_adds"])
def test_replay_equals_the_reference(replayed, run, part):
    ref, now = replayed
    assert now[run][part] == ref[run][part]


def test_the_perturbed_run_fires_most_rules(replayed):
    ref, _ = replayed
    fired = {a[0] for a in ref["perturbed"]["alerts"]}
    assert {"nonfinite", "grad_explosion", "loss_spike", "grad_norm_spike",
            "vanishing_gradients", "throughput_drop", "data_bottleneck", "padding", "plateau",
            "lr_change", "logz_drift", "val_spike", "nonfinite_val", "weight_collapse",
            "attention_collapse", "custom_median", "custom_mad", "custom_detrended",
            "custom_series"} <= fired
    assert ref["healthy"]["alerts"] == []


def test_schedule_gives_the_rules_due_in_order():
    """The rules due at a step, by the table (lcm of the `every`s small) or by which
    `every`s divide the step (lcm large), are those with step % every == 0, in order."""
    from nbwatch.alerts import Rule, Schedule

    def quiet(w, p):
        return None

    for everys in ([1, 10, 1, 100, 7, 3], [9973, 1, 10007, 2], [1, 1], [5]):
        rules = [Rule(f"r{i}", "info", "step", quiet, every=e) for i, e in enumerate(everys)]
        sched = Schedule(rules)
        assert (sched.period == 0) == (everys[0] == 9973)
        for step in [*range(-30, 2200), 9973 * 10007, 9973 * 5, 10007 * 4, 10**12]:
            assert list(sched.at(step)) == [r for r in rules if not step % r.every]


def test_window_add_keeps_every_number_as_before():
    """The one-pass add (the same figures as the last step, all floats) and the per-figure
    one give the same series: ints and bools as floats, float subclasses converted, other
    values not recorded, figures that come and go."""
    import itertools
    from collections import deque

    import numpy as np

    from nbwatch.alerts.rules import Window

    def reference(steps, size):
        series = {}
        for values in steps:
            for k, v in values.items():
                if isinstance(v, (int, float)):
                    series.setdefault(k, deque(maxlen=size)).append(float(v))
        return series

    kinds = [1.5, 2, True, np.float64(0.25), np.float32(3.0), "x", None, float("nan")]
    steps = []
    for i in range(300):
        values = {"a": float(i), "b": i * 0.5}
        if i % 7 < 4:
            values["c"] = kinds[(i // 7) % len(kinds)]
        if i % 50 >= 25:
            values = dict(itertools.islice(reversed(values.items()), None))  # another order
        steps.append(values)
    w = Window(64)
    for values in steps:
        w.add(values)
    ref = reference(steps, 64)
    assert set(w.series) == set(ref)
    for k in ref:
        got, want = list(w.series[k]), list(ref[k])
        assert [type(v) for v in got] == [float] * len(want)
        assert np.array_equal(got, want, equal_nan=True), k
    assert w.adds == 300 and w.latest is steps[-1]
