"""What an alert rule is: its fields (`Rule`), and the bounded window of recent figures its
check reads (`Window`). Shared by the rule sets: `alerts` (training signals) and `health`
(Transformer health)."""

from __future__ import annotations

import itertools
import math
import numbers
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..records import SEVERITIES

ACTIONS = ("none", "checkpoint", "pause", "cut_lr", "clip", "skip_step", "rewind")
# "grads": after the gradient probes, before the optimizer step (the rule can still skip or
# clip this step); "step": the step's complete figures, timings included.
PHASES = ("grads", "step", "eval", "hist", "attention", "ranks")


# The longest look-back a rule may ask for: the alert engine keeps this many recent values
# of every figure (hundreds of per-layer series), so a longer one would cost memory.
MAX_HISTORY = 5000


@dataclass(frozen=True)
class Setting:
    """What one setting of a rule accepts; `check` returns the value, normalised, or raises
    an error naming the rule, the setting and the allowed values.

    kind "number": a real number in [lo, hi] (`open_lo`/`open_hi`: the bound excluded;
    `inf`: +inf allowed, "no limit"); "count": an int in [lo, hi], at least the setting
    `not_below` names (`history`: a look-back over the recorded steps, which sizes the
    alert engine's window); "names": figure names (one str or a list of them);
    "choice": one of `choices`."""

    kind: str
    lo: float | None = None
    hi: float | None = None
    open_lo: bool = False
    open_hi: bool = False
    inf: bool = False
    not_below: str | None = None
    history: bool = False
    choices: tuple[str, ...] = ()
    eg: Any = None  # a value to show in the error's "e.g." (else one from the range)

    def allowed(self) -> str:
        if self.kind == "choice":
            return f"one of {', '.join(map(repr, self.choices))}"
        if self.kind == "names":
            return "a list of figure names (str)"
        what = "an int" if self.kind == "count" else "a number"
        lo, hi = self.lo, self.hi
        if lo is not None and hi is not None:
            rng = (f" in {'(' if self.open_lo else '['}{lo:g}, {hi:g}"
                   f"{')' if self.open_hi else ']'}")
        elif lo is not None:
            rng = f" {'>' if self.open_lo else '≥'} {lo:g}"
        elif hi is not None:
            rng = f" {'<' if self.open_hi else '≤'} {hi:g}"
        else:
            rng = ""
        return what + rng + (" (or float('inf'): no limit)" if self.inf else "")

    def example(self) -> Any:
        """A value this setting accepts (for the error's "e.g.")."""
        if self.eg is not None:
            return self.eg
        if self.kind == "names":
            return ["loss/train"]
        if self.kind == "choice":
            return self.choices[-1]
        if self.kind == "count":
            return 100 if self.history else max(int(self.lo or 0), 1)
        lo, hi = self.lo, self.hi
        if lo is not None and hi is not None:
            return (lo + hi) / 2
        if lo is not None:
            return float(lo) if not self.open_lo else (2.0 * lo if lo > 0 else 1.0)
        return 1.0

    def check(self, rule: str, key: str, v: Any, eg: Any = None) -> Any:
        given, eg = v, eg if eg is not None else self.example()

        def refuse(err: type[Exception], why: str = "") -> Exception:
            got = f"{given!r}" + (f" (a {type(given).__name__})" if err is TypeError else "")
            return err(f"alerts[{rule!r}][{key!r}] must be {self.allowed()}{why}, got {got}; "
                       f"e.g. alerts={{{rule!r}: {{{key!r}: {eg!r}}}}}")

        if self.kind == "choice":
            if not isinstance(v, str):
                raise refuse(TypeError)
            if v not in self.choices:
                raise refuse(ValueError)
            return v
        if self.kind == "names":
            names = (v,) if isinstance(v, str) else v
            if not isinstance(names, (list, tuple)) or not all(
                    isinstance(n, str) and n for n in names):
                raise refuse(TypeError)
            if not names:
                raise refuse(ValueError, f" (at least one; to turn the rule off: "
                             f"alerts={{{rule!r}: False}})")
            return tuple(names)
        if self.kind == "count":
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise refuse(TypeError)
            v = int(v)
        else:
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise refuse(TypeError)
            v = float(v)
            if math.isnan(v) or (math.isinf(v) and not (self.inf and v > 0)):
                raise refuse(ValueError)
        lo, hi = self.lo, self.hi
        if (lo is not None and (v < lo or (self.open_lo and v == lo))) or (
                hi is not None and (v > hi or (self.open_hi and v == hi))):
            raise refuse(ValueError)
        return v


def number(lo: float | None = None, hi: float | None = None, *, open_lo: bool = False,
           open_hi: bool = False, inf: bool = False, eg: float | None = None) -> Setting:
    return Setting("number", lo, hi, open_lo, open_hi, inf, eg=eg)


def count(lo: int = 1, hi: int | None = None, *, not_below: str | None = None,
          history: bool = False, eg: int | None = None) -> Setting:
    return Setting("count", lo, hi, not_below=not_below, history=history, eg=eg)


