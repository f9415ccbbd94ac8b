"""Weights: per-layer weight histograms over time (a heatmap), a layer picker, update ratios."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from ..lifecycle import is_ended
from ._common import Series, layers_of, traces
from .downsample import bucket_width

MAX_COLUMNS = 200
Column = tuple[int, np.ndarray, np.ndarray]  # (step, edges [b+1], counts [b])
C = TypeVar("C", bound=tuple[Any, ...])  # a Column, or anything else led by its step


def thin(columns: list[C], max_columns: int = MAX_COLUMNS) -> list[C]:
    """At most `max_columns` histograms spread evenly over the run: the first of each bucket
    of `w` steps and the newest, `w` a power of two chosen from the span of steps (the
    downsampler's grid). Buckets only merge as the run grows, so thinning as columns arrive
    keeps early steps too (`js/views/weights.js` does the same)."""
    if len(columns) <= max_columns:
        return columns
    w = bucket_width(int(columns[-1][0]), 2 * (max_columns - 1),  # ≤ max_columns - 1 buckets
                     int(columns[0][0]))
    out: list[C] = []
    prev = None
    for c in columns[:-1]:
        if (b := int(c[0]) // w) != prev:
            out.append(c)
            prev = b
    out.append(columns[-1])
    return out


def waiting(meta: Mapping[str, Any]) -> str:
    """What the histogram's place says while the run has none: that hist_every=0 turns them
    off (and the update ratios with them, but where update_every takes those), that the run
    ended without one, or when they are taken (`meta["run"]["options"]`)."""
    run = meta.get("run") or {}
    opts = run.get("options") or {}
    every = opts.get("hist_every", run.get("hist_every"))
    if every == 0:
        if not opts.get("update_every"):
            return "no weight histograms or update ratios: hist_every=0 turns them off"
        return "no weight histograms: hist_every=0 turns them off"
    if is_ended(str(meta.get("state"))):
        return "no weight histograms in this run"
    if isinstance(every, int) and every > 0:
        return (f"no weight histogram yet: one is taken at the run's first step, then every "
                f"{every} steps")
    return "no weight histogram yet"


def build(columns: Mapping[str, Sequence[Column]], series: Series) -> dict[str, Any]:
    """`columns`: {layer: [(step, edges, counts), ...]}, new or all; ratios from `series`."""
    hist = {}
    for layer, cols in columns.items():
        if not cols:
            continue
        hist[layer] = {
            "steps": np.array([c[0] for c in cols], dtype=np.int32),
            "edges": np.stack([np.asarray(c[1], dtype=np.float32) for c in cols]),
            "counts": np.stack([np.asarray(c[2], dtype=np.float32) for c in cols]),
        }
    out: dict[str, Any] = {}
    if hist:
        out["hist"] = hist
    ratios = traces(series, [f"update_ratio/{n}" for n in layers_of(series, "update_ratio/")])
    if ratios:
        out["ratios"] = {k.removeprefix("update_ratio/"): t for k, t in ratios.items()}
    return out
