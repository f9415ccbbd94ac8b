"""Diagnostics that explain, not only flag: pure functions over recorded series.

- `val_periodicity`: val loss that swings with a period, checked against the mean
  sequence length of each val batch (the seeds' war story: a fixed validation order in
  which long batches recur).
- `lr_loss_correlation`: rolling correlation of LR and train loss.
- `step_time_breakdown`: where a step's time goes, and which part is the bottleneck.
- each loss spike's post-mortem (`postmortem.py`) as a short timeline.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from .postmortem import timeline


@dataclass(frozen=True)
class Finding:
    name: str
    message: str
    cause: bool = False  # True when the finding names a cause, not only a symptom
    details: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.message


class Findings(list):
    """The findings of `diagnose()`: a list, shown (and printed) as their messages."""

    def __str__(self) -> str:
        return "\n".join(map(str, self)) if self else "nothing to report"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


def _detrend(y: np.ndarray) -> np.ndarray:
    """Eval-to-eval changes, less their linear trend: removes the slow fall of the loss
    (whatever its shape) and keeps any period intact."""
    d = np.diff(y)
    x = np.arange(len(d), dtype=np.float64)
    return d - np.polyval(np.polyfit(x, d, 1), x)


def autocorrelation(x: np.ndarray, max_lag: int) -> np.ndarray:
    """Autocorrelation at lags 1..max_lag (unbiased normalisation by overlap)."""
    x = x - x.mean()
    denom = (x * x).sum()
    if denom == 0:
        return np.zeros(max_lag)
    return np.array([(x[:-k] * x[k:]).sum() / denom * len(x) / (len(x) - k)
                     for k in range(1, max_lag + 1)])


def val_periodicity(
    val_loss: np.ndarray, val_seq_len: np.ndarray | None = None, min_evals: int = 12,
    corr: float = 0.8, min_acf: float = 0.5,
) -> Finding | None:
    """A period in the val loss residuals, and whether batch length explains the swings."""
    y = np.asarray(val_loss, dtype=np.float64)
    ok = np.isfinite(y)
    if ok.sum() < min_evals:
        return None
    y = y[ok]
    resid = _detrend(y)
    if resid.std() < 1e-12:
        return None
    acf = autocorrelation(resid, max(3, len(resid) // 3))
    # the strongest lag ≥ 2 that is a peak (above the lag before it), not a smooth decay
    lag = int(np.argmax(acf[1:]) + 2)
    period_found = acf[lag - 1] >= min_acf and acf[lag - 1] > acf[lag - 2]
    r = None
    if val_seq_len is not None and len(val_seq_len) == len(val_loss):
        lens = _detrend(np.asarray(val_seq_len, dtype=np.float64)[ok])
        if lens.std() > 0:
            r = float(np.corrcoef(resid, lens)[0, 1])
    if r is not None and abs(r) > corr:
        return Finding(
            "val_periodic",
            f"val loss swings {'with a period of ' + str(lag) + ' evals ' if period_found else ''}"
            f"in step with the mean sequence length of each val batch (corr {r:+.2f}): the "
            "validation order is fixed and long batches recur; shuffle the val set once or "
            "evaluate on all of it each time",
            cause=True, details={"period": lag if period_found else None, "corr_len": r},
        )
    if period_found:
        return Finding("val_periodic",
                       f"val loss oscillates with a period of {lag} evals "
                       f"(autocorrelation {acf[lag - 1]:.2f}); return 'seq_len_mean' from "
                       "val_fn to check it against batch lengths",
                       details={"period": lag, "corr_len": r})
    return None


def lr_loss_correlation(df: pd.DataFrame, window: int = 200) -> pd.Series:
    """Rolling Pearson correlation of `lr` and `loss/train` (index: step)."""
    if "lr" not in df or "loss/train" not in df:
        return pd.Series(dtype=float)
    return df["lr"].rolling(window, min_periods=window // 2).corr(df["loss/train"])


_PARTS = {
    "time/data": "waiting for the data loader",
    "time/forward_backward": "forward and backward",
    "time/probes": "gradient probes and the host copy",
    "time/optimizer": "optimizer and scheduler",
}


def step_time_breakdown(df: pd.DataFrame, last: int = 200) -> Finding | None:
    """Share of each part of the step over the last `last` steps; names the largest."""
    cols = [c for c in _PARTS if c in df]
    if "time/step" not in df or not cols:
        return None
    recent = df[["time/step", *cols]].dropna().tail(last)
    if recent.empty:
        return None
    total = recent["time/step"].sum()
    shares = {c: float(recent[c].sum() / total) for c in cols}
    shares["other"] = max(0.0, 1.0 - sum(shares.values()))
    top = max(shares, key=shares.__getitem__)
    # a loop of the user's own is timed from one optimizer step to the next: its data,
    # forward and backward are in that time, not apart
    other = ("bookkeeping outside the measured parts" if "time/forward_backward" in cols
             else "the loop's own data, forward and backward (not timed apart in a loop of "
             "your own)")
    what = _PARTS.get(top, other)
    return Finding("step_time", f"{shares[top]:.0%} of a step goes to {what}"
                   f" ({recent['time/step'].median() * 1e3:.1f} ms median step)",
                   cause=top == "time/data", details={"shares": shares, "bottleneck": top})


def diagnose(df: pd.DataFrame, spikes: pd.DataFrame | None = None) -> Findings:
    """Every diagnostic that has something to say about a run's frame, and a timeline of
    each loss spike of `spikes` (`run.spikes`)."""
    out = Findings()
    if "loss/val" in df:
        val = df["loss/val"].dropna()
        lens = df["val/seq_len_mean"].reindex(val.index) if "val/seq_len_mean" in df else None
        f = val_periodicity(val.to_numpy(), None if lens is None else lens.to_numpy())
        if f:
            out.append(f)
    f = step_time_breakdown(df)
    if f:
        out.append(f)
    corr = lr_loss_correlation(df).dropna()
    if len(corr):
        out.append(Finding("lr_loss", f"rolling LR/loss correlation now {corr.iloc[-1]:+.2f}",
                           details={"corr": float(corr.iloc[-1])}))
    if spikes is not None:
        for row in spikes.to_dict("records"):
            out.append(Finding("loss_spike", timeline(row), details=row))
    return out
