"""Grads: a layer × step heat map of per-layer gradient norms (which layer, and when), the
norms of the newest step, the global norm over time, the clipped norm, and the clip
threshold as set by the controls."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ._common import Series, layers_of, traces
from .downsample import bucket_width

HEAT_COLUMNS = 240  # steps are binned onto ≤ this many columns; a bin keeps its maximum


def build(
    series: Series,
    latest: Mapping[str, tuple[int, float]],
    events: Iterable[Mapping[str, Any]] = (),
    heatmap: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`latest`: {key: (step, value)} in the order the keys were first recorded;
    `heatmap`: what `heat()` gave for this update, if the per-layer norms moved."""
    out: dict[str, Any] = traces(series, ["grad_norm/global", "grad_norm/clipped"])
    layers = layers_of(latest, "grad_norm/")
    if layers and any(f"grad_norm/{n}" in series for n in layers):
        out["layers"] = layers
        out["norms"] = [float(latest[f"grad_norm/{n}"][1]) for n in layers]
        out["step"] = int(max(latest[f"grad_norm/{n}"][0] for n in layers))
    if heatmap:
        out["heat"] = heatmap
    clip = [{"step": int(e["step"]), "value": e["data"].get("value")} for e in events
            if e["kind"] == "action" and e.get("data", {}).get("command") == "clip"]
    if clip:
        out["clip"] = clip
    return out


def heat(held: Series, layers: list[str], since: int | None = None,
         columns: int = HEAT_COLUMNS) -> dict[str, Any] | None:
    """Per-layer grad norms binned on a grid of `w` steps (a power of two, so bins never
    move as the run grows): {"w", "c0", "z": float32 [layers, columns from c0]}, each cell
    the bin's largest norm (a spike stays visible), NaN where a layer has no point.

    `since`: the first step that changed; only columns from its bin on are computed (a
    refresh), unless None (everything)."""
    keys = [f"grad_norm/{n}" for n in layers]
    ends = [int(held[k][0][-1]) for k in keys if k in held and len(held[k][0])]
    if not ends:
        return None
    last = max(ends)
    first = min(int(held[k][0][0]) for k in keys if k in held and len(held[k][0]))
    w = bucket_width(last, 2 * columns, first)
    c0 = (first if since is None else max(since, 0)) // w
    z = np.full((len(keys), last // w + 1 - c0), np.nan, dtype=np.float32)
    for i, k in enumerate(keys):
        if k not in held:
            continue
        s, v = held[k]
        j = int(np.searchsorted(s, c0 * w))
        s, v = np.asarray(s[j:], dtype=np.int64), np.asarray(v[j:], dtype=np.float32)
        ok = np.isfinite(v)
        np.fmax.at(z[i], s[ok] // w - c0, v[ok])
    return {"w": w, "c0": c0, "z": z}
