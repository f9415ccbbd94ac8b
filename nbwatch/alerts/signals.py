"""The training signals: each built-in rule's check (pure: a window of recent figures and
the rule's settings in, a message or None out) and the default rule set. The engine that
turns them into alerts is in `engine.py`; the Transformer-health rules are in `health.py`."""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np

from .health import rules as health_rules
from .rules import (
    ACTION_SETTINGS,
    FRACTION,
    POSITIVE,
    Rule,
    Setting,
    Window,
    _median,
    count,
    number,
    percentile,
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
        if skips and w.extra.get("skip") == "zeroed":  # fused=True: an optimizer that has it
            exact = "; fused=True skips such a step exactly" if w.extra.get("fusable") else ""
            return (f"non-finite {' and '.join(bad)} at this step: its gradients were zeroed "
                    "on the device, so the weights stay finite (this optimizer takes no "
                    f"found_inf: its momentum and weight decay still moved them once{exact})")
        if skips:
            return f"non-finite {' and '.join(bad)} at this step: step skipped, weights untouched"
        return (f"non-finite {' and '.join(bad)} at this step: the step was APPLIED (skip_step "
                "is not among this rule's actions), so the weights may now be non-finite")
    return None


def _grad_explosion(w: Window, p: dict) -> str | None:
    g = w.latest.get("grad_norm/global")
    if g is None or not math.isfinite(g):
        return None
    # the limit its step was clipped against on the device (AlertEngine.observe's)
    limit = p[USED_LIMIT]
    if not g > limit:
        return None
    if g > p["absolute"] or limit >= p["absolute"]:
        return f"gradient norm {g:.3g} above {p['absolute']:.0e}"
    med = limit / p["factor"]
    floor = _FLOOR["grad_norm/global"] * (w.extra.get("start") or {}).get("grad_norm/global", 0)
    what = (f"its floor {med:.3g} (1e-4 of the run's first norm, above its rolling median)"
            if math.isclose(med, floor, rel_tol=1e-9) else f"its rolling median {med:.3g}")
    return f"gradient norm {g:.3g} is {g / med:.0f}× {what}"


USED_LIMIT = "_norm_limit"  # a clipping rule's params at its check: the limit its step used


def _explosion_limit(w: Window, p: dict) -> float:
    """The norm above which `_grad_explosion` fires: `absolute`, or `factor` × the median."""
    med, n = w.median("grad_norm/global", p["window"])
    if n >= p["min_history"] and med > 0:
        # not below factor × 1e-4 of the run's first norm: a converged run's float noise
        start = (w.extra.get("start") or {}).get("grad_norm/global", 0.0)
        return min(p["absolute"], p["factor"] * max(med, _FLOOR["grad_norm/global"] * start))
    return p["absolute"]


# The noise a spike is measured against is at least this share of the run's first level
# (`AlertEngine.start`): a loss converged 1e8× below its start, a norm 1e4×, is float
# noise there; a run converged less far keeps its spikes (an MSE run at 1e-4 of its start
# that jumps 5× still fires).
_FLOOR = {"loss/train": 1e-6, "grad_norm/global": 1e-4}


def _above_level(w: Window, key: str, p: dict) -> tuple[float, float, float, float, int] | None:
    """(value, z, level, scale, steps): how far the newest `key` stands above its level
    (the median of the `recent` steps before it) in robust SDs: 1.4826 × the MAD of the
    `window` steps before it around their trend line (`Window.detrended_mad`: a falling
    loss's descent is no noise), floored at 0.1% of the level so that a flat series'
    last-digit noise is no spike, and at `_FLOOR` of the run's first level so that a run
    converged to its float noise is none either. None at or below the level, or before
    `min_history`."""
    v = w.latest.get(key)
    if v is None or not math.isfinite(v):  # non-finite: the nonfinite rule's
        return None
    level, mad, n = w.detrended_mad(key, p["window"], p["recent"])  # MAD: every 10 steps
    if n < p["min_history"] or not v > level:
        return None
    start = (w.extra.get("start") or {}).get(key, 0.0) * _FLOOR.get(key, 0.0)
    scale = 1.4826 * max(mad, 1e-3 * abs(level), abs(start), 1e-12)
    return v, (v - level) / scale, level, scale, n


def _loss_spike(w: Window, p: dict) -> tuple[str, dict[str, Any]] | None:
    found = _above_level(w, "loss/train", p)
    if found is None or found[1] <= p["z"]:
        return None
    loss, z, level, scale, n = found
    return (f"train loss {loss:.4g} spiked: z = {z:.1f} above the median {level:.4g} of the "
            f"last {p['recent']} steps (robust SD {scale:.3g} around the trend of the last "
            f"{n})",
            {"loss": loss, "median": level, "mad": scale / 1.4826, "z": z})


def _grad_norm_spike(w: Window, p: dict) -> tuple[str, dict[str, Any]] | None:
    found = _above_level(w, "grad_norm/global", p)
    if found is None or found[1] <= p["z"] or not found[2] > 0:
        return None
    g, z, level, scale, n = found
    if g <= p["factor"] * level:
        return None
    return (f"gradient norm {g:.3g} spiked: {g / level:.1f}× the median {level:.3g} of the "
            f"last {p['recent']} steps, z = {z:.1f} (robust SD {scale:.3g} around the trend of "
            f"the last {n}); "
            "gradient spikes often come before loss spikes: watch the loss, consider a lower "
            "LR or clipping",
            {"grad_norm": g, "median": level, "mad": scale / 1.4826, "z": z})


# the figure names last seen, and the per-layer gradient norms among them (one entry,
# replaced whole: an engine on another thread reads either the old entry or the new one)
_LAYERS: tuple[tuple[str, ...], list[str]] = ((), [])


def _layers(latest: dict[str, Any]) -> list[str]:
    """The per-layer gradient norms among `latest`'s figures, in their order; a step brings
    the same figures as the last one, so their names are picked once."""
    global _LAYERS
    keys, last = tuple(latest), _LAYERS
    if keys != last[0]:
        last = _LAYERS = keys, [k for k in keys if k.startswith("grad_norm/")
                                and k not in ("grad_norm/global", "grad_norm/clipped")]
    return list(last[1])


def _vanishing(w: Window, p: dict) -> str | None:
    # Each condition must hold at the newest step first: checked on it alone (O(layers)),
    # the look-back over `persist` steps runs only when it does.
    latest = w.latest
    g_now = latest.get("grad_norm/global")
    if g_now is not None and g_now < p["global_below"]:
        g = w.arr("grad_norm/global", p["persist"])
        if len(g) >= p["persist"] and np.all(g < p["global_below"]):
            return f"global gradient norm below {p['global_below']:.0e} for {p['persist']} steps"
    layers = _layers(latest)
    if len(layers) < 3:
        return None
    vals = [latest[k] for k in layers]
    if set(map(type, vals)) == {float} and math.isfinite(sum(vals)):
        # the common case, in plain Python (the same figures as numpy's: a few dozen values
        # cost less than the array)
        srt = sorted(vals)
        h = len(srt) // 2
        m = max(srt[h] if len(srt) % 2 else (srt[h - 1] + srt[h]) / 2, 1e-30)
        ratio = p["layer_ratio"]
        if not any(v / m < ratio for v in vals):
            return None
    else:
        now = np.array(vals, dtype=np.float64)
        if not (now / max(_median(now), 1e-30) < p["layer_ratio"]).any():
            return None
    # a layer's series skips the steps it had no gradient at: all must reach `persist`
    series = [w.arr(k, p["persist"]) for k in layers]
    if any(len(a) < p["persist"] for a in series):
        return None
    recent = np.stack(series)  # [layers, steps]
    med = np.median(recent, axis=0)
    ratio = recent / np.maximum(med, 1e-30)
    low = np.all(ratio < p["layer_ratio"], axis=1)
    if low.any():
        # and not growing out of it: a layer that starts below the others by design (LoRA's
        # A, whose gradient is B's, zero at init; anything after a zero-initialised layer)
        # climbs; a vanishing one stays down. Climbing: its own norm's last third's median
        # more than twice its first third's (its own: the others fall early in training)
        t = max(p["persist"] // 3, 1)
        first, last = np.median(recent[:, :t], axis=1), np.median(recent[:, -t:], axis=1)
        low &= ~(last > 2 * first)
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
    s = w.series.get(key)
    n, persist = min(len(s) if s else 0, p["window"] + p["persist"]), p["persist"]
    if n < p["min_history"] + persist:
        return None
    # Quiet unless every recent value is below (1 - drop) × the median before them, which is
    # at most their maximum: one recent value at or above (1 - drop) × that maximum (the
    # common case) settles it without the array and its median. Only when the values
    # before are all finite (their sum is: a NaN has no place in a maximum), and below
    # half the largest float (the median's mean of two cannot overflow).
    tail = list(itertools.islice(reversed(s), n)) if s else []
    before = tail[persist:]
    if before and math.isfinite(sum(before)) and (top := max(before)) < 8e307:
        cut = (1 - p["drop"]) * top
        if not all(v < cut for v in tail[:persist]):
            return None
    a = w.arr(key, p["window"] + p["persist"])
    base = _median(a[-p["window"] - p["persist"]:-p["persist"]])
    recent = a[-p["persist"]:]
    if base > 0 and np.all(recent < (1 - p["drop"]) * base):
        return (f"throughput fell to {np.median(recent):,.0f} {key.split('/')[1]} "
                f"from a median of {base:,.0f} ({1 - np.median(recent) / base:.0%} drop)")
    return None


def _data_bottleneck(w: Window, p: dict) -> str | None:
    data = w.arr("time/data", p["window"])
    if len(data) < p["window"]:
        return None
    share = data.sum() / max(w.arr("time/step", p["window"]).sum(), 1e-12)
    if share > p["share"]:
        return f"the step waits on the data loader {share:.0%} of the time"
    p90 = percentile(data, 90)
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
    xc = x - x.mean()
    slope = float(xc @ (a - a.mean())) / float(xc @ xc)  # least squares, as np.polyfit(x, a, 1)
    intercept = a.mean() - slope * x.mean()
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
    # one step's jump, not a schedule's drift (a hand-written cosine moves the LR 10× over a
    # run, a few % a step); nor a warm-up's rise (the LR risen at every step so far), nor a
    # decay's last steps to 0 (2× and more a step, each move at most 3× the one before, in
    # log, the same way as the 3 steps before)
    lr = w.latest.get("lr")
    ref = w.extra.get("lr_before")
    if lr is None or ref is None or lr <= 0 or ref <= 0:
        return None
    way, steps, size = w.extra.get("lr_trend", (0, 0, 0.0))
    if (lr > ref and w.extra.get("lr_rising", False)) or (
            steps >= 3 and way == (lr > ref) - (lr < ref)
            and abs(math.log(lr / ref)) <= 3 * size):
        return None
    if max(lr / ref, ref / lr) >= p["factor"]:
        return (f"LR changed {ref:.3g} → {lr:.3g} in one step, not by the scheduler or a "
                "control (set in the loop? pass its scheduler to Monitor to have its changes "
                'expected, or turn this off: alerts={"lr_change": False})')
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


def straggler(step_times: dict[int, float], slower: float = 0.2, step: float = 0.0,
              share: float = 0.05) -> tuple[int, float] | None:
    """(rank, how much slower) when one rank's median time exceeds the others' by more than
    `slower` (0.2 = 20%) and by `share` of the step (`step`: its median; ms of host time
    apart cost nothing, are noise), from the recorder's exchange (no torch.distributed)."""
    if len(step_times) < 2:
        return None
    r = max(step_times, key=lambda k: step_times[k])
    base = float(np.median([t for k, t in step_times.items() if k != r]))
    ok = base > 0 and step_times[r] > (1 + slower) * base and step_times[r] - base >= share * step
    return (r, step_times[r] / base - 1) if ok else None


def _straggler(w: Window, p: dict) -> str | None:
    found = straggler(w.extra.get("rank_step_times", {}), p["slower"],
                      w.extra.get("step_time", 0.0), p["share"])
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


# loss_spike and grad_norm_spike: the level from the `recent` steps before, the noise from
# the `window` steps before (around their trend line)
_SPIKE_SCHEMA = {"window": window(not_below="min_history"), "recent": window(), "z": POSITIVE,
                 "min_history": count(1), "batches_before": count(0, 63)}


def default_rules() -> list[Rule]:
    """The built-in rules, thresholds from the seeds (documented in the README)."""
    return [*_base_rules(), *health_rules()]


def _base_rules() -> list[Rule]:
    return [
        Rule("nonfinite", "critical", "grads", _nonfinite,
             {"keys": ("loss/train", "grad_norm/global")},
             ("skip_step", "pause", "checkpoint"), 1,
             "non-finite loss or gradients: skip the step, pause, checkpoint the last good state",
             schema={"keys": Setting("names")}, same_on_every_rank=True),
        Rule("grad_explosion", "critical", "grads", _grad_explosion,
             {"absolute": 1e5, "factor": 10.0, "window": 200, "min_history": 20, "max_norm": 1.0},
             ("clip",), 50, "global grad norm > 1e5 or > 10× its rolling median: clip at 1.0",
             schema={"absolute": number(0, open_lo=True, inf=True), "factor": number(1),
                     "window": window(not_below="min_history"), "min_history": count(1),
                     "max_norm": POSITIVE}, same_on_every_rank=True,
             spike_of="grad_norm/global", norm_limit=_explosion_limit),
        Rule("val_spike", "critical", "eval", _val_spike, {"factor": 2.0, "lr_factor": 0.5},
             ("checkpoint", "cut_lr"), 1, "val loss > 2× the best: checkpoint and cut LR ×0.5",
             schema={"factor": number(1), **ACTION_SETTINGS["cut_lr"]}),
        Rule("nonfinite_val", "critical", "eval", _nonfinite_val, {}, (), 1,
             "a non-finite val loss or val figure: never best, always said"),
        Rule("loss_spike", "warning", "step", _loss_spike,
             {"window": 200, "recent": 10, "z": 6.0, "min_history": 50, "batches_before": 4},
             (), 10,
             "train loss > 6 robust SDs above the median of the 10 steps before (1.4826 × the "
             "MAD around the trend line of the 200 steps before); the event names the batches "
             "of the spike and the 4 steps before",
             schema=_SPIKE_SCHEMA, spike_of="loss/train"),
        Rule("grad_norm_spike", "warning", "step", _grad_norm_spike,
             {"window": 200, "recent": 10, "z": 6.0, "factor": 4.0, "min_history": 50,
              "batches_before": 4}, (), 10,
             "global grad norm (before clipping) > 6 robust SDs above the median of the 10 steps "
             "before (as loss_spike measures) and > 4× that median; the event names the "
             "batches of the spike and the 4 steps before",
             schema={**_SPIKE_SCHEMA, "factor": number(1)}, spike_of="grad_norm/global"),
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
        Rule("straggler", "warning", "ranks", _straggler, {"slower": 0.2, "share": 0.05}, (),
             3, "one DDP rank's median step time > 20% above the others'",
             schema={"slower": POSITIVE, "share": POSITIVE}),
        Rule("lr_change", "info", "step", _lr_change, {"factor": 2.0}, (), 1,
             "the LR moved 2× in one step, and neither the scheduler nor a control moved it "
             "(a warm-up, risen at every step so far, or a decay under way, excepted)",
             schema={"factor": number(1, open_lo=True)}, repeats=True),
    ]
