"""The spike score: how many steps spiked lately, as OLMo-core's `StabilityMonitorCallback`
defines it (allenai/OLMo-core, src/olmo_core/train/callbacks/stability_monitor.py).

A value spikes when it is more than 6 standard deviations above the mean of the 128
values before it (population SD; only once 128 are there; never when their SD is below
1e-10). A step counts once when its train loss or its global gradient norm spikes. OLMo-core
logs `spike/SpikeScore`, the fraction of the last 10,000 steps that spiked (once 10,000
steps have passed); nbwatch records `spike/score`, their *count* over the last 10,000 steps
(the same figure × 10,000, and there from the first step on), and at a spike step
`spike/loss` or `spike/grad_norm`: how many SDs above the mean it stood.

Two departures, both said here: a non-finite value is left out of the history (OLMo-core
appends it, and one NaN would then hide every later spike; the `nonfinite` rule has it);
and a step at which nbwatch's own spike rules fired (`loss_spike`, `grad_norm_spike`,
`grad_explosion`: `Rule.spike_of`) counts too, so spikes in the first 128 steps, or in a
falling loss whose mean lags it, are not lost.

Cost: O(1) a step and figure (running sums over a ring buffer; the sums are recomputed
from the ring once every 128 values, so rounding cannot build up).
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

WINDOW = 128  # values the mean and SD are taken over
THRESHOLD = 6.0  # SDs above the mean
SCORE_WINDOW = 10_000  # steps the score counts spikes over
MIN_STD = 1e-10
SIGNALS = {"loss/train": "spike/loss", "grad_norm/global": "spike/grad_norm"}
SCORE = "spike/score"
_SIGNALS = tuple(SIGNALS.items())


class Rolling:
    """Mean and population SD of the last `n` values added, O(1) an addition."""

    def __init__(self, n: int = WINDOW):
        if n < 2:
            raise ValueError(f"Rolling needs n >= 2 values, got n={n}")
        self.n = n
        self.ring: list[float] = []
        self.i = 0  # where the next value goes once the ring is full
        self.shift = 0.0  # sums are of x - shift: no cancellation when the values are large
        self.s = self.s2 = 0.0
        self.since = 0  # additions since the sums were last recomputed

    @property
    def full(self) -> bool:
        return len(self.ring) == self.n

    def add(self, x: float) -> None:
        if not self.ring:
            self.shift = x
        d = x - self.shift
        if len(self.ring) == self.n:  # full
            old = self.ring[self.i] - self.shift
            self.ring[self.i] = x
            self.i = (self.i + 1) % self.n
            self.s += d - old
            self.s2 += d * d - old * old
        else:
            self.ring.append(x)
            self.s += d
            self.s2 += d * d
        self.since += 1
        if self.since >= self.n:  # amortised O(1): once per n additions
            self._recompute()

    def _recompute(self) -> None:
        k = len(self.ring)
        self.shift = sum(self.ring) / k
        self.s = sum(x - self.shift for x in self.ring)
        self.s2 = sum((x - self.shift) ** 2 for x in self.ring)
        self.since = 0

    def mean_std(self) -> tuple[float, float]:
        k = len(self.ring)
        m = self.s / k
        return self.shift + m, math.sqrt(max(self.s2 / k - m * m, 0.0))

    def sigmas(self, x: float) -> float | None:
        """How many SDs `x` stands above the mean of the window; None before it is full or
        when its SD is below 1e-10 (OLMo-core's guard)."""
        k = len(self.ring)
        if k != self.n:  # not full
            return None
        m = self.s / k  # mean_std, inline (called at every step)
        std = math.sqrt(max(self.s2 / k - m * m, 0.0))
        return None if std < MIN_STD else (x - (self.shift + m)) / std


class SpikeScore:
    """The live spike score of a run: `observe(values)` at each step's complete figures
    adds `spike/score` (and `spike/loss`, `spike/grad_norm` at a spike) to them.

    >>> score = SpikeScore()
    >>> for step in steps: values.update(score.observe(values))
    """

    def __init__(self, window: int = WINDOW, threshold: float = THRESHOLD,
                 score_window: int = SCORE_WINDOW):
        self.threshold = threshold
        self.history = {k: Rolling(window) for k in SIGNALS}
        self.flags: deque[bool] = deque(maxlen=score_window)
        self.count = 0  # True flags in `flags`
        self.sigmas: dict[str, float] = {}  # this step's, per signal (when defined)

    def observe(self, values: dict[str, Any]) -> dict[str, float]:
        """This step's spike figures; call once a step, with its loss and grad norm."""
        out: dict[str, float] = {}
        self.sigmas = {}
        spiked = False
        history = self.history
        for key, name in _SIGNALS:
            v = values.get(key)
            if v.__class__ is float:
                if v - v:  # inf - inf and nan - nan are nan (true); finite: 0.0 (false)
                    continue
            elif not isinstance(v, (int, float)) or not math.isfinite(v):
                continue
            hist = history[key]
            x = float(v)
            z = hist.sigmas(x)
            hist.add(x)  # the spike joins the history, as in OLMo-core
            if z is None:
                continue
            self.sigmas[key] = z
            if z > self.threshold:
                out[name] = z
                spiked = True
        if len(self.flags) == self.flags.maxlen and self.flags[0]:
            self.count -= 1
        self.flags.append(spiked)
        self.count += spiked
        out[SCORE] = float(self.count)
        return out

    def mark(self) -> float:
        """Count this step (the last observed) as a spike, if it is not yet: a spike rule
        fired on it. Returns the score."""
        if self.flags and not self.flags[-1]:
            self.flags[-1] = True
            self.count += 1
        return float(self.count)


def olmo_spikes(x: list[float], window: int = WINDOW, threshold: float = THRESHOLD
                ) -> list[int]:
    """The indices of `x` that OLMo-core's test calls spikes, computed directly (O(n·window)):
    what `SpikeScore` computes in O(1) a step, written as OLMo-core writes it."""
    out = []
    for i in range(window, len(x)):
        h = x[i - window:i]
        mean = sum(h) / window
        std = math.sqrt(sum((v - mean) ** 2 for v in h) / window)
        if std >= MIN_STD and x[i] > mean + threshold * std:
            out.append(i)
    return out
