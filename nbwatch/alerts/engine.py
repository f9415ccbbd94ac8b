"""Alert rules: pure checks over the recorded stream, with episodes and actions.

A rule looks at a bounded window of recent figures and says whether its condition
holds. The `AlertEngine` turns conditions into alerts *once per episode*: a rule that
fired stays quiet until its condition has been clear for `clear_steps` observations,
so an alert never fires all day. Each alert names an action for the runner: none,
checkpoint, pause, cut_lr, clip or skip_step.

Defaults follow the seeds and are all overridable with one dict passed to the Monitor:

    Monitor(..., alerts={"grad_explosion": {"factor": 20}, "plateau": False})
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import numpy as np

from ..records import Event
from .rules import (  # noqa: F401  (their home; re-exported)
    ACTION_SETTINGS,
    ACTIONS,
    COMMON,
    PHASES,
    Rule,
    Setting,
    Window,
)
from .signals import USED_LIMIT, _nonfinite, default_rules, straggler  # noqa: F401
from .spike_score import SCORE, SpikeScore

NORM = "grad_norm/global"  # what a norm limit reads (AlertEngine.norms)
LOSS = "loss/train"
START_STEPS = 20


def configure(rules: list[Rule], overrides: Mapping[str, Any] | None) -> list[Rule]:
    """Apply `{rule: False | {setting: value, "actions": [...], "severity": ...}}`; every
    setting is checked against its rule's schema here, so a bad one fails `Monitor(...)`,
    not the run when the rule fires."""
    return [_truthful(r) for r in _override(rules, overrides)]


def _truthful(r: Rule) -> Rule:
    """A rule whose message says what its actions do (nonfinite: skipped or applied)."""
    if r.name == "nonfinite":
        return replace(r, check=partial(_nonfinite, skips="skip_step" in r.actions))
    return r


_HOW = ("alerts={rule: False | {setting: value}}, e.g. alerts={'grad_explosion': "
        "{'factor': 20}, 'plateau': False}")


def _override(rules: list[Rule], overrides: Mapping[str, Any] | None) -> list[Rule]:
    if overrides is None:
        return rules
    if not isinstance(overrides, Mapping):
        raise TypeError(f"alerts must be a dict or None, got {overrides!r} (a "
                        f"{type(overrides).__name__}); pass {_HOW}")
    if not overrides:
        return rules
    by_name = {r.name: r for r in rules}
    unknown = [k for k in overrides if k not in by_name]
    if unknown:
        raise KeyError(f"unknown alert rule(s) {', '.join(map(repr, unknown))}; known: "
                       f"{', '.join(by_name)}")
    out = []
    for r in rules:
        o = overrides.get(r.name, {})
        if o is False:
            continue
        if o is True or o is None or (isinstance(o, Mapping) and not o):
            out.append(r)
            continue
        if not isinstance(o, Mapping):
            raise TypeError(f"alerts[{r.name!r}] must be False (off), True (as is) or a dict "
                            f"of settings, got {o!r}; e.g. alerts={{{r.name!r}: "
                            f"{{'actions': ['pause']}}}}")
        o = dict(o)
        kw: dict[str, Any] = {}
        if "actions" in o:
            acts = o.pop("actions")
            acts = (acts,) if isinstance(acts, str) else acts
            if acts is None:
                acts = ()
            if not isinstance(acts, (list, tuple)):
                raise TypeError(f"alerts[{r.name!r}]['actions'] must be a list of actions "
                                f"from {ACTIONS}, got {acts!r}; e.g. ['pause', 'checkpoint']")
            bad = [a for a in acts if a not in ACTIONS]
            if bad:
                raise ValueError(f"alerts[{r.name!r}]: unknown action(s) {bad}; known: "
                                 f"{', '.join(ACTIONS)}; e.g. alerts={{{r.name!r}: "
                                 "{'actions': ['pause', 'checkpoint']}}")
            kw["actions"] = tuple(dict.fromkeys(a for a in acts if a != "none"))
            late = [a for a in kw["actions"] if a in ("skip_step", "clip") and r.phase != "grads"]
            if late:
                raise ValueError(
                    f"alerts[{r.name!r}]: {late} act on the step being taken, but {r.name} "
                    "is checked after it; use pause, checkpoint or cut_lr")
            if "skip_step" in kw["actions"] and r.name != "nonfinite":
                raise ValueError(
                    f"alerts[{r.name!r}]: skip_step acts on the step being taken, which "
                    "nbwatch decides on the device, without reading it, from non-finite "
                    f"figures only (the nonfinite rule); {r.name}'s figures are read a "
                    "step later: use clip, pause, checkpoint or cut_lr")
        for key in COMMON:
            if key in o:
                kw[key] = o.pop(key)
        actions = kw.get("actions", r.actions)
        known = r.settings(actions)
        bad = [k for k in o if k not in known]
        if bad:
            extra = "; ".join(f"{', '.join(s)} with the {a} action"
                              for a, s in ACTION_SETTINGS.items() if a not in actions)
            raise KeyError(f"alerts[{r.name!r}]: unknown setting(s) {', '.join(map(repr, bad))}; "
                           f"settings: {', '.join(sorted(known))}, actions, "
                           f"{', '.join(COMMON)} (and {extra})")
        out.append(replace(r, params={**r.params, **o}, **kw))  # Rule checks each value
    return out


class Schedule:
    """The rules of a phase that are due at a step (`step % rule.every == 0`), in their
    order: one look-up a step instead of a test a rule. Which are due depends on the step
    modulo the least common multiple of the rules' `every`s (100 for the defaults), or,
    when that is large, on which of the `every`s divide the step."""

    MAX_PERIOD = 10_000

    def __init__(self, rules: list[Rule]):
        self.rules = rules
        self.everys = tuple(sorted({r.every for r in rules} - {1}))
        period = math.lcm(*self.everys) if self.everys else 1
        self.period = period if period <= self.MAX_PERIOD else 0
        self._table: dict[Any, tuple[Rule, ...]] = {}

    def at(self, step: int) -> Sequence[Rule]:
        if not self.everys:
            return self.rules
        key = step % self.period if self.period else tuple(not step % e for e in self.everys)
        due = self._table.get(key)
        if due is None:
            due = self._table[key] = tuple(r for r in self.rules if not step % r.every)
        return due


@dataclass
class Alert:
    """A rule that fired: what the runner records and acts on."""

    rule: Rule
    step: int
    message: str
    data: dict[str, Any] = field(default_factory=dict)  # the check's figures; the batches

    @property
    def event(self) -> Event:
        return Event(self.step, "alert", self.rule.severity, f"{self.rule.name}: {self.message}",
                     {"rule": self.rule.name, "actions": list(self.rule.actions),
                      "params": self.rule.params, **self.data})


class AlertEngine:
    """Feeds observations to the rules of each phase; fires once per episode.

    At each "step" observation it first adds the figures derived from the step's complete
    figures to them (so they are recorded with the step): `derive`'s (MFU, say; each
    given the figures and their step), then the
    spike score (`spike_score.py`), which the rules that detect spikes (`Rule.spike_of`)
    feed and whose count their alerts carry."""

    def __init__(self, rules: list[Rule], window: int = 1000,
                 derive: Sequence[Callable[[dict[str, Any], int], None]] = (),
                 start: Mapping[str, float] | None = None):
        self.rules = rules
        self.derive = list(derive)
        self.spike_score = SpikeScore()
        self._spiked_at: int | None = None  # a "grads" spike rule fired at this step
        self._by_phase = {ph: [r for r in rules if r.phase == ph] for ph in PHASES}
        self._due = {ph: Schedule(rs) for ph, rs in self._by_phase.items()}
        self._clippers = [r for r in self._by_phase["grads"]
                          if r.norm_limit is not None and "clip" in r.actions]
        self._limits: tuple[int, dict[str, tuple[float, float]]] = (-1, {})
        # as long as the longest look-back a rule was given (at most rules.MAX_HISTORY)
        self.window = Window(max([window, *(r.history for r in rules)]))
        # the global norm of each "grads" observation, in step order: what a norm limit
        # reads (the steps recorded so far, in batches, would make it depend on timing)
        self.norms = Window(self.window.size)
        # the run's first levels (the median of its first START_STEPS finite values) of the
        # loss and the gradient norm: a spike is measured against noise of at least 0.1% of
        # them, so a run converged to 1e-8 is not flooded with its float noise's "spikes"
        self.start: dict[str, float] = dict(start or {})  # `start`: a resumed run's
        self._first: dict[str, list[float]] = {k: [] for k in (LOSS, NORM)
                                               if k not in self.start}
        self.norms.extra = {"start": self.start}  # (filled in place: one dict, read live)
        # a "step" rule that acts: its steps are recorded one at a time (recorder/step_end.py)
        self.acts_at_step = any(r.actions for r in self._by_phase["step"])
        # "grads" rules that read named figures (nonfinite: the loss): a loop of the user's
        # own reports its loss after the optimizer step, so these see it at "step"
        self._late = [r for r in self._by_phase["grads"] if "keys" in r.params]
        self._late_keys = tuple(dict.fromkeys(k for r in self._late for k in r.params["keys"]))
        self._grads_saw: tuple[int, frozenset[str]] | None = None
        self._active: dict[str, bool] = {}
        self._clear: dict[str, int] = {}
        self._lr_before: float | None = None  # the LR of the step before
        self._lr_rising = True  # risen at every step since the run began: a warm-up
        # (direction, steps, |log ratio| of the last): the LR's moves the same way, running
        self._lr_trend: tuple[int, int, float] = (0, 0, 0.0)
        self._lr_explained = False
        self._weight_start: dict[str, float] = {}

    def norm_limits(self) -> dict[str, tuple[float, float]]:
        """Rule name → (limit, max_norm) of each "grads" rule that clips: a step whose
        global gradient norm is above `limit` is clipped to `max_norm` on the device, in
        the step itself; its "grads" observation is given them back (`limits=`), so that
        the rule's alert agrees with what the device did. The limit reads the "grads"
        observations so far (`norms`): taken at a step's end, those of every step before
        it, in either order, however its steps' records are batched."""
        if self._limits[0] == self.norms.adds:  # nothing observed since
            return self._limits[1]
        out = {}
        for r in self._clippers:
            limit = r.norm_limit(self.norms, r.params)  # type: ignore[misc]
            if limit is not None:
                out[r.name] = (limit, float(r.params.get("max_norm", 1.0)))
        self._limits = (self.norms.adds, out)
        return out

    def _note_start(self, key: str, v: Any) -> None:
        first = self._first.get(key)
        if first is None or not isinstance(v, (int, float)) or not math.isfinite(v):
            return
        first.append(float(v))
        if len(first) == START_STEPS:
            self.start[key] = float(np.median(first))
            del self._first[key]

    def explain_lr(self) -> None:
        """The LR of the next "step" observation moved as planned (the scheduler stepped, or
        a control scaled it): `lr_change` reports only changes nothing explains."""
        self._lr_explained = True

    def observe(self, phase: str, step: int, values: dict[str, Any] | None = None,
                **extra: Any) -> list[Alert]:
        w = self.window
        fired: list[Alert] = []
        if phase == "grads" and self._late:
            self._grads_saw = (step, frozenset(filter(values.__contains__, self._late_keys))
                               if values else frozenset())
        elif phase == "step" and values and self._late:
            fired += self._after_step(step, values)
        if phase == "step" and values is not None:
            for derive in self.derive:
                derive(values, step)
            values.update(self.spike_score.observe(values))
            if self._spiked_at == step:
                values[SCORE] = self.spike_score.mark()
        if values and phase != "grads":  # "step" brings the same figures, complete
            w.add(values)
        elif values:
            w.latest = values
        if phase == "step":
            lr, before = w.latest.get("lr"), self._lr_before
            trend = self._lr_trend
            if lr is not None:
                if before is not None:
                    self._lr_rising = self._lr_rising and lr > before
                    way = (lr > before) - (lr < before)
                    size = abs(math.log(lr / before)) if lr > 0 and before > 0 else math.inf
                    self._lr_trend = (way, trend[1] + 1 if way == trend[0] else 1, size)
                self._lr_before = lr
            self._note_start(LOSS, w.latest.get(LOSS))
            # a planned change (the scheduler's, a control's) is no news
            w.extra = {"lr_before": None if self._lr_explained else before,
                       "lr_rising": self._lr_rising, "lr_trend": trend, "start": self.start}
            self._lr_explained = False
        elif phase == "hist":
            stds = extra.get("weight_std", {})
            for n, s in stds.items():
                self._weight_start.setdefault(n, s)
            w.extra = {"weight_std": {n: (self._weight_start[n], s) for n, s in stds.items()}}
        elif extra:
            w.extra = extra
        active = self._active
        limits = (extra.get("limits") or {}) if phase == "grads" else None
        for rule in self._due[phase].at(step):  # the rules due at this step, in order
            params = rule.params
            if limits is not None and rule.norm_limit is not None:  # the step's, or now's
                used = limits.get(rule.name)
                params = {**params, USED_LIMIT: used[0] if used is not None
                          else rule.norm_limit(self.norms, params)}
            msg = rule.check(w, params)
            data: dict[str, Any]
            if msg is None:  # quiet (the common case: one look-up, when no episode is on)
                if active.get(rule.name):
                    self._quiet(rule)
                continue
            if isinstance(msg, tuple):
                msg, data = msg
                if msg is None:
                    if active.get(rule.name):
                        self._quiet(rule)
                    continue
            else:
                data = {}
            self._clear[rule.name] = 0
            if active.get(rule.name) and not rule.repeats:
                continue
            active[rule.name] = True
            if rule.spike_of is not None:
                msg, data = self._spike(rule, phase, step, msg, data, values)
            fired.append(Alert(rule, step, msg, data))
        if phase == "grads" and values and NORM in values:
            self.norms.add({NORM: values[NORM]})
            self._note_start(NORM, values[NORM])
        return fired

    def _quiet(self, rule: Rule) -> None:
        """The condition of a rule whose episode is on is clear: it re-arms after
        `clear_steps` such observations."""
        self._clear[rule.name] = self._clear.get(rule.name, 0) + 1
        if self._clear[rule.name] >= rule.clear_steps:
            self._active[rule.name] = False

    def _spike(self, rule: Rule, phase: str, step: int, msg: str, data: dict[str, Any],
               values: dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
        """A spike rule fired: the step counts in the spike score, which the alert says."""
        if phase != "step":  # the step's score is taken at its "step" observation
            self._spiked_at = step
            return msg, data
        score = self.spike_score.mark()
        if values is not None:
            values[SCORE] = score
        sigma = self.spike_score.sigmas.get(rule.spike_of or "")
        data = {**data, "spike_score": score,
                **({"sigma": sigma} if sigma is not None else {})}
        return (f"{msg}; spike score {score:g} (steps that spiked among the last "
                f"{self.spike_score.flags.maxlen:,})"), data


    def _after_step(self, step: int, values: dict[str, Any]) -> list[Alert]:
        """The "grads" rules that read a figure the step's "grads" observation lacked and
        its "step" one has (a loss reported by `mon.log` after the optimizer step): they
        fire now (the step is applied: it cannot be skipped any more); their quiet checks
        do not count towards re-arming, which their "grads" observations do."""
        saw = self._grads_saw
        if saw is None or saw[0] != step or not any(
                k in values and k not in saw[1] for k in self._late_keys):
            return []
        fired = []
        w = self.window
        latest, extra = w.latest, w.extra
        w.latest, w.extra = values, {"after_step": True}
        try:
            for rule in self._late:
                keys = rule.params["keys"]
                if (self._active.get(rule.name) or step % rule.every
                        or not any(k in values and k not in saw[1] for k in keys)):
                    continue
                msg = rule.check(w, rule.params)
                data: dict[str, Any] = {}
                if isinstance(msg, tuple):
                    msg, data = msg
                if msg is not None:
                    self._active[rule.name], self._clear[rule.name] = True, 0
                    fired.append(Alert(rule, step, msg, data))
        finally:
            w.latest, w.extra = latest, extra
        return fired


def weight_std(edges: np.ndarray, counts: np.ndarray) -> float:
    """Standard deviation of the values a histogram describes (bin centres)."""
    centres = (edges[:-1] + edges[1:]) / 2
    n = counts.sum()
    if n == 0:
        return 0.0
    mean = (centres * counts).sum() / n
    return float(math.sqrt(max(((centres - mean) ** 2 * counts).sum() / n, 0.0)))
