"""System: gauges per GPU (util, memory used/total, temperature, power), else CPU and RAM,
and the sampler's readings drawn against wall time (not steps: a long compile or eval step
holds many samples)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from ._common import Series, trace

_GPU = re.compile(r"^system/gpu(\d+)/(.+)$")
_FIELDS = ("util", "mem_used_gb", "mem_total_gb", "temp_c", "power_w")
# what the time charts draw: utilisation (%) and memory in use (GB); totals are gauges
CHARTED = re.compile(r"^system/(?:cpu/util|gpu\d+/util|ram/used_gb|proc/rss_gb|"
                     r"gpu\d+/mem_used_gb|gpu\d+/max_allocated_gb)$")
TICK = 0.01  # s: the time charts' x unit, whole ticks in int32 for 248 days


def ticks(walls: np.ndarray, t0: float) -> np.ndarray:
    """Wall times (epoch s) → whole ticks since `t0`, the grid the downsampler keeps."""
    return np.round((np.asarray(walls, dtype=np.float64) - t0) / TICK).astype(np.int64)


def build(latest: Mapping[str, tuple[int, float]], timeline: Series | None = None,
          t0: float | None = None) -> dict[str, Any]:
    """`latest`: {key: (step, value)}; only `system/...` keys are read. `timeline`: {key:
    (ticks since `t0`, values)} of the system samples (new ones, or all held), and `step`:
    (ticks, steps completed) — drawn as `series` {key: {x, y}}, x in ticks of `TICK` s."""
    gpus: dict[int, dict[str, float]] = {}
    for key, (_, v) in latest.items():
        m = _GPU.match(key)
        if m and m.group(2) in _FIELDS:
            gpus.setdefault(int(m.group(1)), {})[m.group(2)] = float(v)
    val = lambda k: float(latest[k][1]) if k in latest else None
    out: dict[str, Any] = {
        "gpus": [{"index": i, **{f: g.get(f) for f in _FIELDS}} for i, g in sorted(gpus.items())],
        "cpu_util": val("system/cpu/util"),
        "ram_used_gb": val("system/ram/used_gb"),
        "ram_total_gb": val("system/ram/total_gb"),
    }
    held: Series = timeline or {}
    series = {k: t for k in held if (k == "step" or CHARTED.match(k))
              and (t := trace(held, k)) is not None and len(t["x"])}
    if series and t0 is not None:
        out |= {"t0": float(t0), "tick": TICK, "series": series}
    elif not (out["gpus"] or out["cpu_util"] is not None or out["ram_used_gb"]):
        return {}
    return out
