"""Attention: a layers × heads grid of heatmaps for each probe sample of the newest eval."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np


def build(att: Mapping[str, Any] | None) -> dict[str, Any]:
    """`att`: {step, samples: [{tokens, maps: {module: [heads, T, S]}}]} → weights as uint8
    (×255: attention rows sum to 1, so 1/255 resolution is what a colour scale shows)."""
    if not att or not att["samples"]:
        return {}
    samples = []
    modules: list[str] = []
    for s in att["samples"]:
        maps = s["maps"]
        if not maps:
            continue
        modules = list(maps)
        stack = np.stack([np.asarray(maps[m], dtype=np.float32) for m in modules])  # [L,H,T,S]
        q = np.clip(np.rint(stack * 255), 0, 255).astype(np.uint8)
        tokens = list(s["tokens"]) if s.get("tokens") else None
        samples.append({"tokens": tokens, "maps": q})
    if not samples:
        return {}
    return {"step": int(att["step"]), "modules": modules,
            "heads": int(samples[0]["maps"].shape[1]), "samples": samples}
