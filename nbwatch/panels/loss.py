"""Loss: train raw and smoothed, val points, the val−train gap, LR, markers at actions/alerts
(a loss spike's marker flagged: a click shows its post-mortem, `spikes.py`), and the
branches a rewind left (the steps it rewound over, kept as `rewind/<n>/loss/train`)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ..alerts.postmortem import is_spike
from ._common import Series, trace

MARKER_KINDS = ("action", "alert", "error")
BRANCH = re.compile(r"^rewind/(\d+)/loss/train$")


def smooth(values: np.ndarray, carry: tuple[float, int] = (0.0, 0), weight: float = 0.9
           ) -> tuple[np.ndarray, tuple[float, int]]:
    """Debiased exponential moving average (TensorBoard's), resumable: pass back `carry`.

    Non-finite values are skipped (they stay NaN in the output)."""
    v = np.asarray(values, dtype=np.float64)
    out = np.full(len(v), np.nan, dtype=np.float32)
    ok = np.isfinite(v)
    x = v[ok]
    ema, n = carry
    if not len(x):
        return out, (ema, n)
    # ema_i = w^(i+1)·ema + (1−w)·Σ_{k≤i} w^(i−k)·x_k, a chunk at a time: no Python loop
    # per point, and w^(−k) stays far from overflow within a chunk.
    chunk = 1024
    k = np.arange(chunk)
    up, down = weight ** (k + 1), weight ** -k.astype(np.float64)
    res = np.empty(len(x))
    for lo in range(0, len(x), chunk):
        c = x[lo:lo + chunk]
        m = len(c)
        e = up[:m] * ema + (1 - weight) * np.cumsum(c * down[:m]) * (weight ** k[:m])
        res[lo:lo + m] = e
        ema = float(e[-1])
    out[ok] = res / (1 - weight ** (n + np.arange(1, len(x) + 1, dtype=np.float64)))
    return out, (ema, n + len(x))


def build(series: Series, events: Iterable[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """Traces present in `series` (`loss/train_smooth` is the smoothed train loss) and
    markers for the action/alert/error events given."""
    out: dict[str, Any] = {}
    for name, key in (("train", "loss/train"), ("smooth", "loss/train_smooth"),
                      ("val", "loss/val"), ("lr", "lr")):
        if (t := trace(series, key)) is not None:
            out[name] = t
    if "loss/val" in series and "loss/gap" in series:
        (vs, vv), (gs, gv) = series["loss/val"], series["loss/gap"]
        common, vi, gi = np.intersect1d(vs, gs, return_indices=True)
        # The gap is val − the smoothed train loss at that step: the band's lower edge.
        out["gap"] = {"x": common.astype(np.int32), "y": (vv[vi] - gv[gi]).astype(np.float32),
                      "top": vv[vi].astype(np.float32)}
    branches = {m.group(1): trace(series, k) for k in series if (m := BRANCH.match(k))}
    if branches:
        out["branches"] = branches
    # a loss spike's marker opens its post-mortem (`postmortems`, sent by the Feed)
    markers = [{"step": int(e["step"]), "kind": str(e["kind"]), "severity": str(e["severity"]),
                "message": str(e["message"])}
               | ({"spike": True} if is_spike(e["kind"], e.get("data")) else {})
               for e in events if e["kind"] in MARKER_KINDS]
    if markers:
        out["markers"] = markers
    return out
