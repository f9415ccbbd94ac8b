"""Reading a run folder: any process, any thread, while the run writes or after."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import warnings
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from . import blocks
from .blocks import Layout
from .record_reads import RecordReads
from .recover import hot_journal, leftovers, recover, unreadable
from .schema import DB_NAME, SCHEMA_VERSION, StoreFailed, _connect, _failure, _version
from .system_reads import SystemReads


def _prefetched(cur: sqlite3.Cursor, n: int = 4) -> Iterator[tuple]:
    """The rows of `cur`, the next `n` read by a helper thread while the caller works on
    these (numpy's copies release the GIL: SQLite's reads and the frame's fill overlap)."""
    with ThreadPoolExecutor(1, thread_name_prefix="nbwatch-read") as pool:
        nxt = pool.submit(cur.fetchmany, n)
        while rows := nxt.result():
            nxt = pool.submit(cur.fetchmany, n)
            yield from rows


def _cannot_write(e: sqlite3.OperationalError) -> bool:
    """True for SQLite's refusals to write (a read-only mount or file, a folder where the
    journal cannot be made), as against a damaged file."""
    name = getattr(e, "sqlite_errorname", "")
    return name.startswith(("SQLITE_READONLY", "SQLITE_CANTOPEN", "SQLITE_PERM")) or (
        "readonly database" in str(e))


def _json_kind(v: Any) -> str:
    kinds = {list: "list", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if v is None else kinds.get(type(v), type(v).__name__)


class RunReader(RecordReads, SystemReads):
    """Read-only view of a run folder; safe to use while another process writes it.
    Scalars and walls here; the system timeline in `SystemReads` (system_reads.py);
    events, samples, histograms, attention and commands in `RecordReads`
    (record_reads.py).

    A connection lives only for one call (or one `with reader.session():`), so no reader
    keeps the database open after its writer has finished with it.
    """

    def __init__(self, run_dir: str | os.PathLike[str]):
        self.run_dir = Path(run_dir).absolute()  # a later os.chdir (%cd) must not move it
        self.path = self.run_dir / DB_NAME
        if not self.path.is_file():
            raise FileNotFoundError(
                f"{self.run_dir} holds no nbwatch run (no {DB_NAME}); "
                "pass the run_dir given to nbwatch.Monitor"
            )
        self._local = threading.local()
        self._layouts: dict[int, Layout] = {}
        self._file: tuple[int, ...] | None = None  # the database file the layouts are of
        # what a writer killed mid-write left (a hot journal, an unfolded WAL): put right
        # with one read-write open when no writer holds the folder
        self._recovered = recover(self.run_dir) if leftovers(self.path) else None
        self._migrate_if_old()

    def _migrate_if_old(self) -> None:
        con = _connect(self.path, readonly=True)
        try:
            version = _version(con)
        except sqlite3.DatabaseError as e:
            if hot_journal(self.path):
                raise StoreFailed(unreadable(self.path, getattr(self, "_recovered", None))
                                  ) from e
            raise RuntimeError(
                f"{self.path} is not a readable nbwatch store ({e}): the file is damaged or"
                " is not an nbwatch database. Its checkpoints/ folder, if any, still holds"
                " the weights") from e
        finally:
            con.close()
        if version == 1:
            from .migrate import migrate_v1

            try:
                migrate_v1(self.path)
            except sqlite3.OperationalError as e:  # the mount or the file is read-only
                if not _cannot_write(e):
                    raise
                raise RuntimeError(
                    f"{self.path} is an nbwatch 0.1.0 run (schema 1) that must be migrated once"
                    f" before it can be read, but it cannot be written here ({e}): copy the run"
                    " folder somewhere writable and open the copy") from e
        elif version > SCHEMA_VERSION:
            raise RuntimeError(
                f"{self.path} was written by a newer nbwatch (schema {version}; this one reads"
                f" up to {SCHEMA_VERSION}): upgrade nbwatch to open it")

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """Hold one connection (and one snapshot) for the queries inside the block."""
        if getattr(self._local, "con", None) is not None:
            yield
            return
        con = self._connect()
        con.execute("BEGIN")
        self._local.con = con
        try:
            yield
        finally:
            self._local.con = None
            con.close()

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        try:
            return self._query(sql, params)
        except sqlite3.OperationalError as e:
            if not self.path.exists():
                raise StoreFailed(_failure(e, self.path)) from e
            # a writer killed mid-commit since this reader opened (network mode: its
            # rollback journal is hot): put right with one read-write open, read again
            if (getattr(e, "sqlite_errorname", "") == "SQLITE_READONLY_ROLLBACK"
                    and hot_journal(self.path)):
                why = recover(self.run_dir)
                if why == "a live writer holds the run folder":
                    raise  # it is committing right now: the next read goes through
                if why is not None:
                    raise StoreFailed(unreadable(self.path, why)) from e
                return self._query(sql, params)
            raise

    def _query(self, sql: str, params: Sequence[Any]) -> list[tuple]:
        con = getattr(self._local, "con", None)
        if con is not None:
            return con.execute(sql, params).fetchall()
        con = self._connect()
        try:
            return con.execute(sql, params).fetchall()
        finally:
            con.close()

    def _connect(self) -> sqlite3.Connection:
        """A read-only connection. Where the database file changed since the last one, what
        was cached of it is read again: the folder may have been deleted and a new run
        written in its place, whose layout ids name other keys (the inode alone may be
        reused; a live run's file changes only at its WAL's checkpoints)."""
        con = _connect(self.path, readonly=True)
        with contextlib.suppress(OSError):
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino, st.st_mtime_ns) != self._file:
                self._layouts.clear()
                self._file = (st.st_dev, st.st_ino, st.st_mtime_ns)
        return con

    def close(self) -> None:
        """Nothing to release (connections live for one call); kept for callers."""

    # -- metadata -----------------------------------------------------------------------
    def meta(self) -> dict[str, Any]:
        return {k: self.decoded(k, v) for k, v in self.query("SELECT key, value FROM meta")}

    def decoded(self, key: str, text: str) -> Any:
        """One meta value; one not JSON (an edited or crafted file) is a ValueError naming
        the file and the key, not a bare JSONDecodeError or RecursionError."""
        try:
            return json.loads(text)
        except (ValueError, TypeError, RecursionError) as e:
            why = "nested too deep" if isinstance(e, RecursionError) else str(e)
            raise ValueError(
                f"{self.path}: its meta value {key[:80]!r} is not readable JSON ({why}): the"
                " file was edited or damaged; ask for a fresh copy of the run folder") from None

    def config(self, meta: dict[str, Any] | None = None) -> dict[str, Any]:
        """The run's config (from `meta` when given): a JSON object; anything else, which
        nbwatch never writes, is read as no config, with a warning naming the file."""
        config = (self.meta() if meta is None else meta).get("config", {})
        if isinstance(config, dict):
            return config
        warnings.warn(f"nbwatch: {self.path}: its config is a JSON {_json_kind(config)}, not "
                      "an object of settings; read as no config", stacklevel=2)
        return {}

    def store_mode(self) -> str:
        """How the folder's newest writer wrote it: "local" (WAL, one host) or "network"
        (rollback journal and a heartbeat file: a shared filesystem); see `mode.py`.
        Folders of an nbwatch before the two modes are "local"."""
        row = self.query("SELECT value FROM meta WHERE key = 'store_mode'")
        return str(json.loads(row[0][0])) if row else "local"

    def last_step(self) -> int:
        row = self.query("SELECT MAX(last) FROM walls")
        return int(row[0][0]) if row and row[0][0] is not None else 0

    def keys(self) -> list[str]:
        return [r[0] for r in self.query("SELECT name FROM keys ORDER BY id")]

    def layout(self, layout_id: int) -> Layout:
        lay = self._layouts.get(layout_id)
        if lay is None:
            self._load_layouts()
            lay = self._layouts[layout_id]
        return lay

    def _load_layouts(self) -> None:
        """Layouts are only ever added: read the ones this reader has not seen."""
        with self.session():
            names = dict(self.query("SELECT id, name FROM keys"))
            for i, dtype, ids in self.query("SELECT id, dtype, keys FROM layouts WHERE id > ?",
                                            (max(self._layouts, default=0),)):
                self._layouts[i] = Layout(i, tuple(names[k] for k in json.loads(ids)), dtype)

    # -- scalars ------------------------------------------------------------------------
    def _layout_filter(self, keys: Iterable[str] | None, params: list[Any]) -> str:
        """The SQL condition on `layout` for rows that hold any of `keys` (none: all), its
        parameters appended to `params`."""
        if keys is None:
            return ""
        self._load_layouts()
        wanted = set(keys)
        ids = [i for i, lay in self._layouts.items() if wanted.intersection(lay.keys)]
        params += ids
        return f" AND layout IN ({','.join('?' * len(ids))})"

    def _blocks(self, keys: list[str] | None, start: int | None, stop: int | None,
                after_id: int = 0, limit: int | None = None,
                columns: str = 'id, layout, first, steps, "values", merged_from'
                ) -> tuple[str, list[Any]]:
        """The query of block rows (`columns`) that hold any of `keys` (all when None) at a
        step in [start, stop), oldest first."""
        sql = f"SELECT {columns} FROM blocks WHERE id > ?"
        params: list[Any] = [after_id]
        sql += self._layout_filter(keys, params)
        if start is not None:
            sql += " AND last >= ?"
            params.append(int(start))
        if stop is not None:
            sql += " AND first < ?"
            params.append(int(stop))
        sql += " ORDER BY id"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        return sql, params

    def block_rows(self, keys: list[str] | None = None, start: int | None = None,
                   stop: int | None = None, after_id: int = 0, limit: int | None = None
                   ) -> list[tuple]:
        """Block rows (id, layout, first, steps, values, merged_from) that hold any of
        `keys` (all when None) at a step in [start, stop), oldest first."""
        return self.query(*self._blocks(keys, start, stop, after_id, limit))

    def series(self, keys: Iterable[str] | None = None, start: int | None = None,
               stop: int | None = None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """{key: (steps, values float64)} for steps in [start, stop), in key order; where a
        step was recorded twice, the later value wins."""
        df = self.scalars(keys, start, stop, _trained_rows=False)
        out = {}
        for col in df.columns:
            v = df[col].to_numpy()
            ok = ~np.isnan(v)
            out[col] = (df.index.to_numpy()[ok], v[ok])
        return out

    def scalars(self, keys: Iterable[str] | None = None, start: int | None = None,
                stop: int | None = None, *, _trained_rows: bool = True) -> pd.DataFrame:
        """One row per step in [start, stop) (the index), one column per scalar; NaN where a
        step lacks one. Reads only the blocks that hold `keys` in that range. A `system/...`
        column holds, at each step, the newest system sample taken while the run stood at
        that step (every sample, on its wall-clock timeline: `system()`)."""
        keys = list(keys) if keys is not None else None
        with self.session():
            # two passes over one snapshot: the steps first (small), then the values one
            # block at a time into the frame, so no block waits in memory beside it
            heads = self.query(*self._blocks(keys, start, stop,
                                             columns="id, layout, first, last, steps"))
            order = self.keys()
            for r in heads:
                self.layout(r[1])
            system = self._system_rows(keys, start=start, stop=stop) if keys is None or any(
                blocks.is_system(blocks.family(k)) for k in keys) else []
            wanted = set(order if keys is None else keys)
            columns = [k for k in order if k in wanted]
            col_of = {k: i for i, k in enumerate(columns)}
            where: dict[int, tuple[list[int], list[int]]] = {}  # layout: (take, to)
            # block id: its steps in the window, and which of its rows they are (None: all)
            steps_of: dict[int, tuple[np.ndarray, np.ndarray | None]] = {}
            per_layout: dict[int, list[np.ndarray]] = {}
            for bid, lid, first, last, steps in heads:
                s = (np.frombuffer(steps, dtype=np.int64) if steps is not None
                     else np.arange(first, last + 1, dtype=np.int64))
                keep = None
                if (start is not None and first < start) or (stop is not None and last >= stop):
                    keep = np.ones(len(s), dtype=bool)
                    if start is not None:
                        keep &= s >= start
                    if stop is not None:
                        keep &= s < stop
                    s = s[keep]
                lay = self._layouts[lid]
                if lid not in where:
                    take = [j for j, k in enumerate(lay.keys) if k in col_of]
                    where[lid] = (take, [col_of[lay.keys[j]] for j in take])
                if where[lid][0] and len(s):
                    steps_of[bid] = (s, keep)
                    per_layout.setdefault(lid, []).append(s)
            system_parts = self._system_by_step(system, col_of, start, stop)
            layout_steps = {lid: ss[0] if len(ss) == 1 else np.concatenate(ss)
                            for lid, ss in per_layout.items()}
            trained = [s for lid, s in layout_steps.items()
                       if not blocks.is_system(blocks.family(self._layouts[lid].keys[0]))]
            if keys is None and _trained_rows and trained:
                index = blocks.union(trained)  # not the sampler's reading before step 1
            else:
                index = blocks.union([*layout_steps.values(), *(p[0] for p in system_parts)])
            full = {c for lid, s in layout_steps.items() if blocks.covered(index, s)
                    for c in where[lid][1]}
            full |= {c for p in system_parts if blocks.covered(index, p[0]) for c in p[3]}
            out = blocks.Frame(index, columns, full)
            if steps_of:
                sql, params = self._blocks(keys, start, stop, columns='id, layout, "values"')
                for bid, lid, values in _prefetched(self._local.con.execute(sql, params)):
                    got = steps_of.get(bid)
                    if got is None:
                        continue
                    lay = self._layouts[lid]
                    v = np.frombuffer(values, dtype=lay.dtype).reshape(-1, len(lay.keys))
                    out.place(got[0], v if got[1] is None else v[got[1]], *where[lid])
        for part in system_parts:
            out.place(*part)
        return out.df()

    def df(self, keys: Iterable[str] | None = None) -> pd.DataFrame:
        """One row per step (the index), one column per scalar; NaN where a step lacks one."""
        return self.scalars(keys)

    def scalars_long(self, keys: Iterable[str] | None = None) -> pd.DataFrame:
        """Scalars as a long frame (step, key, value), by key then step."""
        parts = [pd.DataFrame({"step": s, "key": k, "value": v})
                 for k, (s, v) in self.series(keys).items()]
        if not parts:
            return pd.DataFrame({"step": pd.Series(dtype="int64"), "key": pd.Series(dtype=str),
                                 "value": pd.Series(dtype="float64")})
        return pd.concat(parts, ignore_index=True)

    def walls(self) -> pd.Series:
        """Wall-clock time (seconds since the epoch) at which each step was recorded."""
        steps, walls = self._walls(self.query(
            "SELECT first, steps, walls FROM walls ORDER BY id"))
        return pd.Series(walls, index=pd.Index(steps, name="step"), name="wall")

    def recent_walls(self, n: int = 64) -> list[tuple[int, float]]:
        """(step, wall) of the newest `n` recorded steps, oldest first (for rates and ETA)."""
        rows: list[tuple] = []
        got = 0
        while got < n:
            more = self.query("SELECT id, first, steps, walls FROM walls WHERE id < ?"
                              " ORDER BY id DESC LIMIT 16", (rows[-1][0] if rows else 2**62,))
            if not more:
                break
            rows += more
            got += sum(len(r[3]) // 8 for r in more)
        steps, walls = self._walls([r[1:] for r in reversed(rows)])
        return list(zip(steps[-n:].tolist(), walls[-n:].tolist()))

    def last_wall(self) -> float | None:
        """Wall time of the newest recorded step."""
        return self.wall_range()[1]

    def walls_since(self, after_id: int, limit: int) -> tuple[int, int, np.ndarray, np.ndarray]:
        """Steps' walls in the rows after id `after_id` (at most `limit` rows): (the last id
        read, rows read, steps sorted unique, their first wall)."""
        rows = self.query("SELECT id, first, steps, walls FROM walls WHERE id > ? ORDER BY id"
                          " LIMIT ?", (after_id, limit))
        steps, walls = self._walls([r[1:] for r in rows])
        return (rows[-1][0] if rows else after_id), len(rows), steps, walls

    def wall_range(self) -> tuple[float | None, float | None]:
        """Wall times of the first and the newest recorded step."""
        with self.session():
            first = self.query("SELECT walls FROM walls ORDER BY id LIMIT 1")
            last = self.query("SELECT walls FROM walls ORDER BY id DESC LIMIT 1")
        if not first:
            return None, None
        return (float(np.frombuffer(first[0][0], dtype=np.float64).min()),
                float(np.frombuffer(last[0][0], dtype=np.float64).max()))

    def best(self, key: str) -> tuple[int, float] | None:
        """(step, value) of the lowest finite value of `key`; the earliest step on a tie."""
        steps, values = self.series([key]).get(key, (np.empty(0), np.empty(0)))
        ok = np.isfinite(values)
        if not ok.any():
            return None
        i = int(np.argmin(np.where(ok, values, np.inf)))
        return int(steps[i]), float(values[i])

    def last_value(self, key: str) -> float | None:
        """The value of `key` at its newest step (None when never recorded); of a
        `system/...` key, the newest sample."""
        if blocks.is_system(blocks.family(key)):
            with self.session():
                self._load_layouts()
                ids = [i for i, lay in self._layouts.items() if key in lay.keys]
                rows = self._has_system() and self.query(
                    'SELECT id, layout, walls, steps, "values", merged_from FROM system_samples'
                    f" WHERE layout IN ({','.join('?' * len(ids))}) ORDER BY last DESC, id DESC"
                    " LIMIT 1", ids)
            if rows:
                lay, _, _, v = self.decode_system(rows[0])
                return float(v[-1, lay.keys.index(key)])
        with self.session():
            self._load_layouts()
            ids = [i for i, lay in self._layouts.items() if key in lay.keys]
            rows = self.query(
                f'SELECT first, steps, "values", layout FROM blocks WHERE layout IN'
                f" ({','.join('?' * len(ids))}) ORDER BY last DESC, id DESC LIMIT 1", ids)
        if not rows:
            return None
        first, steps, values, lid = rows[0]
        lay = self._layouts[lid]
        s, v = blocks.decode(first, steps, values, lay)
        return float(v[int(np.argmax(s)), lay.keys.index(key)])

    @staticmethod
    def _walls(rows: list[tuple]) -> tuple[np.ndarray, np.ndarray]:
        """Rows (first, steps, walls) → sorted unique steps and their first wall."""
        if not rows:
            return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float64)
        w = [np.frombuffer(r[2], dtype=np.float64) for r in rows]
        s = [np.frombuffer(r[1], dtype=np.int64) if r[1] is not None
             else np.arange(r[0], r[0] + len(x), dtype=np.int64) for r, x in zip(rows, w)]
        steps, walls = np.concatenate(s), np.concatenate(w)
        uniq, first = np.unique(steps, return_index=True)
        return uniq, walls[first]
