"""Data: padding ratio, sequence-length histogram, step time split into data wait and compute."""

from __future__ import annotations

from typing import Any

import numpy as np

from ._common import Series, trace

_KEYS = {"padding": "data/padding_ratio", "seq_len_mean": "data/seq_len_mean",
         "time_data": "time/data", "time_compute": "time/compute"}


def build(series: Series, seq_len: tuple[int, np.ndarray, np.ndarray] | None = None
          ) -> dict[str, Any]:
    """`seq_len`: the newest `data/seq_len` histogram as (step, edges, counts)."""
    out: dict[str, Any] = {n: t for n, k in _KEYS.items() if (t := trace(series, k)) is not None}
    if seq_len is not None:
        step, edges, counts = seq_len
        out["seq_len"] = {"step": int(step), "edges": np.asarray(edges, dtype=np.float32),
                          "counts": np.asarray(counts, dtype=np.float32)}
    return out
