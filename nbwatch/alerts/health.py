"""Transformer health: the early signs of a loss spike or divergence, and the rules that
watch them: from the eval-time probe pass (attention, the residual stream, the output
log-partition on fixed probe samples), and the training batch's log Z every step
(`probes/logits.py`)."""

from __future__ import annotations

import itertools
import math

import numpy as np

from .rules import FRACTION, POSITIVE, Rule, Window, count, number, window

ENTROPY = "attn/entropy/"      # + module: mean over heads; + module/head: one head
MAX_LOGIT = "attn/max_logit/"  # + module: max over heads; + module/head: one head
RMS = "act/rms/"               # + block: RMS of the block's output (the residual stream)
STEP_LOG_Z = "train_logits/log_z"  # the training batch's, every step (probes.logits.LOG_Z)


def figures(entropy: dict[str, np.ndarray], max_logit: dict[str, np.ndarray],
            rms: dict[str, float], logits: dict[str, float]) -> dict[str, float]:
    """The probe pass's health figures as scalar names (what the store, the panel and the
    rules read)."""
    out: dict[str, float] = {}
    for prefix, per_head, reduce in ((ENTROPY, entropy, np.nanmean),
                                     (MAX_LOGIT, max_logit, np.nanmax)):
        for module, heads in per_head.items():
            heads = np.asarray(heads, dtype=np.float64)
            if heads.size and np.isfinite(heads).any():
                out[prefix + module] = float(reduce(heads))
            for h, v in enumerate(heads.tolist()):
                if math.isfinite(v):
                    out[f"{prefix}{module}/{h}"] = v
    out.update({RMS + block: v for block, v in rms.items()})
    out.update(logits)
    return out


def per_head(key: str) -> bool:
    """`attn/<figure>/<module>/<head>`: one head's figure (not the module's summary)."""
    return key.startswith((ENTROPY, MAX_LOGIT)) and key.rsplit("/", 1)[-1].isdigit()


# -- the checks (pure: window + params → message or None); the window's series of these
# figures has one value per probe pass
def _entropy_collapse(w: Window, p: dict) -> str | None:
    fallen = []
    for key in w.latest:
        if not (key.startswith(ENTROPY) and per_head(key)):
            continue
        a = w.arr(key)
        early, now = (float(a[0]), float(a[-1])) if len(a) >= 2 else (math.nan, math.nan)
        if early >= p["min_early"] and now < p["fraction"] * early:
            fallen.append((now / early, key[len(ENTROPY):], early, now))
    if not fallen:
        return None
    _, head, early, now = min(fallen)
    module, h = head.rsplit("/", 1)
    more = f" (and {len(fallen) - 1} more heads)" if len(fallen) > 1 else ""
    return (f"attention entropy of {module} head {h} fell to {now:.2f} nats from {early:.2f} "
            f"at the first probe{more}: the head attends to one token; entropy collapse "
            "comes before loss spikes (Zhai et al. 2023): lower the LR, add QK-norm")


