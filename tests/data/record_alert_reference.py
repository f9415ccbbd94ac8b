"""Record what the alert engine fires on the healthy fixture and on a perturbed copy of it.

    PYTHONPATH=. python tests/data/record_alert_reference.py tests/data/alert_reference.json

The perturbed copy (`perturbed`) injects loss and grad-norm spikes, a gradient explosion,
non-finite figures (in the "grads" phase and reported after the step), a throughput drop,
a vanishing layer, a data bottleneck, padding, unexplained LR moves, a plateau, a rising
log Z, a collapsed layer's weights, a val spike, a NaN val loss and a collapsed attention
head, so that most rules fire; custom rules (every 3 and 7 steps) read figures through the
Window's median, MAD, detrended MAD, arr and series. `replay` feeds both runs through every
phase, as tests/test_alerts_healthy.py does, and returns each alert's (rule, step, message,
data), the spike figures the engine added, and a digest of the window's series.

The reference was recorded with main's engine before the engine's per-step work was cut
(issue 23); tests/test_alerts_replay_equal.py asserts that the engine still gives it
exactly.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

from nbwatch.alerts import AlertEngine, Rule, Window, default_rules

FIXTURE = Path(__file__).parent / "healthy_demo.npz"
VAL_KEYS = ("loss/val", "loss/gap", "time/eval")
LOG_Z = "train_logits/log_z"


def _custom_median(w: Window, p: dict) -> str | None:
    med, n = w.median("time/step", 30)
    t = w.latest.get("time/step")
    if t is not None and n >= 30 and t > 1.3 * med:
        return f"step time {t!r} vs median {med!r} of {n}"
    return None


def _custom_mad(w: Window, p: dict) -> str | None:
    med, mad, n = w.mad("grad_norm/blocks.0.ln1", 40)
    v = w.latest.get("grad_norm/blocks.0.ln1")
    if v is not None and n >= 40 and v > med + 4 * mad:
        return f"ln1 {v!r} over {med!r} + 4 × {mad!r} ({n}); tokens {w.arr('tokens/real', 3)!r}"
    return None


def _custom_detrended(w: Window, p: dict) -> tuple[str, dict[str, Any]] | None:
    level, mad, n = w.detrended_mad("time/compute", 60, recent=7, refresh=5)
    v = w.latest.get("time/compute")
    if v is not None and n >= 60 and v > level + 8 * 1.4826 * mad:
        return f"compute {v!r} above {level!r}", {"mad": mad, "n": n}
    return None


def _custom_series(w: Window, p: dict) -> str | None:
    s = w.series.get("epoch")
    if s is not None and len(s) % 997 == 0:
        kept = sorted(k for k in ("custom/int", "custom/bool", "custom/f32", "custom/str",
                                  "custom/f64") if k in w.series)
        return (f"{len(s)} epochs in the window, last {list(s)[-2:]!r}; series kept: {kept}; "
                f"int tail {w.arr('custom/int', 2).tolist()!r}; adds {w.adds}")
    return None


def custom_rules() -> list[Rule]:
    return [
        Rule("custom_median", "info", "step", _custom_median, every=7, clear_steps=3),
        Rule("custom_mad", "info", "step", _custom_mad, every=3, clear_steps=2),
        Rule("custom_detrended", "info", "step", _custom_detrended, repeats=True),
        Rule("custom_series", "info", "grads", _custom_series, every=1),
    ]


def load() -> dict[str, Any]:
    d = np.load(FIXTURE)
    return {k: d[k] for k in d.files}


def perturbed(d: dict[str, Any]) -> dict[str, Any]:
    """The fixture with its faults (see the module's doc)."""
    d = {k: np.array(v) for k, v in d.items()}
    cols = list(d["columns"])
    s = d["scalars"].astype(np.float64)
    c = {n: cols.index(n) for n in cols}
    i = np.arange(len(s))
    loss, g = c["loss/train"], c["grad_norm/global"]
    s[1500, loss] *= 3
    s[3200, loss] *= 2.5
    s[2000, g] *= 8
    s[2600, g] *= 50
    s[3000, g] = 1e6
    s[2700, loss] = np.nan
    s[2750, g] = np.inf
    s[3505, loss] = np.nan
    for k in ("throughput/tokens_per_s", "throughput/samples_per_s"):
        s[4000:4040, c[k]] *= 0.3
    s[4100:4150, c["grad_norm/blocks.1.mlp.fc"]] *= 1e-5
    s[4200:4260, c["time/data"]] = 0.6 * s[4200:4260, c["time/step"]]
    s[4300:4360, c["data/padding_ratio"]] = 0.8
    s[4400, c["lr"]] *= 3
    s[3800:, loss] = 2.0 + 0.01 * np.sin(i[3800:] * 0.7)
    s[4600, loss] = 4.0
    s[4650:4656, c["time/step"]] *= 2
    s[4450, c["grad_norm/blocks.0.ln1"]] *= 20
    s[4460:4470, c["time/compute"]] *= 3
    logz = 5.0 + 0.05 * np.sin(i * 1.3)
    logz[4700:] += 3.0
    d["columns"] = np.array([*cols, LOG_Z])
    d["scalars"] = np.concatenate([s, logz[:, None]], axis=1)
    d["weight_std"] = d["weight_std"].astype(np.float64)
    d["weight_std"][-5:, 3] /= 100
    val = d["scalars"][:, c["loss/val"]]
    evals = np.flatnonzero(~np.isnan(val))
    val[evals[12]] *= 3
    val[evals[15]] = np.nan
    d["nan_val_at"] = evals[15]
    att = d["attention"].copy()
    att[3, 1, 2] = 0
    att[3, 1, 2, :, 0] = 255
    d["attention"] = att
    return d


def replay(d: dict[str, Any], rules: list[Rule]) -> dict[str, Any]:
    cols = list(d["columns"])
    eng = AlertEngine(rules)
    hist = {int(s): i for i, s in enumerate(d["hist_steps"])}
    att = {int(s): i for i, s in enumerate(d["attention_steps"])}
    layers, modules = list(d["hist_layers"]), list(d["attention_modules"])
    nan_val = int(d["steps"][d["nan_val_at"]]) if "nan_val_at" in d else None
    fired, spikes = [], []
    for j, (step, row) in enumerate(zip(d["steps"].tolist(), d["scalars"])):
        # a NaN loss is a figure (the nonfinite rule's); another NaN: not recorded
        values: dict[str, Any] = {n: float(v) for n, v in zip(cols, row)
                                  if not np.isnan(v) or n == "loss/train"}
        val = {k: values.pop(k) for k in VAL_KEYS if k in values}
        if step == nan_val:
            val["loss/val"] = math.nan
        if "nan_val_at" in d:
            values.update({"custom/int": step, "custom/bool": step % 2 == 0,
                           "custom/f32": np.float32(step), "custom/str": "x",
                           "custom/f64": np.float64(step) / 2})
        grads = dict(values)
        if 3500 <= j < 3510:  # the loop reports its loss after the optimizer step
            grads.pop("loss/train", None)
        fired += eng.observe("grads", step, grads)
        if not 4400 <= j <= 4401:
            eng.explain_lr()
        fired += eng.observe("step", step, values)
        spikes.append([step, {k: v for k, v in values.items() if k.startswith("spike/")}])
        if step in hist:
            stds = dict(zip(layers, d["weight_std"][hist[step]].tolist()))
            fired += eng.observe("hist", step, weight_std=stds)
        if val:
            fired += eng.observe("eval", step, val)
        if step in att:
            maps = {m: d["attention"][att[step], k] / 255.0 for k, m in enumerate(modules)}
            fired += eng.observe("attention", step, attention=maps)
    window = {k: [len(s), math.fsum(v for v in s if math.isfinite(v)), list(s)[-3:]]
              for k, s in sorted(eng.window.series.items())}
    score = [[st, sp] for st, sp in spikes if set(sp) != {"spike/score"}]
    return {"alerts": [[a.rule.name, a.step, a.message, a.data] for a in fired],
            "spike_steps": score, "final_score": spikes[-1][1], "window": window,
            "window_latest": sorted(eng.window.latest), "window_adds": eng.window.adds}


def reference() -> dict[str, Any]:
    healthy = load()
    bad = perturbed(healthy)
    out = {"healthy": replay(healthy, default_rules()),
           "perturbed": replay(bad, default_rules() + custom_rules())}
    return json.loads(json.dumps(out))  # as the file holds it (tuples → lists)


if __name__ == "__main__":
    Path(sys.argv[1]).write_text(json.dumps(reference(), indent=1) + "\n")