def window(lo: int = 1, *, not_below: str | None = None) -> Setting:
    """A look-back over recorded steps (at most MAX_HISTORY)."""
    return count(lo, MAX_HISTORY, not_below=not_below, history=True)


POSITIVE = number(0, open_lo=True)
FRACTION = number(0, 1, open_lo=True, open_hi=True)  # strictly between 0 and 1
# A rule's own fields, settable for every rule
COMMON: dict[str, Setting] = {
    "severity": Setting("choice", choices=SEVERITIES),
    "clear_steps": count(1),
    "every": count(1),
}
# Settings of an action, accepted on any rule that has the action
ACTION_SETTINGS: dict[str, dict[str, Setting]] = {
    "cut_lr": {"lr_factor": number(0, 1, open_lo=True, eg=0.5)},  # a cut, never a raise
    "clip": {"max_norm": number(0, open_lo=True, eg=1.0)},
    "rewind": {"rewind_steps": count(1, eg=100), "rewind_skip": count(0, eg=200)},
}


@dataclass(frozen=True)
class Rule:
    """One alert rule: `check(window, params)` → None when quiet, else a message.

    `schema` declares what each of `params` accepts (a `Setting`); every rule declares
    each of its params, so one function (`Rule.__post_init__`) checks them all, and the
    settings of the rule's actions (`ACTION_SETTINGS`) and its own fields (`COMMON`)."""

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
    # behaviour flags, read by the engine and the recorder instead of rule names:
    # its inputs are the same on every DDP rank (the synchronised gradients), so each rank
    # decides alone at the same step; the others are decided on rank 0 and exchanged
    same_on_every_rank: bool = False
    repeats: bool = False  # fires at each occurrence, with no episode to wait out
    # the figure whose spikes the rule detects: a step it fires on counts in the spike score
    spike_of: str | None = None
    # a "grads" rule that clips: the global gradient norm above which it fires at the next
    # step, from the steps read so far (None: none yet). The step's clip is decided on the
    # device against it, before its figures reach the host (recorder/optimizer_step.py)
    norm_limit: Callable[[Window, dict[str, Any]], float | None] | None = None
    schema: dict[str, Setting] = field(default_factory=dict)
    # the params the rule was defined with (kept through `replace`): the errors' examples
    defaults: dict[str, Any] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        defaults = self.defaults
        if defaults is None:
            defaults = dict(self.params)
            object.__setattr__(self, "defaults", defaults)
        if self.phase not in PHASES:
            raise ValueError(f"rule {self.name!r}: phase must be one of {PHASES}")
        for key, setting in COMMON.items():
            setting.check(self.name, key, getattr(self, key))
        known = self.settings()
        undeclared = set(self.params) - set(known)
        if undeclared:
            raise KeyError(f"alerts[{self.name!r}]: unknown setting(s) {sorted(undeclared)}; "
                           f"settings: {sorted(known)}")
        p = {k: known[k].check(self.name, k, v, _shown(defaults.get(k)))
             for k, v in self.params.items()}
        for k, v in p.items():
            floor = known[k].not_below
            if floor in p and v < p[floor]:
                raise ValueError(
                    f"alerts[{self.name!r}][{k!r}] ({v}) is below its {floor!r} ({p[floor]}), "
                    f"the steps the rule needs before it can fire, so it never would; raise "
                    f"{k!r} or lower {floor!r}, e.g. alerts={{{self.name!r}: {{{k!r}: {v}, "
                    f"{floor!r}: {v}}}}}")
        object.__setattr__(self, "params", p)

    def settings(self, actions: tuple[str, ...] | None = None) -> dict[str, Setting]:
        """What `params` may hold: the rule's own settings and those of its actions (or of
        `actions`)."""
        out = dict(self.schema)
        for a in self.actions if actions is None else actions:
            for k, s in ACTION_SETTINGS.get(a, {}).items():
                out.setdefault(k, s)
        return out

    @property
    def history(self) -> int:
        """How many recent values of a figure the check may read."""
        return sum(v for k, v in self.params.items()
                   if k in self.schema and self.schema[k].history) + 1