def _logit_growth(w: Window, p: dict) -> str | None:
    """A module's largest attention logit rose at each of the last `probes` probes and
    grew `factor`× over them, from at least `min_logit`, no slower in the second half of
    those probes than in the first: a sustained growth that is not settling, relative to
    the run's own history. A healthy run's logits grow from their small initial scale over
    its first probes and slow down (a 12 × 12 GPT-2 went 10.6 → 31.1 at a falling rate),
    or peak and come down (the demo's peaked at 51 and settled at 36): a level alone, one
    rise, or a rise that slows is no sign."""
    n = p["probes"]
    grown = []
    for key in w.latest:
        if not key.startswith(MAX_LOGIT) or per_head(key):
            continue
        a = w.arr(key)
        if len(a) <= n:
            continue
        last = a[-(n + 1):]
        mid = last[n // 2]
        if (np.all(np.diff(last) > 0) and last[0] >= p["min_logit"]
                and last[-1] >= p["factor"] * last[0]
                and last[-1] / mid >= mid / last[0]):
            grown.append((float(last[-1] / last[0]), key[len(MAX_LOGIT):], float(last[0]),
                          float(last[-1])))
    if not grown:
        return None
    ratio, module, before, now = max(grown)
    more = f" (and {len(grown) - 1} more modules)" if len(grown) > 1 else ""
    return (f"attention logits of {module} rose at each of the last {n} probes, {ratio:.1f}× "
            f"from {before:.3g} to {now:.3g}{more}: if this goes on, a head's softmax turns "
            "one-hot and a loss spike or divergence can follow (Wortsman et al. 2023); lower "
            "the LR, or add QK-layernorm")


def _output_drift(w: Window, p: dict) -> str | None:
    a = w.arr("logits/z_mean")
    if len(a) < 2 or not math.isfinite(a[-1]):
        return None
    early, now = float(a[0]), float(a[-1])
    if abs(now - early) > p["nats"]:
        return (f"the output log-partition log Z drifted to {now:.3g} from {early:.3g} at the "
                f"first probe (by more than {p['nats']:g} nats): the output logits grow; a "
                "z-loss (PaLM: 1e-4 · log²Z) holds them")
    return None


# -- a check on every training step's figures
def _logz_drift(w: Window, p: dict) -> tuple[str, dict] | None:
    s = w.series.get(STEP_LOG_Z)
    if not s or len(s) < p["min_history"] + p["recent"]:
        return None
    # the level now: the median of the last few steps (one batch's log Z is noisy)
    recent = sorted(v for v in itertools.islice(reversed(s), p["recent"]) if math.isfinite(v))
    if not recent:
        return None
    now = recent[len(recent) // 2]
    base, mad, n = w.mad(STEP_LOG_Z, p["window"])  # the steps before: every 10 steps
    if n < p["min_history"] or not math.isfinite(base):
        return None
    rise = now - base
    scale = 1.4826 * mad
    if rise <= p["nats"] or rise <= p["z"] * scale:
        return None
    z = rise / scale if scale > 0 else math.inf
    return (f"the training batch's log Z rose to {now:.3g} (median of the last {p['recent']} "
            f"steps) from {base:.3g} over the {n} steps before: +{rise:.2g} nats, {z:.1f} "
            "robust SD; the output logits grow, and a loss spike often follows: lower the LR, "
            "or add a z-loss (PaLM 1e-4 · log²Z, OLMo 2 1e-5)",
            {"log_z": now, "baseline": base, "rise": rise, "z": z})


def rules() -> list[Rule]:
    """The health rules, appended to `alerts.default_rules()`: those of the probe pass
    (phase "eval") cost nothing on a training step; `logz_drift` reads the step's own
    log Z (a median of a few values a step, the baseline's every 10)."""
    return [
        Rule("attention_entropy_collapse", "warning", "eval", _entropy_collapse,
             {"fraction": 0.2, "min_early": 0.5}, (), 1,
             "a head's attention entropy fell below 20% of its value at the first probe",
             schema={"fraction": FRACTION, "min_early": number(0)}),
        Rule("attention_logit_growth", "warning", "eval", _logit_growth,
             {"probes": 4, "factor": 2.0, "min_logit": 10.0}, (), 1,
             "a module's largest pre-softmax attention logit rose at each of the last 4 "
             "probes, doubled over them from 10 or more, and did not slow",
             schema={"probes": count(2, 50), "factor": number(1, open_lo=True),
                     "min_logit": number(0)}),
        Rule("output_logit_drift", "warning", "eval", _output_drift, {"nats": 10.0}, (), 1,
             "the LM head's mean log-partition moved 10 nats from the first probe",
             schema={"nats": POSITIVE}),
        Rule("logz_drift", "warning", "step", _logz_drift,
             {"recent": 5, "window": 100, "min_history": 20, "z": 4.0, "nats": 1.0}, (), 50,
             "the training batch's log Z (median of the last 5 steps) rose above the median "
             "of the 100 steps before by more than 1 nat and 4 robust SD",
             schema={"recent": count(1, 50), "window": window(not_below="min_history"),
                     "min_history": count(5), "z": POSITIVE, "nats": POSITIVE}),
    ]
