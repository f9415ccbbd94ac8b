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
