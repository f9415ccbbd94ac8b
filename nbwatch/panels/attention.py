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
    # one module list for every sample (a sample may lack a module another has)
    modules = list(dict.fromkeys(m for s in att["samples"] for m in s["maps"]))
    for s in att["samples"]:
        maps = s["maps"]
        if not maps:
            continue
        arrays = [np.asarray(maps[m], dtype=np.float32) if m in maps
                  else np.zeros((0, 0, 0), dtype=np.float32) for m in modules]
        # modules differ in shape (encoder-decoder: self T×T, cross T×S; GQA: heads):
        # pad into one [L, H, T, S] block, each module's own shape alongside
        heads = max(max(a.shape[0] for a in arrays), 1)
        t = max(max(a.shape[1] for a in arrays), 1)
        k = max(max(a.shape[2] for a in arrays), 1)
        stack = np.zeros((len(arrays), heads, t, k), dtype=np.float32)
        for i, a in enumerate(arrays):
            stack[i, : a.shape[0], : a.shape[1], : a.shape[2]] = a
        shapes = [list(a.shape) for a in arrays]
        q = np.clip(np.rint(stack * 255), 0, 255).astype(np.uint8)
        tokens = list(s["tokens"]) if s.get("tokens") else None
        samples.append({"tokens": tokens, "maps": q, "shapes": shapes})
    if not samples:
        return {}
    return {"step": int(att["step"]), "modules": modules,
            "heads": int(samples[0]["maps"].shape[1]), "samples": samples}