def _shown(default: Any) -> Any:
    return list(default) if isinstance(default, tuple) else default


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
        self._detrended: dict[tuple[str, int], tuple[int, float, int]] = {}
        self._keys: tuple[str, ...] | None = None  # the figures of the last `add`, all floats
        self._deques: list[deque[float]] = []  # their series, in that order

    def add(self, values: dict[str, Any]) -> None:
        """Append each number of `values` to its figure's series (as a float; other values
        are not recorded). The common step, the same figures as the last one's and all of
        them floats, appends in one pass (no per-figure look-up or test in Python)."""
        self.latest = values
        self.adds += 1
        keys = tuple(values)
        vals = values.values()
        if keys == self._keys and set(map(type, vals)) == _FLOAT:
            _consume(map(deque.append, self._deques, vals))
            return
        series = self.series
        floats = True
        for k, v in values.items():
            s = series.get(k)
            if v.__class__ is not float:
                floats = False
                if not isinstance(v, (int, float)):
                    continue
            if s is None:
                s = series[k] = deque(maxlen=self.size)
            s.append(float(v))
        # the next step's figures are likely the same: their series, in `values`' order
        self._keys = keys if floats else None
        self._deques = [series[k] for k in keys] if floats else []

    def median(self, key: str, last: int, refresh: int = 10) -> tuple[float, int]:
        """(median, count) of the finite values among the `last` of `key`, recomputed
        every `refresh` additions: a rolling baseline need not move at every step."""
        cached = self._medians.get((key, last))
        if cached is not None and self.adds - cached[0] < refresh:
            return cached[1], cached[2]
        a = self.arr(key, last)
        a = a[np.isfinite(a)]  # a copy: partitioned in place
        out = (self.adds, _median_of(a) if len(a) else math.nan, len(a))
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
            out = (self.adds, med, _median_of(np.abs(a - med)), len(a))
        else:
            out = (self.adds, math.nan, math.nan, 0)
        self._mads[(key, last)] = out
        return out[1], out[2], out[3]

    def detrended_mad(self, key: str, last: int, recent: int = 10, refresh: int = 10
                      ) -> tuple[float, float, int]:
        """(level, MAD, count) of the finite values among the `last` of `key` before the
        newest one, for a baseline that follows a trend: `level` is the median of the
        `recent` values before the newest (computed at every call, O(recent)), so it follows
        a falling loss where the median of a long window lags it; MAD is the median absolute
        deviation of the `last` values around their robust trend line (Tukey's resistant
        line: through the medians of the first and the last third), so the descent itself
        is not counted as noise. The MAD is recomputed every `refresh` additions, and every
        count/20 while the history is shorter (a noise level that changes early in training
        is followed; about 20 values' work a call at any length)."""
        cached = self._detrended.get((key, last))
        if cached is None or self.adds - cached[0] >= max(1, min(refresh, cached[2] // 20)):
            s = self.series.get(key)
            k = min(len(s) - 1, last) if s else 0  # the values before the newest
            y = np.fromiter(itertools.islice(reversed(s), 1, k + 1), dtype=np.float64,
                            count=k)[::-1] if s and k > 0 else np.empty(0)
            ok = np.isfinite(y)
            every = bool(ok.all())
            x = np.arange(len(y), dtype=np.float64) if every else np.flatnonzero(ok) * 1.0
            y = y if every else y[ok]
            n, slope = len(y), 0.0
            if n >= 3:
                t = n // 3  # the x medians of the thirds: their middles, when no value is out
                xl, xr = ((t - 1) / 2, n - 1 - (t - 1) / 2) if every else (
                    _median(x[:t]), _median(x[-t:]))
                slope = (_median_of(y[-t:].copy()) - _median_of(y[:t].copy())) / (xr - xl)
            r = y - slope * x
            cached = (self.adds, _median_of(np.abs(r - _median_of(r.copy()))) if n else math.nan,
                      n)
            self._detrended[(key, last)] = cached
        # the level: a few values, so plain Python (a numpy call costs more than the work)
        s = self.series.get(key)
        tail = list(itertools.islice(reversed(s), 1, recent + 1)) if s else []
        if math.isfinite(sum(tail)):  # the common case: every value finite
            tail.sort()
        else:
            tail = sorted(v for v in tail if math.isfinite(v))
        h = len(tail) // 2
        level = (tail[h] if len(tail) % 2 else (tail[h - 1] + tail[h]) / 2) if tail else math.nan
        return level, cached[1], cached[2]

    def arr(self, key: str, last: int | None = None) -> np.ndarray:
        """The series (or its `last` values), oldest first; O(last), not O(window)."""
        s = self.series.get(key)
        if not s:
            return np.empty(0)
        if last and last < len(s):
            tail = np.fromiter(itertools.islice(reversed(s), last), dtype=np.float64, count=last)
            return tail[::-1]
        return np.fromiter(s, dtype=np.float64, count=len(s))


_FLOAT = {float}
_consume: Callable[[Iterable[Any]], None] = deque(maxlen=0).extend  # runs an iterator out


def percentile(a: np.ndarray, q: float) -> float:
    """`np.percentile(a, q)` (linear interpolation) of a non-empty 1-d array, by partition:
    a fraction of its overhead on a rolling window."""
    pos = q / 100 * (len(a) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(a) - 1)
    p = np.partition(a, (lo, hi))
    return float(p[lo] + (p[hi] - p[lo]) * (pos - lo))


def _median_of(a: np.ndarray) -> float:
    """`_median` of an array of one's own (a copy, a temporary): partitioned in place."""
    h = len(a) // 2
    if len(a) % 2:
        a.partition(h)
        return float(a[h])
    a.partition((h - 1, h))
    return float((a[h - 1] + a[h]) / 2)


def _median(a: np.ndarray) -> float:
    """`np.median` of a non-empty 1-d array, by partition: 5× less overhead on the few
    hundred values of a rolling window."""
    h = len(a) // 2
    if len(a) % 2:
        return float(np.partition(a, h)[h])
    p = np.partition(a, (h - 1, h))
    return float((p[h - 1] + p[h]) / 2)
