"""Scalars as blocks: the values of many steps of one key family in one store row.

A step's scalars are split by family (the name up to the first `/`: `loss`, `grad_norm`,
`system`, …); each family's keys, in the order they arrived, form a *layout*. The writer
turns every run of records with the same layout into a block: the steps (omitted when
they are consecutive) and a [steps, keys] matrix, float64 for the families whose
precision matters (loss, LR, the user's own scalars) and float32 for the rest.
Pure functions: no SQLite here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

# Families held as float32 (7 significant digits: a norm, a timing, a GPU reading).
# Everything else — loss, LR, val, token counts, a user's `accuracy=` — keeps float64.
F32_FAMILIES = frozenset({"grad_norm", "update_ratio", "weight_norm", "system", "gpu", "time",
                          "throughput", "data"})
_RANK = re.compile(r"rank\d+$")
MAX_BLOCK_VALUES = 1 << 20  # values per block: a few MiB, read and written whole


def family(key: str) -> str:
    return key.split("/", 1)[0]


def dtype_of(fam: str) -> str:
    return "f4" if fam in F32_FAMILIES or _RANK.match(fam) else "f8"


def is_system(fam: str) -> bool:
    return fam == "system"


@dataclass(frozen=True)
class Layout:
    """One family's keys in the order a block holds them."""

    id: int
    keys: tuple[str, ...]
    dtype: str  # "f4" | "f8"


@dataclass(frozen=True)
class Part:
    """Where one layout's columns sit in a record's value list."""

    layout: int
    columns: np.ndarray  # int64 indices into the record's values
    dtype: str


def split(names: tuple[str, ...]) -> list[tuple[str, list[int]]]:
    """A record's key names → [(family, column indices)], families in order of first key."""
    out: dict[str, list[int]] = {}
    for i, k in enumerate(names):
        out.setdefault(family(k), []).append(i)
    return list(out.items())


def encode(steps: np.ndarray, values: np.ndarray, dtype: str
           ) -> list[tuple[int, int, bytes | None, bytes]]:
    """Rows (first, last, steps or None when consecutive, values) of at most
    MAX_BLOCK_VALUES values each, for `values` [n, k] at `steps` [n]."""
    n, k = values.shape
    per = max(MAX_BLOCK_VALUES // max(k, 1), 64)
    out = []
    for lo in range(0, n, per):
        s = steps[lo:lo + per]
        v = np.ascontiguousarray(values[lo:lo + per], dtype=dtype)
        first, last = int(s.min()), int(s.max())
        consecutive = int(s[0]) == first and last - first + 1 == len(s) and (
            len(s) < 2 or bool((np.diff(s) == 1).all()))
        out.append((first, last, None if consecutive else s.astype(np.int64).tobytes(),
                    v.tobytes()))
    return out


def decode(first: int, steps: bytes | None, values: bytes, layout: Layout
           ) -> tuple[np.ndarray, np.ndarray]:
    """One block → (steps int64 [n], values [n, k] in the layout's dtype, read-only)."""
    v = np.frombuffer(values, dtype=layout.dtype).reshape(-1, len(layout.keys))
    s = (np.frombuffer(steps, dtype=np.int64) if steps is not None
         else np.arange(first, first + len(v), dtype=np.int64))
    return s, v


def union(arrays: list[np.ndarray]) -> np.ndarray:
    """Sorted unique steps of several step arrays. Layouts mostly share their steps, and
    each is mostly sorted already: far cheaper than `np.unique` of their concatenation."""
    distinct: list[np.ndarray] = []
    for a in arrays:
        if not any(len(a) == len(d) and np.array_equal(a, d) for d in distinct):
            distinct.append(a)
    if not distinct:
        return np.empty(0, dtype=np.int64)
    a = np.sort(np.concatenate(distinct) if len(distinct) > 1 else distinct[0],
                kind="stable")  # timsort: linear on sorted runs
    return a[np.r_[True, a[1:] != a[:-1]]] if len(a) else a


def frame(parts: list[tuple[np.ndarray, np.ndarray, list[int], list[int]]],
          columns: list[str], index: np.ndarray | None = None) -> pd.DataFrame:
    """Assemble a wide frame: each part is (steps, values [n, k], which of its columns to
    take, where they go). The index is `index` (sorted unique steps) or every step seen;
    where a key has two values for a step, the later part wins."""
    if index is None:
        index = union([p[0] for p in parts])
    out = np.full((len(index), len(columns)), np.nan, dtype=np.float64)
    for steps, values, take, to in parts:
        cols = values if take == list(range(values.shape[1])) else values[:, take]
        if len(steps) == len(index) and np.array_equal(steps, index):
            out[:, to] = cols  # the common case: this layout has every step
            continue
        pos = np.searchsorted(index, steps)
        ok = pos < len(index)
        ok[ok] = index[pos[ok]] == steps[ok]
        if not ok.all():
            pos, cols = pos[ok], cols[ok]
        out[pos[:, None], np.asarray(to)[None, :]] = cols
    df = pd.DataFrame(out, index=pd.Index(index, name="step", dtype="int64"), columns=columns,
                      copy=False)
    return df
