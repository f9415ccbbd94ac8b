"""Scalars as blocks in SQLite: the writer's and the migration's side of `blocks.py`."""

from __future__ import annotations

import json
import sqlite3

import numpy as np

from . import blocks
from .blocks import Layout, Part
from .schema import inserted_id


def merge_groups(rows: list[tuple[int, int]], width: int, big: int | None = None
                 ) -> list[list[int]]:
    """The ids of consecutive rows (id, steps held) to merge into one, each group of up to
    MAX_BLOCK_VALUES values; a row of more than `big` values stays as it is."""
    groups: list[list[int]] = [[]]
    held = 0
    for bid, n in rows:
        if big is not None and n * width > big:  # big enough: left as it is
            if groups[-1]:
                groups.append([])
            held = 0
            continue
        if held + n > blocks.MAX_BLOCK_VALUES // width and groups[-1]:
            groups.append([])
            held = 0
        groups[-1].append(bid)
        held += n
    return [g for g in groups if len(g) > 1]


class ScalarTables:
    """Writes scalars as blocks (and their steps' walls) on one connection, inside the
    caller's transaction: the store's writer thread and the schema-1 migration use it."""

    def __init__(self, con: sqlite3.Connection):
        self.con = con
        self.key_ids = dict((n, i) for i, n in con.execute("SELECT id, name FROM keys"))
        self.layout_ids: dict[tuple[str, tuple[int, ...]], int] = {}
        for i, fam, ids in con.execute("SELECT id, family, keys FROM layouts"):
            self.layout_ids[(fam, tuple(json.loads(ids)))] = i
        self.plans: dict[tuple[str, ...], tuple[list[Part], bool]] = {}

    def key(self, name: str) -> int:
        kid = self.key_ids.get(name)
        if kid is None:
            cur = self.con.execute("INSERT INTO keys (name) VALUES (?)", (name,))
            kid = self.key_ids[name] = inserted_id(cur)
        return kid

    def plan(self, names: tuple[str, ...]) -> tuple[list[Part], bool]:
        """How a record with these keys splits into layouts, and whether it is a trained
        step (not the system sampler's reading alone)."""
        plan = self.plans.get(names)
        if plan is None:
            parts = []
            for fam, cols in blocks.split(names):
                ids = tuple(self.key(names[c]) for c in cols)
                lid = self.layout_ids.get((fam, ids))
                dtype = blocks.dtype_of(fam)
                if lid is None:
                    cur = self.con.execute(
                        "INSERT INTO layouts (family, dtype, keys) VALUES (?, ?, ?)",
                        (fam, dtype, json.dumps(ids)))
                    lid = self.layout_ids[(fam, ids)] = inserted_id(cur)
                parts.append(Part(lid, np.array(cols, dtype=np.int64), dtype))
            # a step trained now has a wall; a rewind's branch (`rewind/<n>/…`: the history
            # of steps gone back over, whose walls went with them) has none
            trained = any(not blocks.is_system(blocks.family(k)) and not k.startswith("rewind/")
                          for k in names)
            plan = self.plans[names] = (parts, trained)
        return plan

    def write(self, groups: dict[tuple[str, ...], tuple[list, list, list]]) -> None:
        """Runs of Scalars, grouped by key names: each group becomes a block per family."""
        con = self.con
        wall_steps: list[np.ndarray] = []
        wall_times: list[np.ndarray] = []
        # A layout shared by two groups (the same grad norms in a step's record and in an
        # eval step's, which has more keys) gets one block, in step order: a layout's blocks
        # then never interleave, which is what a follower's "steps after the last I read"
        # relies on when closing merges blocks.
        per_layout: dict[int, tuple[str, list[np.ndarray], list[np.ndarray]]] = {}
        for names, (steps, walls, values) in groups.items():
            parts, trained = self.plan(names)
            s = np.array(steps, dtype=np.int64)
            v = np.array(values, dtype=np.float64).reshape(len(steps), len(names))
            for p in parts:
                sub = v if len(p.columns) == len(names) else v[:, p.columns]
                got = per_layout.setdefault(p.layout, (p.dtype, [], []))
                got[1].append(s)
                got[2].append(sub)
            if trained:
                wall_steps.append(s)
                wall_times.append(np.array(walls, dtype=np.float64))
        rows = []
        for lid, (dtype, ss, vs) in per_layout.items():
            s, v = (ss[0], vs[0]) if len(ss) == 1 else (np.concatenate(ss), np.concatenate(vs))
            if len(ss) > 1:
                order = np.argsort(s, kind="stable")  # equal steps keep their order
                s, v = s[order], v[order]
            rows += [(lid, *b) for b in blocks.encode(s, v, dtype)]
        con.executemany(
            'INSERT INTO blocks (layout, first, last, steps, "values") VALUES (?, ?, ?, ?, ?)',
            rows)
        if wall_steps:
            s = np.concatenate(wall_steps)
            w = np.concatenate(wall_times)
            order = np.argsort(s, kind="stable")
            con.executemany("INSERT INTO walls (first, last, steps, walls) VALUES (?, ?, ?, ?)",
                            [(f, la, st, wb) for f, la, st, wb in blocks.encode(
                                s[order], w[order, None], "f8")])
        groups.clear()

    def write_system(self, groups: dict[tuple[str, ...], tuple[list, list, list]]) -> None:
        """Runs of SystemSample, grouped by key names, as (walls, steps, values): one row
        of `system_samples` per layout, samples in wall order. Never keyed by step alone:
        samples that share a step (a long step) are all kept."""
        rows = []
        for names, (walls, steps, values) in groups.items():
            parts, _ = self.plan(names)
            w = np.array(walls, dtype=np.float64)
            order = np.argsort(w, kind="stable")
            w = w[order]
            s = np.array(steps, dtype=np.int64)[order]
            v = np.array(values, dtype=np.float64).reshape(len(w), len(names))[order]
            for p in parts:
                sub = v if len(p.columns) == len(names) else v[:, p.columns]
                rows += [(p.layout, *r) for r in system_rows(w, s, sub, p.dtype)]
        self.con.executemany(
            "INSERT INTO system_samples (layout, first, last, first_step, last_step, walls,"
            ' steps, "values") VALUES (?, ?, ?, ?, ?, ?, ?, ?)', rows)
        groups.clear()

    def compact_system(self) -> int:
        """`compact()` for the system timeline: a layout's small rows merged in id order,
        the merged row keeping the highest id and noting the lowest (`merged_from`)."""
        con = self.con
        removed = 0
        by_layout: dict[int, list[tuple[int, int]]] = {}
        for bid, lid, nbytes in con.execute(
                "SELECT id, layout, length(walls) FROM system_samples ORDER BY id"):
            by_layout.setdefault(lid, []).append((bid, nbytes // 8))
        for lid, held_rows in by_layout.items():
            lay = self.layout(lid)
            dtype, width = lay.dtype, len(lay.keys)
            for ids in merge_groups(held_rows, width):
                marks = ",".join("?" * len(ids))
                rows = con.execute(f'SELECT walls, steps, "values", merged_from FROM'
                                   f" system_samples WHERE id IN ({marks}) ORDER BY id",
                                   ids).fetchall()
                got = [decode_system(w, st, v, dtype, width) for w, st, v, _ in rows]
                w, s, v = (np.concatenate([g[i] for g in got]) for i in range(3))
                lowest = min([ids[0]] + [r[3] for r in rows if r[3] is not None])
                con.execute(f"DELETE FROM system_samples WHERE id IN ({marks})", ids)
                con.execute("INSERT INTO system_samples (id, layout, first, last, first_step,"
                            ' last_step, walls, steps, "values", merged_from)'
                            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                            (ids[-1], lid, *system_rows(w, s, v, dtype, split=False)[0],
                             lowest))
                removed += len(ids) - 1
        return removed

    def compact(self) -> int:
        """Merge each layout's small blocks (a live run commits a few steps at a time) into
        blocks of up to MAX_BLOCK_VALUES values, and the same for walls, so a finished run
        reads as fast as one written in bulk. A merged block keeps the highest id of the
        blocks it replaces and notes the lowest (`merged_from`): a follower's cursor past
        them does not read them again, one between them drops the steps it has read.
        Returns the number of blocks removed."""
        con = self.con
        removed = 0
        tables: list[tuple[str, str, int | None, int, str]] = [
            ("blocks", '"values"', lid, len(keys), dtype)
            for (_, keys), lid in self.layout_ids.items()
            for dtype in [self.layout(lid).dtype]]
        tables.append(("walls", "walls", None, 1, "f8"))
        for table, col, lid, width, dtype in tables:
            where, params = ("layout = ?", (lid,)) if lid is not None else ("1", ())
            size = np.dtype(dtype).itemsize * width
            held_rows = [(bid, nbytes // size) for bid, nbytes in con.execute(
                f"SELECT id, length({col}) FROM {table} WHERE {where} ORDER BY id", params)]
            for ids in merge_groups(held_rows, width, big=blocks.MAX_BLOCK_VALUES // 16):
                # a group is a run of this layout's rows in id order: one id range
                span = f"{where} AND id BETWEEN ? AND ?"
                rng = (*params, ids[0], ids[-1])
                lineage = "merged_from" if lid is not None else "NULL"
                rows = con.execute(f"SELECT first, last, steps, {col}, {lineage} FROM {table}"
                                   f" WHERE {span} ORDER BY id", rng).fetchall()
                # a block merged before (live, or by an earlier close) passes on its lowest
                # id: a follower's cursor within it still knows the steps it has read
                lowest = min([ids[0]] + [r[4] for r in rows if r[4] is not None])
                steps, values = _joined([r[:4] for r in rows], width, dtype)
                (first, last, st, v), = blocks.encode(steps, values, dtype)
                con.execute(f"DELETE FROM {table} WHERE {span}", rng)
                if lid is not None:
                    con.execute('INSERT INTO blocks (id, layout, first, last, steps, "values",'
                                " merged_from) VALUES (?, ?, ?, ?, ?, ?, ?)",
                                (ids[-1], lid, first, last, st, v, lowest))
                else:
                    con.execute("INSERT INTO walls (id, first, last, steps, walls)"
                                " VALUES (?, ?, ?, ?, ?)", (ids[-1], first, last, st, v))
                removed += len(ids) - 1
        return removed

    def truncate(self, step: int) -> None:
        """Drop every scalar, wall and record of a step after `step`."""
        con = self.con
        for table in ("blocks", "walls"):
            con.execute(f"DELETE FROM {table} WHERE first > ?", (step,))
        for bid, lid, first, steps, values in con.execute(
                'SELECT id, layout, first, steps, "values" FROM blocks WHERE last > ?',
                (step,)).fetchall():
            lay = self.layout(lid)
            s, v = blocks.decode(first, steps, values, lay)
            keep = s <= step
            con.execute("DELETE FROM blocks WHERE id = ?", (bid,))
            if keep.any():  # what followers have read: `merged_from` tells them
                con.executemany(
                    'INSERT INTO blocks (layout, first, last, steps, "values", merged_from)'
                    " VALUES (?, ?, ?, ?, ?, ?)",
                    [(lid, *b, bid) for b in blocks.encode(s[keep], v[keep], lay.dtype)])
        for wid, first, steps, walls in con.execute(
                "SELECT id, first, steps, walls FROM walls WHERE last > ?", (step,)).fetchall():
            w = np.frombuffer(walls, dtype=np.float64)
            s = (np.frombuffer(steps, dtype=np.int64) if steps is not None
                 else np.arange(first, first + len(w), dtype=np.int64))
            keep = s <= step
            con.execute("DELETE FROM walls WHERE id = ?", (wid,))
            if keep.any():
                con.executemany("INSERT INTO walls (first, last, steps, walls) VALUES (?, ?, ?, ?)",
                                blocks.encode(s[keep], w[keep, None], "f8"))
        for table in ("histograms", "attention", "samples"):
            con.execute(f"DELETE FROM {table} WHERE step > ?", (step,))

    def layout(self, lid: int) -> Layout:
        """A layout as this connection sees it (it may not be committed yet)."""
        names = {i: n for n, i in self.key_ids.items()}
        dtype, ids = self.con.execute("SELECT dtype, keys FROM layouts WHERE id = ?",
                                        (lid,)).fetchone()
        return Layout(lid, tuple(names[k] for k in json.loads(ids)), dtype)




def _joined(rows: list[tuple], width: int, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Rows (first, last, steps, values) of one layout, in id order → all their steps and
    values; when every row's steps are consecutive and follow the previous row's (a live
    run's commits), without decoding the rows one by one."""
    values = np.frombuffer(b"".join(r[3] for r in rows), dtype=dtype).reshape(-1, width)
    firsts = np.array([r[0] for r in rows], dtype=np.int64)
    lasts = np.array([r[1] for r in rows], dtype=np.int64)
    if (all(r[2] is None for r in rows) and bool((firsts[1:] == lasts[:-1] + 1).all())
            and int(lasts[-1] - firsts[0]) + 1 == len(values)):
        return np.arange(firsts[0], lasts[-1] + 1, dtype=np.int64), values
    lay = Layout(0, ("",) * width, dtype)
    steps = np.concatenate([blocks.decode(f, st, v, lay)[0] for f, _, st, v in rows])
    return steps, values


def system_rows(walls: np.ndarray, steps: np.ndarray, values: np.ndarray, dtype: str,
                split: bool = True) -> list[tuple[float, float, int, int, bytes, bytes, bytes]]:
    """Rows (first, last, first_step, last_step, walls, steps, values) of the system
    timeline for samples in wall order; at most MAX_BLOCK_VALUES values a row (`split`)."""
    n, k = values.shape
    per = max(blocks.MAX_BLOCK_VALUES // max(k, 1), 64) if split else max(n, 1)
    out = []
    for lo in range(0, n, per):
        w, s = walls[lo:lo + per], steps[lo:lo + per]
        out.append((float(w[0]), float(w[-1]), int(s.min()), int(s.max()),
                    np.ascontiguousarray(w, dtype=np.float64).tobytes(),
                    np.ascontiguousarray(s, dtype=np.int64).tobytes(),
                    np.ascontiguousarray(values[lo:lo + per], dtype=dtype).tobytes()))
    return out


def decode_system(walls: bytes, steps: bytes, values: bytes, dtype: str, width: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One row of the system timeline → (walls f8 [n], steps i8 [n], values [n, width])."""
    return (np.frombuffer(walls, dtype=np.float64), np.frombuffer(steps, dtype=np.int64),
            np.frombuffer(values, dtype=dtype).reshape(-1, width))
