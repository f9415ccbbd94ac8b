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
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import numpy as np

from .health import rules as health_rules
from .records import Event
from .rules import (  # noqa: F401  (their home; re-exported)
    ACTION_SETTINGS,
    ACTIONS,
    COMMON,
    FRACTION,
    PHASES,
    POSITIVE,
    Rule,
    Setting,
    Window,
    count,
    number,
    window,
)


# -- the checks (pure: window + params → message or None) ---------------------------------
def _nonfinite(w: Window, p: dict, skips: bool = True) -> str | None:
    bad = [k for k in p["keys"]
           if k in w.latest and not math.isfinite(w.latest[k])]
    if bad:
        if w.extra.get("after_step"):  # the loop reported it after its optimizer step
            return (f"non-finite {' and '.join(bad)} reported after the optimizer step "
                    "(mon.log): the gradients were finite, so the step was applied; check "
                    "how the loop computes the figure")
        if skips:
            return f"non-finite {' and '.join(bad)} at this step: step skipped, weights untouched"
        return (f"non-finite {' and '.join(bad)} at this step: the step was APPLIED (skip_step "
                "is not among this rule's actions), so the weights may now be non-finite")
    return None


def _grad_explosion(w: Window, p: dict) -> str | None:
    g = w.latest.get("grad_norm/global")
    if g is None or not math.isfinite(g):
        return None
    if g > p["absolute"]:
        return f"gradient norm {g:.3g} above {p['absolute']:.0e}"
    med, n = w.median("grad_norm/global", p["window"])  # earlier steps: not this one
    if n >= p["min_history"] and med > 0 and g > p["factor"] * med:
        return f"gradient norm {g:.3g} is {g / med:.0f}× its rolling median {med:.3g}"
    return None


def _loss_spike(w: Window, p: dict) -> tuple[str, dict[str, Any]] | None:
    loss = w.latest.get("loss/train")
    if loss is None or not math.isfinite(loss):  # non-finite: the nonfinite rule's
        return None
    med, mad, n = w.mad("loss/train", p["window"])  # cached: recomputed every 10 steps
    if n < p["min_history"] or loss <= med:
        return None
    # the floor: a loss flat to the last digit has a MAD of ~0, and its noise is no spike
    scale = 1.4826 * max(mad, 1e-3 * abs(med), 1e-12)
    z = (loss - med) / scale
    if z <= p["z"]:
        return None
    return (f"train loss {loss:.4g} spiked: z = {z:.1f} against its rolling median "
            f"{med:.4g} (MAD {mad:.3g}, last {n} steps)",
            {"loss": loss, "median": med, "mad": mad, "z": z})


def _vanishing(w: Window, p: dict) -> str | None:
    g = w.arr("grad_norm/global", p["persist"])
    if len(g) >= p["persist"] and np.all(g < p["global_below"]):
        return f"global gradient norm below {p['global_below']:.0e} for {p['persist']} steps"
    layers = [k for k in w.latest if k.startswith("grad_norm/")
              and k not in ("grad_norm/global", "grad_norm/clipped")]
    if len(layers) < 3:
        return None
    recent = np.stack([w.arr(k, p["persist"]) for k in layers])  # [layers, steps]
    if recent.shape[1] < p["persist"]:
        return None
    med = np.median(recent, axis=0)
    ratio = recent / np.maximum(med, 1e-30)
    low = np.all(ratio < p["layer_ratio"], axis=1)
    if low.any():
        names = [layers[i].removeprefix("grad_norm/") for i in np.flatnonzero(low)][:3]
        return (f"gradients of {', '.join(names)} are over {1 / p['layer_ratio']:.0f}× below "
                f"the median layer's for {p['persist']} steps")
    return None


def _throughput_drop(w: Window, p: dict) -> str | None:
    key = next((k for k in ("throughput/tokens_per_s", "throughput/samples_per_s")
                if k in w.latest), None)
    if key is None:
        return None
    a = w.arr(key, p["window"] + p["persist"])
    if len(a) < p["min_history"] + p["persist"]:
        return None
    base = float(np.median(a[-p["window"] - p["persist"]:-p["persist"]]))
    recent = a[-p["persist"]:]
    if base > 0 and np.all(recent < (1 - p["drop"]) * base):
        return (f"throughput fell to {np.median(recent):,.0f} {key.split('/')[1]} "
                f"from a median of {base:,.0f} ({1 - np.median(recent) / base:.0%} drop)")
    return None


