"""Grads: per-layer norms of the latest step in depth order; global norm over time, clipped
norm, and the clip threshold as set by the controls."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ._common import Series, layers_of, traces


def build(
    series: Series,
    latest: Mapping[str, tuple[int, float]],
    events: Iterable[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """`latest`: {key: (step, value)} in the order the keys were first recorded."""
    out: dict[str, Any] = traces(series, ["grad_norm/global", "grad_norm/clipped"])
    layers = layers_of(latest, "grad_norm/")
    if layers and any(f"grad_norm/{n}" in series for n in layers):
        out["layers"] = layers
        out["norms"] = [float(latest[f"grad_norm/{n}"][1]) for n in layers]
        out["step"] = int(max(latest[f"grad_norm/{n}"][0] for n in layers))
    clip = [{"step": int(e["step"]), "value": e["data"].get("value")} for e in events
            if e["kind"] == "action" and e.get("data", {}).get("command") == "clip"]
    if clip:
        out["clip"] = clip
    return out
