"""Reading the system timeline (the sampler's readings, by wall time) from a run folder:
the part of `RunReader` that reads `system_samples`."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import pandas as pd

from .blocks import Layout
from .tables import decode_system


class SystemReads:
    """Part of `RunReader`: reads through its `query`, `session`, `layout`, `keys` and
    `_layout_filter`."""

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        raise NotImplementedError

    def session(self) -> AbstractContextManager[None]:
        raise NotImplementedError

    def layout(self, layout_id: int) -> Layout:
        raise NotImplementedError

    def keys(self) -> list[str]:
        raise NotImplementedError

    def _layout_filter(self, keys: Iterable[str] | None, params: list[Any]) -> str:
        raise NotImplementedError

    def _has_system(self) -> bool:
        """Whether the folder has the system timeline (a folder no writer of this version
        opened keeps its system figures as step-keyed scalars)."""
        if not getattr(self, "_system_table", False):
            self._system_table = bool(self.query(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'system_samples'"))
        return self._system_table

    def _system_rows(self, keys: Iterable[str] | None = None, after_id: int = 0,
                     limit: int | None = None, start: int | None = None,
                     stop: int | None = None, wall_start: float | None = None,
                     wall_stop: float | None = None) -> list[tuple]:
        """Rows (id, layout, walls, steps, values, merged_from) of the system timeline that
        hold any of `keys` (all when None) past `after_id`, at a step in [start, stop) and a
        wall time in [wall_start, wall_stop), oldest first."""
        with self.session():
            if not self._has_system():
                return []
            sql = ('SELECT id, layout, walls, steps, "values", merged_from FROM system_samples'
                   " WHERE id > ?")
            params: list[Any] = [after_id]
            sql += self._layout_filter(keys, params)
            for cond, value in ((" AND last_step >= ?", start), (" AND first_step < ?", stop),
                                (" AND last >= ?", wall_start), (" AND first < ?", wall_stop)):
                if value is not None:
                    sql += cond
                    params.append(value)
            sql += " ORDER BY id" + (f" LIMIT {int(limit)}" if limit is not None else "")
            rows = self.query(sql, params)
            for r in rows:
                self.layout(r[1])
        return rows

    def decode_system(self, row: tuple) -> tuple[Layout, np.ndarray, np.ndarray, np.ndarray]:
        """One row of `_system_rows` → (layout, walls f8 [n], steps i8 [n], values [n, k])."""
        lay = self.layout(row[1])
        w, s, v = decode_system(row[2], row[3], row[4], lay.dtype, len(lay.keys))
        return lay, w, s, v

    def _system_by_step(self, rows: list[tuple], col_of: dict[str, int], start: int | None,
                        stop: int | None) -> list[tuple]:
        """Parts for `blocks.frame`: per step, the newest sample taken at that step."""
        per_layout: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
        for row in rows:  # id order, each row in wall order: the order samples were taken
            _, _, s, v = self.decode_system(row)
            per_layout.setdefault(row[1], []).append((s, v))
        parts = []
        for lid, got in per_layout.items():
            lay = self.layout(lid)
            take = [j for j, k in enumerate(lay.keys) if k in col_of]
            s = np.concatenate([g[0] for g in got])
            v = np.concatenate([g[1] for g in got])
            keep = np.ones(len(s), dtype=bool)
            if start is not None:
                keep &= s >= start
            if stop is not None:
                keep &= s < stop
            s, v = s[keep], v[keep]
            order = np.argsort(s, kind="stable")  # by step, then as taken
            s, v = s[order], v[order]
            last = np.r_[s[1:] != s[:-1], True] if len(s) else np.empty(0, dtype=bool)
            if take and last.any():
                parts.append((s[last], v[last], take, [col_of[lay.keys[j]] for j in take]))
        return parts

    def system(self, keys: Iterable[str] | None = None, start: float | None = None,
               stop: float | None = None) -> pd.DataFrame:
        """Every system sample with a wall time in [start, stop) (epoch seconds), oldest
        first: index `wall` (epoch seconds), column `step` (steps completed when it was
        taken), then one column per `system/...` key; NaN where a sample lacks one."""
        keys = list(keys) if keys is not None else None
        with self.session():
            rows = self._system_rows(keys, wall_start=start, wall_stop=stop)
            order = self.keys()
        decoded = [self.decode_system(r) for r in rows]
        present = {k for lay, *_ in decoded for k in lay.keys}
        columns = [k for k in order if k in present and (keys is None or k in keys)]
        col_of = {k: i for i, k in enumerate(columns)}
        n = sum(len(w) for _, w, _, _ in decoded)
        walls = np.empty(n, dtype=np.float64)
        steps = np.empty(n, dtype=np.int64)
        values = np.full((n, len(columns)), np.nan, dtype=np.float64)
        at = 0
        for lay, w, s, v in decoded:
            take = [j for j, k in enumerate(lay.keys) if k in col_of]
            walls[at:at + len(w)], steps[at:at + len(w)] = w, s
            values[at:at + len(w), [col_of[lay.keys[j]] for j in take]] = v[:, take]
            at += len(w)
        keep = np.ones(n, dtype=bool)
        if start is not None:
            keep &= walls >= start
        if stop is not None:
            keep &= walls < stop
        order_ = np.argsort(walls[keep], kind="stable")
        df = pd.DataFrame(values[keep][order_], columns=columns,
                          index=pd.Index(walls[keep][order_], name="wall"))
        df.insert(0, "step", steps[keep][order_])
        return df