def _data_bottleneck(w: Window, p: dict) -> str | None:
    data, step = w.arr("time/data", p["window"]), w.arr("time/step", p["window"])
    if len(data) < p["window"]:
        return None
    share = data.sum() / max(step.sum(), 1e-12)
    p90 = float(np.percentile(data, 90))
    if share > p["share"]:
        return f"the step waits on the data loader {share:.0%} of the time"
    if p90 > p["p90_s"]:
        return f"data wait p90 is {p90 * 1e3:.0f} ms a step"
    return None


def _padding(w: Window, p: dict) -> str | None:
    a = w.arr("data/padding_ratio", p["window"])
    if len(a) >= p["window"] and a.mean() > p["ratio"]:
        return (f"{a.mean():.0%} of the tokens in recent batches are padding: bucket "
                "sequences by length or pack them")
    return None


def _plateau(w: Window, p: dict) -> str | None:
    a = w.arr("loss/train", p["window"])
    a = a[np.isfinite(a)]
    if len(a) < p["window"]:
        return None
    x = np.arange(len(a), dtype=np.float64)
    slope, intercept = np.polyfit(x, a, 1)
    resid = a - (slope * x + intercept)
    se = resid.std(ddof=2) / math.sqrt(((x - x.mean()) ** 2).sum())
    change = slope * len(a) / max(abs(a.mean()), 1e-12)
    if slope > -2 * se and abs(change) < p["min_change"]:
        return (f"train loss has not improved over the last {len(a)} steps "
                f"(mean {a.mean():.4g}, trend {change:+.2%})")
    return None


def _val_spike(w: Window, p: dict) -> str | None:
    v = w.latest.get("loss/val")
    vals = w.arr("loss/val")[:-1]
    vals = vals[np.isfinite(vals)]
    if v is None or not math.isfinite(v) or not len(vals):  # non-finite: nonfinite_val
        return None
    best = float(vals.min())
    if best > 0 and v > p["factor"] * best:
        return f"val loss {v:.4g} is over {p['factor']:g}× the best so far ({best:.4g})"
    return None


def _nonfinite_val(w: Window, p: dict) -> str | None:
    bad = [k for k, v in w.latest.items()
           if (k == "loss/val" or k.startswith("val/")) and not math.isfinite(v)]
    if bad:
        return (f"non-finite {' and '.join(bad)} at this eval: never kept as the best "
                "checkpoint; check val_fn and the weights (a NaN loss here often means NaN "
                "weights)")
    return None


def _lr_change(w: Window, p: dict) -> str | None:
    lr = w.latest.get("lr")
    ref = w.extra.get("lr_reported")
    if lr is None or ref is None or lr <= 0 or ref <= 0:
        return None
    if max(lr / ref, ref / lr) >= p["factor"]:
        return (f"LR changed {ref:.3g} → {lr:.3g}, not by the scheduler or a control (set in "
                f"the loop? pass the scheduler to Monitor to have its changes expected)")
    return None


def _weight_collapse(w: Window, p: dict) -> str | None:
    stds: dict[str, tuple[float, float]] = w.extra.get("weight_std", {})
    fallen = [(n, s0, s) for n, (s0, s) in stds.items()
              if s0 > p["min_start_std"] and s < s0 / p["factor"]]
    if fallen:
        n, s0, s = fallen[0]
        more = f" (and {len(fallen) - 1} more layers)" if len(fallen) > 1 else ""
        return f"weights of {n} collapsed: std {s:.3g}, from {s0:.3g} at the start{more}"
    return None


def _attention_collapse(w: Window, p: dict) -> str | None:
    maps: dict[str, np.ndarray] = w.extra.get("attention", {})
    for module, a in maps.items():  # a: [heads, T, S]
        rows = a[:, p["skip_rows"]:, :]
        if rows.shape[1] < 4:
            continue
        frac = (rows.max(axis=-1) > p["max_weight"]).mean(axis=-1)  # per head
        heads = np.flatnonzero(frac > p["rows"])
        if len(heads):
            return (f"attention of {module} head {int(heads[0])} collapsed: "
                    f"{frac[heads[0]]:.0%} of its rows put > {p['max_weight']} on one token")
    return None


def _straggler(w: Window, p: dict) -> str | None:
    from .distributed import straggler

    found = straggler(w.extra.get("rank_step_times", {}), p["slower"])
    if found:
        r, by = found
        return (f"rank {r} is {by:.0%} slower than the others (median time in data and "
                "forward, outside gradient sync)")
    return None


