"""A post-mortem of each loss spike: what moved first, and how long before. Pure functions
over the recorded series and events, so a reopened run (or an export) says what the live
one would.

For a `loss_spike` alert at step S, over the steps [S - 20, S] (`LOOKBACK`):

- a layer's gradient norm *rose* at the first step where it stood above k × (default 3)
  the median of its `BASELINE` (50) steps before, and 3 robust SDs above it in log space
  (1.4826 × the MAD of the log norms: a LayerNorm's gradient norm swings 4× from batch to
  batch in a healthy run, and is no news at 4×); `first_layers` are the layers that rose
  earliest (at most 3; ties: the larger ratio first). `grad_rose` is the same for the
  global gradient norm; `loss_rose` the first step where the loss stood 3 robust SDs
  (1.4826 × MAD) above the median of its 50 steps before; `log_z_rose` the same for the
  training batch's log Z (`train_logits/log_z`, where the run records it: the output
  logits growing);
- `first_updates`: the same test as the layers' gradient norms on their update ratios
  (`update_ratio/<layer>`, ‖ΔW‖/‖W‖), where the run records them every step
  (`update_every=1`: a value at 90% of the window's steps at least); the layers whose
  update ratio rose earliest (at most 3). None where the ratios are sparse (with the
  histograms, every 50 steps): they are not looked at, and the post-mortem is the same as
  without them;
- `grad_z`: the global gradient norm at S, in SDs above the mean of the 128 steps before
  (the spike score's measure, `spike_score.py`);
- `lr` at S and `lr_change`: the LR's last move up to S, a step where it moved by more
  than 1% from the step before (a cut), or a run of such steps in one direction (a
  warm-up, a ramp): {step (its first), steps, from, to};
- `alerts_before`: every other rule that fired in the 500 steps up to S, the newest
  time of each, and how many steps before S;
- `first`: the signals (a layer's `grad_norm/<layer>` or `update_ratio/<layer>`,
  `grad_norm/global`, `loss/train`, `train_logits/log_z`, a rule's name) that moved at
  the earliest of those steps, and `lead`, S minus that step.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import pandas as pd

from .spike_score import WINDOW

LOOKBACK = 20
BASELINE = 50
K = 3.0
LOG_Z = 3.0
LOSS_Z = 3.0
LR_MOVE = 0.01
ALERT_LOOKBACK = 500
MAX_LAYERS = 3
SPIKE_RULE = "loss_spike"
LOG_Z_KEY = "train_logits/log_z"  # probes.logits.LOG_Z (this module reads, never probes)
UPDATE = "update_ratio/"
DENSE = 0.9  # update ratios looked at where present at this share of the window's steps
_NOT_LAYERS = ("grad_norm/global", "grad_norm/clipped")

SPIKE_COLUMNS = ["step", "loss", "median", "z", "batches", "first", "lead", "first_layers",
                 "first_updates", "grad_z", "grad_rose", "loss_rose", "log_z_rose", "lr",
                 "lr_change", "alerts_before"]

# a frame of the recorded scalars: (keys, start, stop) → rows start <= step < stop
Scalars = Callable[[list[str], int, int], pd.DataFrame]


def layer_keys(keys: Iterable[str]) -> list[str]:
    """The per-layer gradient-norm series among `keys`."""
    return [k for k in keys if k.startswith("grad_norm/") and k not in _NOT_LAYERS]


def update_keys(keys: Iterable[str]) -> list[str]:
    """The per-layer update-ratio series among `keys`."""
    return [k for k in keys if k.startswith(UPDATE)]


def _dense(s: pd.Series, spike: int, lookback: int) -> bool:
    """Whether `s` holds a value at `DENSE` of the recorded steps in [spike - lookback,
    spike] (every step, give or take a skipped one), not only at histogram steps."""
    window = s[(s.index >= spike - lookback) & (s.index <= spike)]
    return len(window) > 0 and int(window.notna().sum()) >= DENSE * len(window)


def _earliest(frame: pd.DataFrame, keys: list[str], prefix: str, spike: int, lookback: int,
              baseline: int, k: float) -> list[tuple[int, float, str]]:
    """(step, -ratio, layer) of each series among `keys` that rose (`_ratio_rise`),
    earliest first (ties: the larger ratio first)."""
    rises = []
    for key in keys:
        r = _ratio_rise(frame[key], spike, lookback, baseline, k)
        if r is not None:
            rises.append((r[0], -r[1], key.removeprefix(prefix)))
    return sorted(rises)


def _ratio_rise(s: pd.Series, spike: int, lookback: int, baseline: int, k: float
                ) -> tuple[int, float] | None:
    """(step, ratio): the first step in [spike - lookback, spike] where `s` stood above
    k × the median of its `baseline` steps before, and `LOG_Z` robust SDs above it in log
    space (its own noise)."""
    s = s.where(s > 0)
    low = max(5, baseline // 5)
    log = np.log(s)
    log_med = log.rolling(baseline, min_periods=low).median().shift(1)
    log_mad = (log - log_med).abs().rolling(baseline, min_periods=low).median().shift(1)
    ratio = np.exp(log - log_med)  # s over the median of the steps before
    z = (log - log_med) / (1.4826 * np.maximum(log_mad, 1e-6))
    near = (s.index >= spike - lookback) & (s.index <= spike)
    hit = ratio[near & (ratio > k) & (z > LOG_Z) & np.isfinite(ratio)]
    return (int(hit.index[0]), float(hit.iloc[0])) if len(hit) else None


def _z_rise(s: pd.Series, spike: int, lookback: int, baseline: int, z: float) -> int | None:
    """The first step in [spike - lookback, spike] where `s` stood `z` robust SDs above the
    median of its `baseline` steps before."""
    roll = s.rolling(baseline, min_periods=max(5, baseline // 5))
    med = roll.median().shift(1)
    mad = (s - med).abs().rolling(baseline, min_periods=max(5, baseline // 5)).median()
    scale = 1.4826 * np.maximum(mad.shift(1), 1e-3 * med.abs())
    zs = ((s - med) / scale)[(s.index >= spike - lookback) & (s.index <= spike)]
    hit = zs[zs > z]
    return int(hit.index[0]) if len(hit) else None


def grad_z(g: pd.Series, spike: int, window: int = WINDOW) -> float | None:
    """The global gradient norm at `spike` in SDs above the mean of the `window` steps
    before (fewer early in a run: at least 10)."""
    before = g[g.index < spike].dropna().tail(window)
    if spike not in g.index or len(before) < 10 or not math.isfinite(g[spike]):
        return None
    std = float(before.std(ddof=0))
    return None if std < 1e-10 else (float(g[spike]) - float(before.mean())) / std


def lr_change(lr: pd.Series, spike: int, move: float = LR_MOVE) -> dict[str, Any] | None:
    """The LR's last move at or before `spike`: the last step where it moved by more than
    `move` from the step before, with the steps just before it that moved the same way
    (a ramp, a warm-up): {step (the first of them), steps, from, to}."""
    s = lr[lr.index <= spike].dropna()
    if len(s) < 2:
        return None
    v = s.to_numpy()
    d = np.diff(v)
    moved = np.abs(d) > move * np.abs(v[:-1])
    if not moved.any():
        return None
    last = int(np.flatnonzero(moved)[-1])
    first = last
    while first > 0 and moved[first - 1] and np.sign(d[first - 1]) == np.sign(d[last]):
        first -= 1
    return {"step": int(s.index[first + 1]), "steps": last - first + 1,
            "from": float(v[first]), "to": float(v[last + 1])}


def postmortem(frame: pd.DataFrame, events: pd.DataFrame | Alerts, spike: int,
               lookback: int = LOOKBACK, baseline: int = BASELINE, k: float = K
               ) -> dict[str, Any]:
    """The post-mortem of the loss spike at step `spike`: `frame` holds the recorded
    scalars of the steps before it (index: step; at least `baseline + lookback` of them,
    and the 128 for `grad_z`), `events` the run's events table (or its `Alerts`, read
    once for many spikes)."""
    out: dict[str, Any] = {"first": [], "lead": None, "first_layers": [],
                           "first_updates": None, "grad_z": None, "grad_rose": None,
                           "loss_rose": None, "log_z_rose": None, "lr": None,
                           "lr_change": None, "alerts_before": []}
    moved: list[tuple[int, str]] = []
    rises = _earliest(frame, layer_keys(frame.columns), "grad_norm/", spike, lookback,
                      baseline, k)
    out["first_layers"] = [{"layer": n, "step": s, "ratio": -r}
                           for s, r, n in rises[:MAX_LAYERS]]
    moved += [(s, f"grad_norm/{n}") for s, _, n in rises]
    dense = [key for key in update_keys(frame.columns) if _dense(frame[key], spike, lookback)]
    if dense:  # sparse ratios (with the histograms) are not looked at
        ups = _earliest(frame, dense, UPDATE, spike, lookback, baseline, k)
        out["first_updates"] = [{"layer": n, "step": s, "ratio": -r}
                                for s, r, n in ups[:MAX_LAYERS]]
        moved += [(s, f"{UPDATE}{n}") for s, _, n in ups]
    if "grad_norm/global" in frame:
        g = frame["grad_norm/global"]
        out["grad_z"] = grad_z(g, spike)
        r = _ratio_rise(g, spike, lookback, baseline, k)
        if r is not None:
            out["grad_rose"] = r[0]
            moved.append((r[0], "grad_norm/global"))
    if "loss/train" in frame:
        out["loss_rose"] = _z_rise(frame["loss/train"], spike, lookback, baseline, LOSS_Z)
        if out["loss_rose"] is not None:
            moved.append((out["loss_rose"], "loss/train"))
    if LOG_Z_KEY in frame:
        out["log_z_rose"] = _z_rise(frame[LOG_Z_KEY], spike, lookback, baseline, LOSS_Z)
        if out["log_z_rose"] is not None:
            moved.append((out["log_z_rose"], LOG_Z_KEY))
    if "lr" in frame:
        lr = frame["lr"]
        out["lr"] = float(lr[spike]) if spike in lr.index and pd.notna(lr[spike]) else None
        out["lr_change"] = lr_change(lr, spike)
    newest: dict[str, int] = {}
    for step, rule in (events if isinstance(events, Alerts) else Alerts(events)).within(
            spike - ALERT_LOOKBACK, spike):
        newest[rule] = max(newest.get(rule, -1), step)
    out["alerts_before"] = sorted(({"rule": r, "step": s, "lead": spike - s}
                                   for r, s in newest.items()), key=lambda a: a["step"])
    moved += [(a["step"], a["rule"]) for a in out["alerts_before"]
              if a["step"] >= spike - lookback]
    if moved:
        first = min(s for s, _ in moved)
        out["first"] = list(dict.fromkeys(n for s, n in sorted(moved) if s == first))
        out["lead"] = spike - first
    return out


class Alerts:
    """The (step, rule) of every alert but the loss spikes' among a run's events, in step
    order: what each post-mortem looks back over, read once for all of them."""

    def __init__(self, events: pd.DataFrame):
        got = sorted((int(s), str(d["rule"])) for s, k, d in
                     zip(events["step"], events["kind"], events["data"])
                     if k == "alert" and isinstance(d, dict) and d.get("rule")
                     and d.get("rule") != SPIKE_RULE)
        self.steps, self.rules = [s for s, _ in got], [r for _, r in got]

    def within(self, first: int, last: int) -> list[tuple[int, str]]:
        """The alerts at steps `first`…`last`."""
        a, b = bisect.bisect_left(self.steps, first), bisect.bisect_right(self.steps, last)
        return list(zip(self.steps[a:b], self.rules[a:b]))


def is_spike(kind: Any, data: Any) -> bool:
    """Whether an event (its kind and data) is a `loss_spike` alert."""
    return kind == "alert" and isinstance(data, dict) and data.get("rule") == SPIKE_RULE


# An event of this kind keeps a spike's post-mortem, made as a rewind went back over its
# steps (their series are then the new branch's): {"spike_id", "branch", "postmortem"}
KEPT = "postmortem"


def spikes_of(events: pd.DataFrame, scalars: Scalars | None = None,
              keys: Iterable[str] = (), steps: Iterable[int] | None = None) -> pd.DataFrame:
    """One row per `loss_spike` alert among `events` (of those at `steps`, when given), with
    its post-mortem when `scalars` reads the recorded series (`keys`: the names recorded;
    only the window before each spike is read), or the one kept for it when a rewind went
    back over its steps (`events` with their `id`: a reader's)."""
    only = None if steps is None else {int(s) for s in steps}
    keys = list(keys)
    wanted = [k for k in ("loss/train", "grad_norm/global", "lr", LOG_Z_KEY)
              if k in keys] + layer_keys(keys) + update_keys(keys)
    ids = events["id"] if "id" in events else [None] * len(events)
    kept = {d.get("spike_id"): d.get("postmortem") for k, d in zip(events["kind"], events["data"])
            if k == KEPT and isinstance(d, dict)}
    rows, due = [], []
    for step, kind, data, eid in zip(events["step"], events["kind"], events["data"], ids):
        if not is_spike(kind, data) or (only is not None and int(step) not in only):
            continue
        row: dict[str, Any] = {"step": int(step),
                               **{k: data.get(k) for k in ("loss", "median", "z")},
                               "batches": data.get("batches", [])}
        pm = kept.get(eid) if eid is not None else None
        if isinstance(pm, dict):
            row.update(pm)
        elif scalars is not None and wanted:
            due.append(row)
        rows.append(row)
    if due and scalars is not None:
        alerts = Alerts(events)
        for frame, group in _windows(scalars, wanted, due):  # one read for spikes near
            for row in group:                                 # each other
                step = row["step"]
                row.update(postmortem(frame.loc[step - _SPAN:step], alerts, step))
    return pd.DataFrame(rows, columns=SPIKE_COLUMNS)


_SPAN = max(BASELINE + LOOKBACK, WINDOW) + 1  # the steps a post-mortem reads, to its spike's


def _windows(scalars: Scalars, keys: list[str], rows: list[dict[str, Any]]
             ) -> Iterator[tuple[pd.DataFrame, list[dict[str, Any]]]]:
    """The series before each spike of `rows`, read once for spikes whose windows overlap
    or lie within a window of each other: (frame, the rows it serves)."""
    rows = sorted(rows, key=lambda r: r["step"])
    group = [rows[0]]
    for row in rows[1:]:  # near: within a window of the last; one read spans ≤ 20 windows
        if (row["step"] - _SPAN > group[-1]["step"] + _SPAN
                or row["step"] - group[0]["step"] > 20 * _SPAN):
            yield scalars(keys, group[0]["step"] - _SPAN, group[-1]["step"] + 1), group
            group = []
        group.append(row)
    yield scalars(keys, group[0]["step"] - _SPAN, group[-1]["step"] + 1), group


def to_keep(reader: Any, first: int, last: int) -> list[tuple[int, int, dict[str, Any]]]:
    """(spike event id, step, post-mortem) of each loss spike at steps `first`…`last`
    whose post-mortem is not kept yet: what a rewind to `first - 1` must keep before it
    replaces their series (the spikes of an earlier branch there had theirs kept then)."""
    events = reader.events()
    kept = {d.get("spike_id") for k, d in zip(events["kind"], events["data"])
            if k == KEPT and isinstance(d, dict)}
    due = [(int(i), int(s)) for i, s, k, d in zip(events["id"], events["step"],
                                                   events["kind"], events["data"])
           if first <= s <= last and is_spike(k, d) and int(i) not in kept]
    if not due:
        return []
    rows = spikes_of(events, lambda k, a, b: reader.scalars(k, a, b), reader.keys(),
                     [s for _, s in due]).to_dict("records")
    by_step = {}
    for row in rows:  # one post-mortem a step: the series are those of the live line
        by_step[int(row["step"])] = {k: _plain(row[k]) for k in SPIKE_COLUMNS[5:]}
    return [(i, s, by_step[s]) for i, s in due if s in by_step]


def _plain(v: Any) -> Any:
    """A post-mortem's value as JSON takes it (numpy scalars as Python numbers)."""
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, float) and math.isnan(v):
        return None
    return v


