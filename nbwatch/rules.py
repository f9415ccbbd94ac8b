"""What an alert rule is: its fields (`Rule`), and the bounded window of recent figures its
check reads (`Window`). Shared by the rule sets: `alerts` (training signals) and `health`
(Transformer health)."""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

ACTIONS = ("none", "checkpoint", "pause", "cut_lr", "clip", "skip_step", "rewind")
# "grads": after the gradient probes, before the optimizer step (the rule can still skip or
# clip this step); "step": the step's complete figures, timings included.
PHASES = ("grads", "step", "eval", "hist", "attention", "ranks")


@dataclass(frozen=True)
class Rule:
    """One alert rule: `check(window, params)` → None when quiet, else a message."""

    name: str
    severity: str
    phase: str
    # None when quiet, else a message, or (message, figures for the alert event's data)
    check: Callable[[Window, dict[str, Any]], str | tuple[str, dict[str, Any]] | None]
    params: dict[str, Any] = field(default_factory=dict)
    actions: tuple[str, ...] = ()
    clear_steps: int = 1  # quiet observations before the rule re-arms
    doc: str = ""
    every: int = 1  # observe every n-th step only (rules that look back over a window)

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"rule {self.name!r}: phase must be one of {PHASES}")


class Window:
    """Bounded recent history of each figure (deques), plus the newest values seen."""

    def __init__(self, size: int = 1000):
        self.size = size
        self.series: dict[str, deque[float]] = {}
        self.latest: dict[str, Any] = {}
        self.extra: dict[str, Any] = {}  # what a phase brings besides figures
        self.best: dict[str, float] = {}
        self.adds = 0
        self._medians: dict[tuple[str, int], tuple[int, float, int]] = {}
        self._mads: dict[tuple[str, int], tuple[int, float, float, int]] = {}

    def add(self, values: dict[str, Any]) -> None:
        self.latest = values
        self.adds += 1
        series = self.series
        for k, v in values.items():
            if isinstance(v, (int, float)):
                s = series.get(k)
                if s is None:
                    s = series[k] = deque(maxlen=self.size)
                s.append(float(v))

    def median(self, key: str, last: int, refresh: int = 10) -> tuple[float, int]:
        """(median, count) of the finite values among the `last` of `key`, recomputed
        every `refresh` additions: a rolling baseline need not move at every step."""
        cached = self._medians.get((key, last))
        if cached is not None and self.adds - cached[0] < refresh:
            return cached[1], cached[2]
        a = self.arr(key, last)
        a = a[np.isfinite(a)]
        out = (self.adds, float(np.median(a)) if len(a) else math.nan, len(a))
        self._medians[(key, last)] = out
        return out[1], out[2]

    def mad(self, key: str, last: int, refresh: int = 10) -> tuple[float, float, int]:
        """(median, MAD, count) of the finite values among the `last` of `key` before the
        newest one, recomputed every `refresh` additions (the newest value is the one a
        rule compares with this baseline, so it is left out)."""
        cached = self._mads.get((key, last))
        if cached is not None and self.adds - cached[0] < refresh:
            return cached[1], cached[2], cached[3]
        a = self.arr(key, last + 1)[:-1]
        a = a[np.isfinite(a)]
        if len(a):
            med = _median(a)
            out = (self.adds, med, _median(np.abs(a - med)), len(a))
        else:
            out = (self.adds, math.nan, math.nan, 0)
        self._mads[(key, last)] = out
        return out[1], out[2], out[3]

    def arr(self, key: str, last: int | None = None) -> np.ndarray:
        """The series (or its `last` values), oldest first; O(last), not O(window)."""
        s = self.series.get(key)
        if not s:
            return np.empty(0)
        if last and last < len(s):
            tail = np.fromiter(itertools.islice(reversed(s), last), dtype=np.float64, count=last)
            return tail[::-1]
        return np.fromiter(s, dtype=np.float64, count=len(s))


def _median(a: np.ndarray) -> float:
    """`np.median` of a non-empty 1-d array, by partition: 5× less overhead on the few
    hundred values of a rolling window."""
    h = len(a) // 2
    if len(a) % 2:
        return float(np.partition(a, h)[h])
    p = np.partition(a, (h - 1, h))
    return float((p[h - 1] + p[h]) / 2)
