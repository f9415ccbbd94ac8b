"""Small helpers the panel builders share."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

Series = Mapping[str, tuple[np.ndarray, np.ndarray]]


def trace(series: Series, key: str) -> dict[str, np.ndarray] | None:
    """{"x": steps int32, "y": values float32} of one series, or None when absent."""
    if key not in series:
        return None
    s, v = series[key]
    return {"x": np.asarray(s, dtype=np.int32), "y": np.asarray(v, dtype=np.float32)}


def traces(series: Series, keys: list[str]) -> dict[str, dict[str, np.ndarray]]:
    """The present ones of `keys`, by key."""
    return {k: t for k in keys if (t := trace(series, k)) is not None}


def layers_of(keys: list[str] | Mapping[str, object], prefix: str) -> list[str]:
    """Layer names of `prefix/<layer>` keys, in the order given (the model's depth order)."""
    skip = {"global", "clipped"}
    n = len(prefix)
    return [k[n:] for k in keys if k.startswith(prefix) and k[n:] not in skip]
