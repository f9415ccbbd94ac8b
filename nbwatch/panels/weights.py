"""Weights: per-layer weight histograms over time (a heatmap), a layer picker, update ratios."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from ._common import Series, layers_of, traces

MAX_COLUMNS = 200
Column = tuple[int, np.ndarray, np.ndarray]  # (step, edges [b+1], counts [b])
T = TypeVar("T")


def thin(columns: list[T], max_columns: int = MAX_COLUMNS) -> list[T]:
    """Keep at most `max_columns` histograms: drop every other older one, keep the newest."""
    while len(columns) > max_columns:
        columns = columns[:-1][::2] + [columns[-1]]
    return columns


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


def heatmap(steps: np.ndarray, edges: np.ndarray, counts: np.ndarray, bins: int = 64
            ) -> dict[str, np.ndarray]:
    """Histograms with their own bin edges → one grid: {x: steps, y: bin centres, z: [bins, n]}.

    Each column's counts are spread onto a common range by their bin centres and scaled to
    fractions, so columns of different ranges compare (`js/views/weights.js` does the same).
    """
    edges = np.asarray(edges, dtype=np.float64)
    counts = np.asarray(counts, dtype=np.float64)
    lo, hi = float(edges[:, 0].min()), float(edges[:, -1].max())
    if hi <= lo:
        hi = lo + 1.0
    grid = np.linspace(lo, hi, bins + 1)
    z = np.zeros((bins, len(steps)), dtype=np.float32)
    for j in range(len(steps)):
        centres = (edges[j, :-1] + edges[j, 1:]) / 2
        idx = np.clip(((centres - lo) / (hi - lo) * bins).astype(np.int64), 0, bins - 1)
        col = np.bincount(idx, weights=counts[j], minlength=bins)
        total = col.sum()
        z[:, j] = col / total if total > 0 else col
    return {"x": np.asarray(steps, dtype=np.int32), "y": ((grid[:-1] + grid[1:]) / 2).astype(
        np.float32), "z": z}
