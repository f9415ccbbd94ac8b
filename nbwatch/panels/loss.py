"""Loss: train raw and smoothed, val points, the val−train gap, LR, markers at actions/alerts."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ._common import Series, trace

MARKER_KINDS = ("action", "alert", "error")


def smooth(values: np.ndarray, carry: tuple[float, int] = (0.0, 0), weight: float = 0.9
           ) -> tuple[np.ndarray, tuple[float, int]]:
    """Debiased exponential moving average (TensorBoard's), resumable: pass back `carry`.

    Non-finite values are skipped (they stay NaN in the output)."""
    ema, n = carry
    out = np.full(len(values), np.nan, dtype=np.float32)
    for i, x in enumerate(np.asarray(values, dtype=np.float64)):
        if np.isfinite(x):
            ema, n = weight * ema + (1 - weight) * x, n + 1
            out[i] = ema / (1 - weight**n)
    return out, (ema, n)


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
        # The gap is val − mean train since the previous eval: the shaded band's lower edge.
        out["gap"] = {"x": common.astype(np.int32), "y": (vv[vi] - gv[gi]).astype(np.float32),
                      "top": vv[vi].astype(np.float32)}
    markers = [{"step": int(e["step"]), "kind": str(e["kind"]), "severity": str(e["severity"]),
                "message": str(e["message"])} for e in events if e["kind"] in MARKER_KINDS]
    if markers:
        out["markers"] = markers
    return out
