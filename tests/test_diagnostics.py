import numpy as np
import pandas as pd

from nbwatch.alerts.diagnostics import autocorrelation, step_time_breakdown, val_periodicity


def sorted_val_stream(n_evals=40, period=4, seed=0):
    """Val loss of a fixed, length-sorted val order: each eval sees the next batch."""
    rng = np.random.default_rng(seed)
    lengths = np.array([20.0, 45.0, 80.0, 120.0])[np.arange(n_evals) % period]
    trend = 2.5 * np.exp(-np.arange(n_evals) / 30) + 1.0
    return trend - 0.004 * lengths + 0.01 * rng.standard_normal(n_evals), lengths


def test_val_periodicity_names_the_fixed_order_of_long_batches():
    loss, lengths = sorted_val_stream()
    f = val_periodicity(loss, lengths)
    assert f.cause and f.details["period"] == 4 and f.details["corr_len"] < -0.8
    assert "validation order is fixed" in f.message
    # without lengths, the period is still found but no cause is claimed
    f = val_periodicity(loss, None)
    assert not f.cause and f.details["period"] == 4


def test_no_period_on_a_smooth_val_curve():
    x = np.arange(40)
    rng = np.random.default_rng(0)
    loss = 2.5 * np.exp(-x / 30) + 1 + 0.01 * rng.standard_normal(40)
    assert val_periodicity(loss, 50 + rng.standard_normal(40)) is None


def test_autocorrelation_of_a_period():
    acf = autocorrelation(np.tile([1.0, -1.0, 0.5, -0.5], 10), 8)
    assert np.argmax(acf) + 1 == 4


def test_step_time_breakdown_names_the_bottleneck():
    df = pd.DataFrame({"time/step": [0.1] * 10, "time/data": [0.06] * 10,
                       "time/forward_backward": [0.03] * 10, "time/probes": [0.001] * 10,
                       "time/optimizer": [0.009] * 10})
    f = step_time_breakdown(df)
    assert f.details["bottleneck"] == "time/data" and f.cause
    assert f.message.startswith("60% of a step goes to waiting for the data loader")


def test_step_time_of_an_own_loop_puts_the_untimed_part_on_the_loop():
    """A loop of the user's own is timed from one optimizer step to the next: what
    nbwatch does not time apart is the loop's data, forward and backward, not overhead."""
    df = pd.DataFrame({"time/step": [0.27] * 10, "time/probes": [0.002] * 10,
                       "time/optimizer": [0.018] * 10})
    f = step_time_breakdown(df)
    assert f.details["bottleneck"] == "other" and not f.cause
    assert "the loop's own data, forward and backward" in f.message
    assert "bookkeeping" not in f.message
