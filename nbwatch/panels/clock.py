"""Clock: what the trend panels' x axis switch maps steps onto — the wall time of each step
(seconds since the run started, with the start as epoch seconds) and, where the run records
`tokens/real`, the tokens seen by each step. A long compile step or an eval shows on the
time axes as a gap (`js/axis.js` breaks the lines there)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ._common import Series, trace

TOKENS = "tokens/real"


def seconds(walls: np.ndarray, t0: float) -> np.ndarray:
    """Wall times (epoch s, float64) → seconds since `t0`, float32 (exact to ~0.1 s for
    two weeks: the wire narrows float64 to float32, so epoch seconds would not survive)."""
    return (np.asarray(walls, dtype=np.float64) - t0).astype(np.float32)


def tokens_seen(steps: np.ndarray, tokens: np.ndarray, carry: float) -> tuple[np.ndarray, float]:
    """Per-step token counts → the running total at each step (NaN counts as 0), and the
    total to carry to the next chunk."""
    v = np.nan_to_num(np.asarray(tokens, dtype=np.float64), nan=0.0)
    total = carry + np.cumsum(v)
    return total, float(total[-1]) if len(total) else carry


def build(t0: float | None, held: Series) -> dict[str, Any]:
    """`held`: {"wall": (steps, seconds since t0), "tokens": (steps, tokens seen)}, new
    points or all of them."""
    if t0 is None:
        return {}
    out: dict[str, Any] = {"t0": float(t0)}
    for key in ("wall", "tokens"):
        if (t := trace(held, key)) is not None and len(t["x"]):
            out[key] = t
    return out if len(out) > 1 else {}
