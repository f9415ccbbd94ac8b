"""The run folder's embedded store: one SQLite file, WAL while a run writes.

One writer thread per run batches records into a transaction at least every
`flush_interval` seconds, so a `kill -9` loses at most that much; any number of
readers (this process or another) see every committed transaction while the run writes.
Scalars are stored as blocks (`blocks.py`): one row holds one key family's values for the
steps of one commit. Row ids are never reused (AUTOINCREMENT), so a follower's
`id > cursor` reads every row written after a resume's truncate. When the writer closes,
the WAL is folded into `nbwatch.db` and removed: a finished run is that one file.
The schema lives here and only here.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np
import pandas as pd

from . import blocks
from .blocks import Layout, Part
from .records import Attention, Command, Event, Histogram, Sample, Scalars

DB_NAME = "nbwatch.db"
_RECORDS = (Scalars, Histogram, Attention, Event, Sample, Command)
_OPS = ("meta", "taken", "truncate")
SCHEMA_VERSION = 2
MAX_PENDING = 1_000_000  # scalars queued for the writer before put() waits (back-pressure)
log = logging.getLogger("nbwatch.store")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS keys (id INTEGER PRIMARY KEY, name TEXT UNIQUE NOT NULL);
CREATE TABLE IF NOT EXISTS layouts (
    id INTEGER PRIMARY KEY, family TEXT NOT NULL, dtype TEXT NOT NULL, keys TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS blocks (
    id INTEGER PRIMARY KEY AUTOINCREMENT, layout INTEGER NOT NULL, first INTEGER NOT NULL,
    last INTEGER NOT NULL, steps BLOB, "values" BLOB NOT NULL,
    merged_from INTEGER);  -- a merge of the blocks with ids merged_from..id (compaction)
CREATE INDEX IF NOT EXISTS blocks_layout_last ON blocks (layout, last);
CREATE TABLE IF NOT EXISTS walls (
    id INTEGER PRIMARY KEY AUTOINCREMENT, first INTEGER NOT NULL, last INTEGER NOT NULL,
    steps BLOB, walls BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS walls_last ON walls (last);
CREATE TABLE IF NOT EXISTS histograms (
    id INTEGER PRIMARY KEY AUTOINCREMENT, step INTEGER NOT NULL, name TEXT NOT NULL,
    edges BLOB NOT NULL, counts BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS histograms_name_step ON histograms (name, step);
CREATE TABLE IF NOT EXISTS attention (
    id INTEGER PRIMARY KEY AUTOINCREMENT, step INTEGER NOT NULL, module TEXT NOT NULL,
    sample INTEGER NOT NULL, shape TEXT NOT NULL, weights BLOB NOT NULL, tokens TEXT);
CREATE INDEX IF NOT EXISTS attention_step ON attention (step);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, step INTEGER NOT NULL, wall REAL NOT NULL,
    kind TEXT NOT NULL, severity TEXT NOT NULL, message TEXT NOT NULL, data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS samples (
    id INTEGER PRIMARY KEY AUTOINCREMENT, step INTEGER NOT NULL, wall REAL NOT NULL,
    text TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS commands (
    id INTEGER PRIMARY KEY AUTOINCREMENT, wall REAL NOT NULL, kind TEXT NOT NULL, value REAL,
    source TEXT NOT NULL, taken INTEGER NOT NULL DEFAULT 0);
"""


def is_run_dir(path: str | Path) -> bool:
    """True when `path` holds an nbwatch store."""
    return (Path(path) / DB_NAME).is_file()


def _connect(path: Path, readonly: bool) -> sqlite3.Connection:
    if readonly:
        uri = f"file:{quote(str(path.resolve()))}?mode=ro"  # `#` and `?` are legal in paths
        return sqlite3.connect(uri, uri=True, timeout=10, check_same_thread=False)
    con = sqlite3.connect(path, timeout=10, check_same_thread=False)
    # a new file only, before WAL writes its header: lets a closing writer give the pages
    # that compaction freed back to the disk
    con.execute("PRAGMA auto_vacuum=INCREMENTAL")
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable across process crashes
    return con


