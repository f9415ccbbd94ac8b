"""Attention: for each probe sample of the newest eval, a layers × heads overview of one
number per head (its entropy, its largest weight), and every head's map to open large."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np


def build(att: Mapping[str, Any] | None,
          latest: Mapping[str, tuple[int, float]] | None = None) -> dict[str, Any]:
    """`att`: {step, samples: [{tokens, maps: {module: [heads, T, S]}}]} → weights as uint8
    (×255: attention rows sum to 1, so 1/255 resolution is what a colour scale shows).
    `latest` {key: (step, value)}: each head's largest logit at that probe, for the
    overview."""
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
        ent, peak = head_summary(stack)
        tokens = list(s["tokens"]) if s.get("tokens") else None
        samples.append({"tokens": tokens, "maps": q, "shapes": shapes, "entropy": ent,
                        "peak": peak})
    if not samples:
        return {}
    out: dict[str, Any] = {"step": int(att["step"]), "modules": modules,
           "heads": int(samples[0]["maps"].shape[1]), "samples": samples}
    logit = np.full((len(modules), out["heads"]), np.nan, dtype=np.float32)
    for i, m in enumerate(modules):
        for h in range(out["heads"]):
            got = (latest or {}).get(f"attn/max_logit/{m}/{h}")
            if got is not None and got[0] == out["step"]:
                logit[i, h] = got[1]
    if np.isfinite(logit).any():
        out["logit"] = logit
    return out


def head_summary(stack: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[L, H, T, S] maps → (entropy, peak), each [L, H]: the mean over attending query rows
    (rows summing to ~1; padded and fully masked rows sum to 0) of the row's entropy in nats,
    and of its largest weight. NaN for a head with no such row (a padded slot)."""
    rows = stack.sum(-1) > 0.5  # [L, H, T]
    p = np.clip(stack, 1e-12, None)
    ent_rows = -(stack * np.log(p)).sum(-1)
    peak_rows = stack.max(-1)
    n = rows.sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        ent = np.where(n > 0, (ent_rows * rows).sum(-1) / n, np.nan)
        peak = np.where(n > 0, (peak_rows * rows).sum(-1) / n, np.nan)
    return ent.astype(np.float32), peak.astype(np.float32)
