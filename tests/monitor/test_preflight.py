"""The preflight checks as a pure function of a trial's frame and events."""

import numpy as np
import pandas as pd

from nbwatch.monitor.preflight import evaluate


def frame(loss, grad=1.0, lr=None, pad=0.2):
    n = len(loss)
    return pd.DataFrame({
        "loss/train": loss, "grad_norm/global": np.full(n, grad),
        "lr": lr if lr is not None else np.full(n, 1e-3), "time/step": np.full(n, 0.05),
        "time/data": np.full(n, 0.001), "data/padding_ratio": np.full(n, pad),
        "throughput/tokens_per_s": np.full(n, 1e4),
    }, index=pd.RangeIndex(1, n + 1, name="step"))


NO_EVENTS = pd.DataFrame(columns=["step", "kind", "severity", "message"])


def by_name(checks):
    return {c.name: c for c in checks}


def test_a_falling_loss_passes_every_check():
    checks = by_name(evaluate(frame(np.linspace(4, 2, 100)), NO_EVENTS, False, 1.5))
    assert {c.status for c in checks.values()} == {"pass"}
    assert checks["loss falls"].reason == "3.808 → 2.192 (-42.4%)"  # first vs last fifth
    assert checks["peak memory"].reason == "1.50 GB"


def test_flat_rising_and_nonfinite_losses_fail_with_a_reason():
    flat = by_name(evaluate(frame(np.full(100, 3.0)), NO_EVENTS, False, None))
    assert flat["loss falls"].status == "fail" and "loss flat" in flat["loss falls"].reason
    rising = by_name(evaluate(frame(np.linspace(2, 5, 100)), NO_EVENTS, False, None))
    assert "LR is likely too high" in rising["loss falls"].reason
    nan = by_name(evaluate(frame([3.0] * 10 + [np.nan] * 5), NO_EVENTS, False, None))
    assert nan["loss falls"].reason.startswith("loss became non-finite at step 11")


def test_zero_gradients_a_frozen_schedule_padding_and_alerts():
    events = pd.DataFrame([{"step": 5, "kind": "alert", "severity": "warning",
                            "message": "padding: 70% of the tokens are padding"}])
    checks = by_name(evaluate(frame(np.linspace(4, 2, 50), grad=0.0, pad=0.7), events, True,
                              None))
    assert checks["grad norm"].status == "fail"
    assert checks["LR schedule"].status == "warn"  # a scheduler that never moved the LR
    assert checks["padding"].status == "warn"
    assert checks["no alert"].status == "warn" and "padding" in checks["no alert"].reason
