"""System: gauges per GPU (util, memory used/total, temperature, power), else CPU and RAM."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

_GPU = re.compile(r"^system/gpu(\d+)/(.+)$")
_FIELDS = ("util", "mem_used_gb", "mem_total_gb", "temp_c", "power_w")


def build(latest: Mapping[str, tuple[int, float]]) -> dict[str, Any]:
    """`latest`: {key: (step, value)}; only `system/...` keys are read."""
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
    return out if out["gpus"] or out["cpu_util"] is not None or out["ram_used_gb"] else {}
