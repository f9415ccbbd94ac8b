"""The spike score (OLMo-core's StabilityMonitor definition): the O(1) running figures
agree with the definition computed directly, on a recorded real run; the count follows its
10,000-step window; the spike rules feed it and their alerts carry it; a real run records
it as a series."""

from pathlib import Path

import numpy as np
import pytest

from nbwatch.alerts import AlertEngine, default_rules
from nbwatch.alerts.spike_score import Rolling, SpikeScore, olmo_spikes

REPLAY = Path(__file__).parent / "data" / "healthy_demo.npz"


def replay_rows():
    d = np.load(REPLAY)
    cols = list(d["columns"])
    for step, row in zip(d["steps"].tolist(), d["scalars"]):
        yield step, {c: float(v) for c, v in zip(cols, row) if not np.isnan(v)}


def test_rolling_mean_and_sd_stay_exact_over_a_long_stream_of_large_values():
    """Running sums over a ring (O(1) a value) against numpy over the window, with values
    near 1e6 whose spread is 1e-3: where plain sums of squares lose every digit."""
    rng = np.random.default_rng(0)
    x = 1e6 + 1e-3 * rng.standard_normal(20_000)
    r = Rolling(128)
    for i, v in enumerate(x.tolist()):
        r.add(v)
        if i in (127, 500, 19_999):
            mean, std = r.mean_std()
            assert mean == pytest.approx(x[i - 127:i + 1].mean(), rel=1e-12)
            assert std == pytest.approx(x[i - 127:i + 1].std(), rel=1e-6)
    assert len(r.ring) == 128  # bounded


def test_the_score_on_a_recorded_healthy_run_is_olmo_cores_count():
    """The recorded 5,000-step healthy run: the live score flags exactly the steps the
    direct computation does; its loss never spikes; its heavy-tailed gradient norm does a
    few times (0.1% of steps by this definition: what a healthy run scores)."""
    score = SpikeScore()
    loss, grad, flagged = [], [], {"spike/loss": [], "spike/grad_norm": []}
    for step, v in replay_rows():
        out = score.observe(v)
        loss.append(v["loss/train"])
        grad.append(v["grad_norm/global"])
        for k in flagged:
            if k in out:
                flagged[k].append(step - 1)
    assert flagged["spike/loss"] == olmo_spikes(loss) == []
    assert flagged["spike/grad_norm"] == olmo_spikes(grad)
    assert out["spike/score"] == len(olmo_spikes(grad)) <= 0.002 * len(grad)


def test_the_count_forgets_spikes_older_than_its_window():
    rng = np.random.default_rng(1)
    score = SpikeScore(window=16, score_window=50)
    counts = []
    for i in range(200):
        g = 100.0 if i in (40, 60) else 1.0 + 0.01 * rng.standard_normal()
        counts.append(score.observe({"grad_norm/global": g})["spike/score"])
    assert counts[39] == 0 and counts[40] == 1 and counts[60] == 2
    assert counts[89] == 2 and counts[90] == 1  # step 40 left the last 50
    assert counts[110] == 0


def test_before_a_full_window_and_on_non_finite_values_nothing_spikes():
    score = SpikeScore(window=8)
    for i in range(8):  # 8 values: not yet a full history before each
        assert score.observe({"loss/train": 1.0 + 0.01 * i})["spike/score"] == 0
    assert score.observe({"loss/train": float("nan")}) == {"spike/score": 0.0}
    out = score.observe({"loss/train": 50.0})
    assert out["spike/loss"] > 6 and out["spike/score"] == 1  # the NaN never joined
    assert score.mark() == 1  # already counted: a rule firing too does not count it twice


def test_spike_rules_feed_the_score_and_their_alerts_carry_it():
    """The recorded healthy run with the loss 2.3× and the grad norm 6× at step 60 (before
    128 steps: OLMo-core's test cannot see it yet) and 2500: both rules fire, each such
    step counts once, and the alert says the score."""
    eng = AlertEngine([r for r in default_rules()
                       if r.name in ("loss_spike", "grad_norm_spike")])
    alerts, scores = [], {}
    for step, v in replay_rows():
        if step in (60, 2500):
            v["loss/train"] *= 2.3
            v["grad_norm/global"] *= 6.0
        alerts += eng.observe("step", step, v)
        scores[step] = v["spike/score"]
    assert [(a.rule.name, a.step) for a in alerts] == [
        ("loss_spike", 60), ("grad_norm_spike", 60),
        ("loss_spike", 2500), ("grad_norm_spike", 2500)]
    assert scores[59] == 0 and scores[60] == 1  # one step, counted once
    assert scores[2500] == scores[2499] + 1
    late = alerts[2]
    assert late.data["spike_score"] == scores[2500] and late.data["sigma"] > 6
    assert "spike score" in late.message
    assert "sigma" not in alerts[0].data  # 60 values: no 128-value history yet
