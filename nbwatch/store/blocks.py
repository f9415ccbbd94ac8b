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


def _span(to: list[int]) -> slice | np.ndarray:
    """Column positions as a slice when they are consecutive (a plain copy, no gather)."""
    if to and to[-1] - to[0] + 1 == len(to) and to == list(range(to[0], to[-1] + 1)):
        return slice(to[0], to[-1] + 1)
    return np.asarray(to, dtype=np.int64)


class Frame:
    """A wide float64 frame filled part by part: one row per step of `index` (sorted,
    unique), one column per name; NaN where no part wrote. The buffer is column-major
    ([columns, steps], what pandas keeps), so a part's column is one contiguous write, and
    only the columns no part covers whole (`full`) are filled with NaN first."""

    def __init__(self, index: np.ndarray, columns: list[str], full: set[int]):
        self.index, self.columns = index, columns
        self.out = np.empty((len(columns), len(index)), dtype=np.float64)
        for c in range(len(columns)):
            if c not in full:
                self.out[c] = np.nan

    def place(self, steps: np.ndarray, values: np.ndarray, take: list[int], to: list[int]
              ) -> None:
        """Write `values` [n, k]'s columns `take` at `steps` into the columns `to`; a later
        part wins where two write a step. Steps outside the index are left out."""
        if not len(steps):
            return
        cols = values if take == list(range(values.shape[1])) else values[:, take]
        dest = _span(to)
        index = self.index
        lo = int(np.searchsorted(index, steps[0]))
        n = len(steps)
        if (lo + n <= len(index) and index[lo] == steps[0] and index[lo + n - 1] == steps[-1]
                and steps[-1] - steps[0] == n - 1 and index[lo + n - 1] - index[lo] == n - 1):
            self.out[dest, lo:lo + n] = cols.T  # consecutive steps: a slice of the index
            return
        pos = np.searchsorted(index, steps)
        ok = pos < len(index)
        ok[ok] = index[pos[ok]] == steps[ok]
        if not ok.all():
            pos, cols = pos[ok], cols[ok]
        rows = dest if isinstance(dest, np.ndarray) else np.arange(dest.start, dest.stop)
        self.out[rows[:, None], pos[None, :]] = cols.T

    def df(self) -> pd.DataFrame:
        return pd.DataFrame(self.out.T, index=pd.Index(self.index, name="step", dtype="int64"),
                            columns=self.columns, copy=False)


def covered(index: np.ndarray, steps: np.ndarray) -> bool:
    """Whether `steps` (sorted) are every step of `index`."""
    return len(steps) == len(index) and np.array_equal(steps, index)


def frame(parts: list[tuple[np.ndarray, np.ndarray, list[int], list[int]]],
          columns: list[str], index: np.ndarray | None = None) -> pd.DataFrame:
    """Assemble a wide frame: each part is (steps, values [n, k], which of its columns to
    take, where they go). The index is `index` (sorted unique steps) or every step seen;
    where a key has two values for a step, the later part wins."""
    if index is None:
        index = union([p[0] for p in parts])
    full = {c for steps, _, _, to in parts if covered(index, steps) for c in to}
    out = Frame(index, columns, full)
    for part in parts:
        out.place(*part)
    return out.df()