def timeline(row: Any) -> str:
    """A spike's post-mortem as a few lines, oldest first (what `diagnose()` prints)."""
    get: Callable[[str], Any] = row.get if isinstance(row, dict) else row.__getitem__
    spike = int(get("step"))
    lines: list[tuple[int, str]] = []
    change = get("lr_change")
    if isinstance(change, dict):
        over = f" over {change['steps']} steps" if change.get("steps", 1) > 1 else ""
        lines.append((change["step"], f"LR {change['from']:.3g} → {change['to']:.3g}{over}"))
    for a in get("alerts_before") or []:
        lines.append((a["step"], f"{a['rule']} fired"))
    for f in get("first_layers") or []:
        lines.append((f["step"], f"grad norm of {f['layer']} {f['ratio']:.1f}× its median"))
    try:
        ups = get("first_updates")
    except (KeyError, AttributeError):  # a row of a post-mortem made before update ratios
        ups = None
    for f in ups if isinstance(ups, list) else []:
        lines.append((f["step"], f"update ratio of {f['layer']} {f['ratio']:.1f}× its median"))
    for key, what in (("grad_rose", f"global grad norm > {K:g}× its median"),
                      ("loss_rose", f"loss {LOSS_Z:g} robust SD above its median"),
                      ("log_z_rose", f"log Z {LOSS_Z:g} robust SD above its median")):
        try:
            at = get(key)
        except (KeyError, AttributeError):  # a row of a post-mortem made before log Z
            at = None
        if at is not None and not (isinstance(at, float) and math.isnan(at)):
            lines.append((int(at), what))
    z = get("z")
    gz = get("grad_z")
    lines.append((spike, f"LOSS SPIKE {get('loss'):.4g} (median {get('median'):.4g}, z = "
                         f"{z:.1f})" + ("" if gz is None or (isinstance(gz, float) and
                                                              math.isnan(gz))
                                        else f"; grad norm {gz:.1f} SD above its mean")))
    lead, first = get("lead"), get("first") or []
    head = f"loss spike at step {spike}"
    if first and lead is not None and int(lead) == 0:
        head += (f": nothing moved before it ({len(first)} signals at the spike step itself: "
                 "look at its batch)")
    elif first and lead is not None:
        more = f" and {len(first) - 3} more" if len(first) > 3 else ""
        head += f": {', '.join(first[:3])}{more} moved first, {int(lead)} steps before"
    lr = get("lr")
    if lr is not None and not (isinstance(lr, float) and math.isnan(lr)):
        head += f"; LR {lr:.3g}"
    batches = get("batches") or []
    if batches:
        b = batches[-1]
        head += "; batch " + ", ".join(f"{k} {v}" for k, v in b.items() if k != "step")
    body = [f"  {s - spike:+5d}  step {s}: {what}" for s, what in sorted(lines, key=lambda t: t[0])
            if s >= spike - ALERT_LOOKBACK]
    return "\n".join([head, *body])


def from_reader(reader: Any, steps: Iterable[int] | None = None) -> pd.DataFrame:
    """`spikes_of` over a `RunReader`'s events and recorded series (the spikes at `steps`,
    when given)."""
    events = reader.events()
    return spikes_of(events, lambda k, a, b: reader.scalars(k, a, b), reader.keys(), steps)


def newest_of(reader: Any, n: int) -> tuple[pd.DataFrame, int]:
    """The newest `n` spikes' rows of `from_reader` (a report's table, as its other tables
    show the newest), and how many spikes the run has: thousands counted, not all made."""
    events = reader.events()
    at = [int(s) for s, k, d in zip(events["step"], events["kind"], events["data"])
          if is_spike(k, d)]
    rows = spikes_of(events, lambda k, a, b: reader.scalars(k, a, b), reader.keys(), at[-n:])
    return rows, len(at)