def _version(con: sqlite3.Connection) -> int:
    tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    if "meta" not in tables:
        return 0
    row = con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    if row is not None:
        return int(json.loads(row[0]))
    return 1 if "scalars" in tables else 0


class StoreFailed(RuntimeError):
    """The run store stopped writing; the first line of the message says why."""


def _failure(e: BaseException, path: Path) -> str:
    """What a store write failure means for the user, cause first."""
    text = f"{type(e).__name__}: {e}"
    kept = "what was committed before is kept; later records are lost"
    if not path.parent.exists():
        return f"the run folder {path.parent} was deleted while the run wrote to it ({text})"
    try:
        free = shutil.disk_usage(path.parent).free
    except OSError:
        free = None
    if "full" in str(e) or getattr(e, "errno", None) == errno.ENOSPC or (
            free is not None and free < 1 << 20):
        return (f"disk full: the run store {path} could not be written ({text}); free space"
                f" on its disk and resume the run from its newest checkpoint; {kept}")
    limit = _file_size_limit()
    if limit is not None and any(
            p.exists() and p.stat().st_size > limit - (1 << 20)
            for p in (path, path.with_name(path.name + "-wal"))):
        return (f"file size limit reached (ulimit -f, {limit} bytes): the run store {path} "
                f"could not grow ({text}); {kept}")
    return f"the run store {path} stopped writing ({text}); {kept}"


def _file_size_limit() -> int | None:
    try:
        import resource
    except ImportError:
        return None
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else int(soft)


class RunInUse(RuntimeError):
    """Another live writer (a Monitor in this process or another) holds the run folder."""


def _lock_dir(run_dir: Path, exclusive: bool) -> int | None:
    """An flock on the run folder itself (not on the database: closing another descriptor
    of `nbwatch.db` would drop SQLite's own POSIX locks). Returns the descriptor that holds
    it, or None when another process holds a conflicting lock. The OS releases it when the
    process dies, so a killed writer never leaves the folder locked."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, no check
        return -1
    fd = os.open(run_dir, os.O_RDONLY)
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def writer_alive(run_dir: str | Path) -> bool:
    """True while a live writer holds `run_dir` (exact on this host: the OS drops the lock of
    a killed process)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return False
    fd = _lock_dir(run_dir, exclusive=False)
    if fd is None:
        return True
    if fd >= 0:
        os.close(fd)
    return False


def _writer_named(run_dir: Path) -> str:
    """'pid 123 on host x, started 12:01:02' from the run's meta, as far as it says."""
    try:
        meta = RunReader(run_dir).meta()
    except Exception:  # noqa: BLE001 - only for a message
        return "a writer whose meta is not readable yet"
    parts = [f"pid {meta['pid']}" if "pid" in meta else "a process",
             f"on host {meta['host']}" if "host" in meta else ""]
    if isinstance(meta.get("started"), (int, float)):
        parts.append("started " + time.strftime("%H:%M:%S", time.localtime(meta["started"])))
    return " ".join(p for p in parts if p)


def check_no_writer(run_dir: str | Path) -> None:
    """Raise RunInUse, naming the live writer, when another one holds `run_dir`."""
    if writer_alive(run_dir):
        raise RunInUse(_in_use(Path(run_dir)))


def _in_use(run_dir: Path) -> str:
    return (f"{run_dir} is being written by another nbwatch run ({_writer_named(run_dir)}): a "
            "run folder has one writer at a time. Follow it with nbwatch.attach(run_dir), stop"
            " it first, or choose another run_dir")