def _val_periodic(w: Window, p: dict) -> str | None:
    from .diagnostics import val_periodicity

    finding = val_periodicity(w.arr("loss/val"), w.arr("val/seq_len_mean"),
                              min_evals=p["min_evals"], corr=p["corr"])
    return finding.message if finding and finding.cause else None


def default_rules() -> list[Rule]:
    """The built-in rules, thresholds from the seeds (documented in the README)."""
    return [*_base_rules(), *health_rules()]


def _base_rules() -> list[Rule]:
    return [
        Rule("nonfinite", "critical", "grads", _nonfinite,
             {"keys": ("loss/train", "grad_norm/global")},
             ("skip_step", "pause", "checkpoint"), 1,
             "non-finite loss or gradients: skip the step, pause, checkpoint the last good state",
             schema={"keys": Setting("names")}),
        Rule("grad_explosion", "critical", "grads", _grad_explosion,
             {"absolute": 1e5, "factor": 10.0, "window": 200, "min_history": 20, "max_norm": 1.0},
             ("clip",), 50, "global grad norm > 1e5 or > 10× its rolling median: clip at 1.0",
             schema={"absolute": number(0, open_lo=True, inf=True), "factor": number(1),
                     "window": window(not_below="min_history"), "min_history": count(1),
                     "max_norm": POSITIVE}),
        Rule("val_spike", "critical", "eval", _val_spike, {"factor": 2.0, "lr_factor": 0.5},
             ("checkpoint", "cut_lr"), 1, "val loss > 2× the best: checkpoint and cut LR ×0.5",
             schema={"factor": number(1), **ACTION_SETTINGS["cut_lr"]}),
        Rule("nonfinite_val", "critical", "eval", _nonfinite_val, {}, (), 1,
             "a non-finite val loss or val figure: never best, always said"),
        Rule("loss_spike", "warning", "step", _loss_spike,
             {"window": 200, "z": 6.0, "min_history": 50, "batches_before": 4}, (), 10,
             "train loss > 6 robust SDs (1.4826 × MAD) above its rolling median over 200 "
             "steps; the event names the batches of the spike and the 4 steps before",
             schema={"window": window(not_below="min_history"), "z": POSITIVE,
                     "min_history": count(1), "batches_before": count(0, 63)}),
        Rule("vanishing_gradients", "warning", "step", _vanishing,
             {"global_below": 1e-7, "layer_ratio": 1e-3, "persist": 20}, (), 5,
             "global grad norm < 1e-7, or a layer 1000× below the median layer", every=10,
             schema={"global_below": POSITIVE, "layer_ratio": FRACTION,
                     "persist": window()}),
        Rule("throughput_drop", "warning", "step", _throughput_drop,
             {"drop": 0.5, "window": 200, "min_history": 50, "persist": 10}, (), 5,
             "throughput below half its rolling median for 10 steps", every=10,
             schema={"drop": FRACTION, "window": window(not_below="min_history"),
                     "min_history": count(1), "persist": window()}),
        Rule("data_bottleneck", "warning", "step", _data_bottleneck,
             {"share": 0.3, "p90_s": 0.1, "window": 50}, (), 20,
             "data wait > 30% of step time, or its p90 > 0.1 s", every=10,
             schema={"share": number(0, 1, open_lo=True), "p90_s": POSITIVE,
                     "window": window()}),
        Rule("padding", "warning", "step", _padding, {"ratio": 0.5, "window": 50}, (), 20,
             "more than half the tokens are padding", every=10,
             schema={"ratio": number(0, 1, open_hi=True), "window": window()}),
        Rule("attention_collapse", "warning", "attention", _attention_collapse,
             {"max_weight": 0.99, "rows": 0.5, "skip_rows": 4}, (), 2,
             "most rows of a head put > 0.99 of their weight on one token",
             schema={"max_weight": number(0, 1, open_lo=True),
                     "rows": number(0, 1, open_hi=True), "skip_rows": count(0)}),
        Rule("weight_collapse", "warning", "hist", _weight_collapse,
             {"factor": 10.0, "min_start_std": 1e-6}, (), 2,
             "a layer's weight std fell 10× from its start",
             schema={"factor": number(1), "min_start_std": number(0)}),
        Rule("plateau", "warning", "step", _plateau,
             {"window": 1000, "min_change": 0.005}, (), 10,
             "train loss flat (no significant trend, < 0.5% change) over 1000 steps", every=100,
             schema={"window": window(3), "min_change": POSITIVE}),
        Rule("val_periodic", "warning", "eval", _val_periodic,
             {"min_evals": 12, "corr": 0.8}, (), 10**9,
             "val loss oscillates with a period that the val batches' lengths explain",
             schema={"min_evals": count(4), "corr": number(0, 1, open_lo=True)}),
        Rule("straggler", "warning", "ranks", _straggler, {"slower": 0.2}, (), 3,
             "one DDP rank's median step time > 20% above the others'",
             schema={"slower": POSITIVE}),
        Rule("lr_change", "info", "step", _lr_change, {"factor": 2.0}, (), 1,
             "the LR moved 2× from the last reported value, and neither the scheduler nor a "
             "control moved it", schema={"factor": number(1, open_lo=True)}),
    ]


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
    """Feeds observations to the rules of each phase; fires once per episode."""

    def __init__(self, rules: list[Rule], window: int = 1000):
        self.rules = rules
        self._by_phase = {ph: [r for r in rules if r.phase == ph] for ph in PHASES}
        # as long as the longest look-back a rule was given (at most rules.MAX_HISTORY)
        self.window = Window(max([window, *(r.history for r in rules)]))
        # "grads" rules that read named figures (nonfinite: the loss): a loop of the user's
        # own reports its loss after the optimizer step, so these see it at "step"
        self._late = [r for r in self._by_phase["grads"] if "keys" in r.params]
        self._grads_saw: tuple[int, frozenset[str]] | None = None
        self._active: dict[str, bool] = {}
        self._clear: dict[str, int] = {}
        self._lr_reported: float | None = None
        self._lr_explained = False
        self._weight_start: dict[str, float] = {}

    def explain_lr(self) -> None:
        """The LR of the next "step" observation moved as planned (the scheduler stepped, or
        a control scaled it): `lr_change` reports only changes nothing explains."""
        self._lr_explained = True

    def observe(self, phase: str, step: int, values: dict[str, Any] | None = None,
                **extra: Any) -> list[Alert]:
        w = self.window
        fired: list[Alert] = []
        if phase == "grads" and self._late:
            self._grads_saw = (step, frozenset(k for r in self._late for k in r.params["keys"]
                                               if values and k in values))
        elif phase == "step" and values and self._late:
            fired += self._after_step(step, values)
        if values and phase != "grads":  # "step" brings the same figures, complete
            w.add(values)
        elif values:
            w.latest = values
        if phase == "step":
            lr = w.latest.get("lr")
            if (self._lr_reported is None or self._lr_explained) and lr is not None:
                self._lr_reported = lr  # the reference follows a planned change
            self._lr_explained = False
            w.extra = {"lr_reported": self._lr_reported}
        elif phase == "hist":
            stds = extra.get("weight_std", {})
            for n, s in stds.items():
                self._weight_start.setdefault(n, s)
            w.extra = {"weight_std": {n: (self._weight_start[n], s) for n, s in stds.items()}}
        elif extra:
            w.extra = extra
        for rule in self._by_phase[phase]:
            if step % rule.every:
                continue
            msg = rule.check(self.window, rule.params)
            data: dict[str, Any] = {}
            if isinstance(msg, tuple):
                msg, data = msg
            if msg is None:
                if self._active.get(rule.name):
                    self._clear[rule.name] = self._clear.get(rule.name, 0) + 1
                    if self._clear[rule.name] >= rule.clear_steps:
                        self._active[rule.name] = False
                continue
            self._clear[rule.name] = 0
            if self._active.get(rule.name) and rule.name != "lr_change":
                continue
            self._active[rule.name] = True
            if rule.name == "lr_change":
                self._lr_reported = w.latest.get("lr")
            fired.append(Alert(rule, step, msg, data))
        return fired


    def _after_step(self, step: int, values: dict[str, Any]) -> list[Alert]:
        """The "grads" rules that read a figure the step's "grads" observation lacked and
        its "step" one has (a loss reported by `mon.log` after the optimizer step): they
        fire now (the step is applied: it cannot be skipped any more); their quiet checks
        do not count towards re-arming, which their "grads" observations do."""
        saw = self._grads_saw
        if saw is None or saw[0] != step:
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
