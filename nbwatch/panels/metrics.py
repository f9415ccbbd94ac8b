"""Metrics: every recorded series that no other panel draws over time (a val metric such as
`val/accuracy`, `lr/group1`, a step_fn's or `log()`'s own scalars, per-layer grad norms),
for a picker with a search box."""

from __future__ import annotations

import re
from typing import Any

from ._common import Series, trace
from .downsample import downsample

# Drawn over time elsewhere: loss (train, smoothed, val, gap, LR), grads (global, clipped),
# weights (update ratios), data (padding, step time), ranks, system gauges, health (the
# probe pass's figures and the training batch's logits).
DRAWN = frozenset({"loss/train", "loss/train_smooth", "loss/val", "loss/gap", "lr",
                   "grad_norm/global", "grad_norm/clipped", "data/padding_ratio", "time/data",
                   "time/compute"})
_ELSEWHERE = re.compile(r"^(update_ratio/|system/|rank\d+/|attn/|act/rms/|logits/|train_logits/)")
_PER_LAYER = "grad_norm/"
LAYER_POINTS = 500  # a late view of hundreds of per-layer series stays small


def shown_here(key: str) -> bool:
    return key not in DRAWN and not _ELSEWHERE.match(key)


def build(series: Series, full: bool = False) -> dict[str, Any]:
    """{"series": {key: {x, y}}} of the keys this panel shows; in a full state (a late view,
    an export) each per-layer series is thinned to LAYER_POINTS."""
    out = {}
    for key, (s, v) in series.items():
        if not shown_here(key):
            continue
        if full and key.startswith(_PER_LAYER) and len(s) > LAYER_POINTS:
            s, v = downsample(s, v, LAYER_POINTS)
        out[key] = trace({key: (s, v)}, key)
    return {"series": out} if out else {}