class RunReader:
    """Read-only view of a run folder; safe to use while another process writes it.

    A connection lives only for one call (or one `with reader.session():`), so no reader
    keeps the database open after its writer has finished with it.
    """

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / DB_NAME
        if not self.path.is_file():
            raise FileNotFoundError(
                f"{self.run_dir} holds no nbwatch run (no {DB_NAME}); "
                "pass the run_dir given to nbwatch.Monitor"
            )
        self._local = threading.local()
        self._layouts: dict[int, Layout] = {}
        self._migrate_if_old()

    def _migrate_if_old(self) -> None:
        con = _connect(self.path, readonly=True)
        try:
            version = _version(con)
        except sqlite3.DatabaseError as e:
            raise RuntimeError(
                f"{self.path} is not a readable nbwatch store ({e}): the file is damaged or"
                " is not an nbwatch database. Its checkpoints/ folder, if any, still holds"
                " the weights") from e
        finally:
            con.close()
        if version == 1:
            from .migrate import migrate_v1

            migrate_v1(self.path)
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
        con = _connect(self.path, readonly=True)
        con.execute("BEGIN")
        self._local.con = con
        try:
            yield
        finally:
            self._local.con = None
            con.close()

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        try:
            con = getattr(self._local, "con", None)
            if con is not None:
                return con.execute(sql, params).fetchall()
            con = _connect(self.path, readonly=True)
            try:
                return con.execute(sql, params).fetchall()
            finally:
                con.close()
        except sqlite3.OperationalError as e:
            if not self.path.exists():
                raise StoreFailed(_failure(e, self.path)) from e
            raise

    def close(self) -> None:
        """Nothing to release (connections live for one call); kept for callers."""

    # -- metadata -----------------------------------------------------------------------
    def meta(self) -> dict[str, Any]:
        return {k: json.loads(v) for k, v in self.query("SELECT key, value FROM meta")}

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
    def _blocks(self, keys: list[str] | None, start: int | None, stop: int | None,
                after_id: int = 0, limit: int | None = None) -> list[tuple]:
        """Block rows (id, layout, first, steps, values, merged_from) that hold any of
        `keys` (all when None) at a step in [start, stop), oldest first."""
        sql = ('SELECT id, layout, first, steps, "values", merged_from FROM blocks'
               " WHERE id > ?")
        params: list[Any] = [after_id]
        if keys is not None:
            self._load_layouts()
            wanted = set(keys)
            ids = [i for i, lay in self._layouts.items() if wanted.intersection(lay.keys)]
            sql += f" AND layout IN ({','.join('?' * len(ids))})"
            params += ids
        if start is not None:
            sql += " AND last >= ?"
            params.append(int(start))
        if stop is not None:
            sql += " AND first < ?"
            params.append(int(stop))
        sql += " ORDER BY id"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        return self.query(sql, params)

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
        step lacks one. Reads only the blocks that hold `keys` in that range."""
        keys = list(keys) if keys is not None else None
        with self.session():
            rows = self._blocks(keys, start, stop)
            order = self.keys()
            for r in rows:
                self.layout(r[1])
        wanted = set(order if keys is None else keys)
        columns = [k for k in order if k in wanted]
        col_of = {k: i for i, k in enumerate(columns)}
        per_layout: dict[int, tuple[list[np.ndarray], list[np.ndarray]]] = {}
        for _, lid, first, steps, values, _ in rows:  # a live run's blocks are small: join
            s, v = blocks.decode(first, steps, values, self._layouts[lid])
            got = per_layout.get(lid) or per_layout.setdefault(lid, ([], []))
            got[0].append(s)
            got[1].append(v)
        parts = []
        trained = []
        for lid, (ss, vs) in per_layout.items():
            lay = self._layouts[lid]
            s = ss[0] if len(ss) == 1 else np.concatenate(ss)
            v = vs[0] if len(vs) == 1 else np.concatenate(vs)
            if start is not None or stop is not None:
                keep = (s >= (start if start is not None else s.min())) & (
                    s < (stop if stop is not None else s.max() + 1))
                s, v = s[keep], v[keep]
            take = [j for j, k in enumerate(lay.keys) if k in col_of]
            if take and len(s):
                parts.append((s, v, take, [col_of[lay.keys[j]] for j in take]))
                if not blocks.is_system(blocks.family(lay.keys[0])):
                    trained.append(s)
        index = None
        if keys is None and _trained_rows and trained:
            index = blocks.union(trained)  # not the sampler's reading before step 1
        return blocks.frame(parts, columns, index)

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
        """The value of `key` at its newest step (None when never recorded)."""
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

    # -- the other record kinds ---------------------------------------------------------
    def events(self, after_id: int = 0) -> pd.DataFrame:
        rows = self.query(
            "SELECT id, step, wall, kind, severity, message, data FROM events WHERE id > ?"
            " ORDER BY id",
            (after_id,),
        )
        df = pd.DataFrame(
            rows, columns=["id", "step", "wall", "kind", "severity", "message", "data"]
        )
        df["data"] = [json.loads(d) for d in df["data"]]
        return df

    def samples(self) -> pd.DataFrame:
        rows = self.query("SELECT step, wall, text FROM samples ORDER BY id")
        return pd.DataFrame(rows, columns=["step", "wall", "text"])

    def histogram_names(self) -> list[str]:
        return [r[0] for r in self.query("SELECT DISTINCT name FROM histograms ORDER BY id")]

    def histograms(self, name: str) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
        """(steps, bin_edges per step, counts [steps, bins]) of one histogram series."""
        rows = self.query(
            "SELECT step, edges, counts FROM histograms WHERE name = ? ORDER BY step", (name,)
        )
        if not rows:
            known = ", ".join(self.histogram_names()[:8]) or "none recorded yet"
            raise KeyError(f"no histogram series {name!r} in this run (known: {known})")
        steps = np.array([r[0] for r in rows], dtype=np.int64)
        edges = [np.frombuffer(r[1], dtype=np.float64) for r in rows]
        counts = np.stack([np.frombuffer(r[2], dtype=np.int64) for r in rows])
        return steps, edges, counts

    def attention_steps(self) -> list[int]:
        return [r[0] for r in self.query("SELECT DISTINCT step FROM attention ORDER BY step")]

    def attention(self, step: int | None = None, sample: int = 0) -> dict[str, np.ndarray]:
        """{module path: weights [heads, T, S]} at the newest (or given) probe step."""
        if step is None:
            steps = self.attention_steps()
            if not steps:
                return {}
            step = steps[-1]
        rows = self.query(
            "SELECT module, shape, weights FROM attention WHERE step = ? AND sample = ?"
            " ORDER BY id",
            (step, sample),
        )
        return {
            m: np.frombuffer(w, dtype=np.float16).reshape(json.loads(s)).astype(np.float32)
            for m, s, w in rows
        }

    def attention_tokens(self, step: int, sample: int = 0) -> list[str] | None:
        rows = self.query(
            "SELECT tokens FROM attention WHERE step = ? AND sample = ? LIMIT 1", (step, sample)
        )
        return json.loads(rows[0][0]) if rows and rows[0][0] else None

    def pending_commands(self, after_id: int = 0) -> list[tuple[int, Command]]:
        """Commands not yet taken (with an id above `after_id`: `taken` is committed late)."""
        rows = self.query(
            "SELECT id, kind, value, source FROM commands WHERE taken = 0 AND id > ? ORDER BY id",
            (after_id,),
        )
        return [(r[0], Command(r[1], r[2], r[3])) for r in rows]


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
            kid = self.key_ids[name] = int(cur.lastrowid)
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
                    lid = self.layout_ids[(fam, ids)] = int(cur.lastrowid)
                parts.append(Part(lid, np.array(cols, dtype=np.int64), dtype))
            trained = any(not blocks.is_system(blocks.family(k)) for k in names)
            plan = self.plans[names] = (parts, trained)
        return plan

    def write(self, groups: dict[tuple[str, ...], tuple[list, list, list]]) -> None:
        """Runs of Scalars, grouped by key names: each group becomes a block per family."""
        con = self.con
        wall_steps: list[np.ndarray] = []
        wall_times: list[np.ndarray] = []
        rows = []
        for names, (steps, walls, values) in groups.items():
            parts, trained = self.plan(names)
            s = np.array(steps, dtype=np.int64)
            v = np.array(values, dtype=np.float64).reshape(len(steps), len(names))
            for p in parts:
                sub = v if len(p.columns) == len(names) else v[:, p.columns]
                rows += [(p.layout, *b) for b in blocks.encode(s, sub, p.dtype)]
            if trained:
                wall_steps.append(s)
                wall_times.append(np.array(walls, dtype=np.float64))
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

    def compact(self) -> int:
        """Merge each layout's small blocks (a live run commits a few steps at a time) into
        blocks of up to MAX_BLOCK_VALUES values, and the same for walls, so a finished run
        reads as fast as one written in bulk. A merged block keeps the highest id of the
        blocks it replaces and notes the lowest (`merged_from`): a follower's cursor past
        them does not read them again, one between them drops the steps it has read.
        Returns the number of blocks removed."""
        con = self.con
        removed = 0
        tables = [("blocks", '"values"', lid, len(keys), dtype)
                  for (_, keys), lid in self.layout_ids.items()
                  for dtype in [self.layout(lid).dtype]]
        tables.append(("walls", "walls", None, 1, "f8"))
        for table, col, lid, width, dtype in tables:
            where, params = ("layout = ?", (lid,)) if lid is not None else ("1", ())
            size = np.dtype(dtype).itemsize * width
            groups: list[list[int]] = [[]]
            held = 0
            for bid, nbytes in con.execute(
                    f"SELECT id, length({col}) FROM {table} WHERE {where} ORDER BY id", params):
                n = nbytes // size
                if n * width > blocks.MAX_BLOCK_VALUES // 16:  # big enough: left as it is
                    if groups[-1]:
                        groups.append([])
                    held = 0
                    continue
                if held + n > blocks.MAX_BLOCK_VALUES // width and groups[-1]:
                    groups.append([])
                    held = 0
                groups[-1].append(bid)
                held += n
            for ids in groups:
                if len(ids) < 2:
                    continue
                marks = ",".join("?" * len(ids))
                rows = con.execute(f"SELECT first, steps, {col} FROM {table} WHERE id IN"
                                   f" ({marks}) ORDER BY id", ids).fetchall()
                lay = Layout(0, ("",) * width, dtype)
                parts = [blocks.decode(f, st, v, lay) for f, st, v in rows]
                steps = np.concatenate([p[0] for p in parts])
                values = np.concatenate([p[1] for p in parts])
                (first, last, st, v), = blocks.encode(steps, values, dtype)
                con.execute(f"DELETE FROM {table} WHERE id IN ({marks})", ids)
                if lid is not None:
                    con.execute('INSERT INTO blocks (id, layout, first, last, steps, "values",'
                                " merged_from) VALUES (?, ?, ?, ?, ?, ?, ?)",
                                (ids[-1], lid, first, last, st, v, ids[0]))
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


class RunStore(RunReader):
    """The writable store of one run: records go through `put()` to one writer thread.

    `put()` returns at once while fewer than `max_pending` scalars wait for the writer;
    past that it blocks the producer (the training thread) until the writer catches up,
    so memory stays bounded and nothing is dropped.
    """

    def __init__(self, run_dir: str | Path, flush_interval: float = 0.2,
                 max_pending: int = MAX_PENDING):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / DB_NAME
        for _ in range(20):  # a reader's probe holds a shared lock for a moment
            lock = _lock_dir(self.run_dir, exclusive=True)
            if lock is not None:
                break
            time.sleep(0.05)
        else:
            raise RunInUse(_in_use(self.run_dir))
        self._lock = lock
        try:
            self._open_writer(flush_interval, max_pending)
        except BaseException:
            self._unlock()
            raise

    def _unlock(self) -> None:
        if self._lock >= 0:
            os.close(self._lock)
            self._lock = -1

    def _open_writer(self, flush_interval: float, max_pending: int) -> None:
        self._local = threading.local()
        self._layouts = {}
        if self.path.is_file():
            self._migrate_if_old()
        con = _connect(self.path, readonly=False)
        con.executescript(_SCHEMA)
        con.execute(
            "INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (json.dumps(SCHEMA_VERSION),)
        )
        con.commit()
        self._wcon = con
        self._tables = ScalarTables(con)
        self._buf: list[Any] = []
        self._pending = 0  # scalars in _buf
        self.max_pending = max_pending
        self._cond = threading.Condition()
        self._written = 0  # batches committed, for flush()
        self._queued = 0
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.flush_interval = flush_interval
        self._thread = threading.Thread(target=self._loop, name="nbwatch-store", daemon=True)
        self._thread.start()

    # -- writer API (any thread) --------------------------------------------------------
    def put(self, record: Any) -> None:
        """Queue a record (Scalars, Histogram, Attention, Event, Sample) for the next commit;
        blocks while the writer is `max_pending` scalars behind."""
        if self.error is not None:
            raise StoreFailed(str(self.error)) from self.error.__cause__
        if isinstance(record, Scalars):
            n = len(record.values)
        elif isinstance(record, _RECORDS) or (isinstance(record, tuple) and record
                                              and record[0] in _OPS):
            n = 1
        else:
            raise TypeError(f"cannot store a {type(record).__name__}")  # here, not in a batch
        with self._cond:
            if self._pending >= self.max_pending:
                self._cond.notify_all()
                while self._pending >= self.max_pending and self._thread.is_alive():
                    self._cond.wait(1.0)
                if self.error is not None:
                    raise StoreFailed(str(self.error)) from self.error.__cause__
            self._buf.append(record)
            self._pending += n
            if self._pending >= self.max_pending // 2:
                self._cond.notify_all()  # write now, not at the next interval

    def set_meta(self, key: str, value: Any) -> None:
        self.put(("meta", key, json.dumps(value, default=str)))

    def add_command(self, command: Command) -> None:
        self.put(command)

    def mark_taken(self, command_id: int) -> None:
        self.put(("taken", command_id))

    def truncate_after(self, step: int) -> None:
        """Drop records of steps after `step` (a resumed run recomputes them)."""
        self.put(("truncate", step))

    def flush(self, timeout: float = 10.0) -> None:
        """Block until everything queued so far is committed."""
        with self._cond:
            self._queued += 1
            target = self._queued
            self._cond.notify_all()
            ok = self._cond.wait_for(
                lambda: self._written >= target or not self._thread.is_alive(), timeout
            )
        if self.error is not None:
            raise StoreFailed(str(self.error)) from self.error.__cause__
        if not ok:
            raise TimeoutError(f"the run store at {self.path} did not commit within {timeout}s")

    def close(self) -> None:
        """Commit what is queued, fold the WAL into `nbwatch.db` and remove it."""
        if self._thread.is_alive():
            self.flush(timeout=60)
            self._stop.set()
            with self._cond:
                self._cond.notify_all()
            self._thread.join(timeout=60)
        if not self._thread.is_alive():
            self._unlock()

    # -- writer thread ------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(
                        lambda: (self._stop.is_set() or self._queued > self._written
                                 or self._pending >= self.max_pending // 2),
                        self.flush_interval,
                    )
                    batch, self._buf = self._buf, []
                    self._pending = 0
                    target = self._queued
                    self._cond.notify_all()  # a put() waiting on back-pressure goes on
                if batch:
                    self._write(batch)
                with self._cond:
                    self._written = max(self._written, target)
                    self._cond.notify_all()
                if self._stop.is_set():
                    break
            with self._wcon:
                removed = self._tables.compact()
            if removed:
                self._wcon.executescript("PRAGMA incremental_vacuum;")  # runs to the end
            self._fold_wal()
        except BaseException as e:  # never die silently: flush() and put() re-raise it
            self.error = StoreFailed(_failure(e, self.path))
            self.error.__cause__ = e
            log.exception("nbwatch store writer failed; records after this point are lost")
            with self._cond:
                self._cond.notify_all()
        finally:
            self._wcon.close()

    def _fold_wal(self) -> None:
        """Checkpoint the WAL into the database file and leave WAL mode, so the run folder's
        `nbwatch.db` alone holds every record. A reader of another process that holds the
        file open at this moment keeps the (emptied) WAL until the next writer."""
        con = self._wcon
        for _ in range(20):
            try:
                con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                if con.execute("PRAGMA journal_mode=DELETE").fetchone()[0] == "delete":
                    return
            except sqlite3.OperationalError:
                pass
            time.sleep(0.05)
        log.warning("%s: a reader held the database open; its WAL is emptied but kept",
                    self.path)

    def _write(self, batch: list[Any]) -> None:
        con = self._wcon
        groups: dict[tuple[str, ...], tuple[list, list, list]] = {}
        with con:  # one transaction
            for r in batch:
                if isinstance(r, Scalars):
                    names = tuple(r.values)
                    g = groups.get(names)
                    if g is None:
                        g = groups[names] = ([], [], [])
                    g[0].append(r.step)
                    g[1].append(r.wall)
                    g[2].append(list(r.values.values()))
                    continue
                if isinstance(r, Histogram):
                    con.execute(
                        "INSERT INTO histograms (step, name, edges, counts) VALUES (?, ?, ?, ?)",
                        (
                            r.step,
                            r.name,
                            np.ascontiguousarray(r.edges, dtype=np.float64).tobytes(),
                            np.ascontiguousarray(r.counts, dtype=np.int64).tobytes(),
                        ),
                    )
                elif isinstance(r, Attention):
                    w = np.ascontiguousarray(r.weights, dtype=np.float16)
                    con.execute(
                        "INSERT INTO attention (step, module, sample, shape, weights, tokens)"
                        " VALUES (?, ?, ?, ?, ?, ?)",
                        (
                            r.step,
                            r.module,
                            r.sample,
                            json.dumps(list(w.shape)),
                            w.tobytes(),
                            json.dumps(list(r.tokens)) if r.tokens is not None else None,
                        ),
                    )
                elif isinstance(r, Event):
                    con.execute(
                        "INSERT INTO events (step, wall, kind, severity, message, data)"
                        " VALUES (?, ?, ?, ?, ?, ?)",
                        (r.step, r.wall, r.kind, r.severity, r.message,
                         json.dumps(r.data, default=str)),
                    )
                elif isinstance(r, Sample):
                    con.execute(
                        "INSERT INTO samples (step, wall, text) VALUES (?, ?, ?)",
                        (r.step, r.wall, r.text),
                    )
                elif isinstance(r, Command):
                    con.execute(
                        "INSERT INTO commands (wall, kind, value, source) VALUES (?, ?, ?, ?)",
                        (time.time(), r.kind, r.value, r.source),
                    )
                elif r[0] == "meta":
                    con.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (r[1], r[2]))
                elif r[0] == "taken":
                    con.execute("UPDATE commands SET taken = 1 WHERE id = ?", (r[1],))
                elif r[0] == "truncate":
                    if groups:  # scalars queued before a truncate are cut by it
                        self._tables.write(groups)
                    self._tables.truncate(r[1])
                else:
                    raise TypeError(f"cannot store a {type(r).__name__}")
            if groups:
                self._tables.write(groups)
