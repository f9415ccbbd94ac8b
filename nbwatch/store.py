"""The run folder's embedded store: one SQLite file in WAL mode.

One writer thread per run batches records into a transaction at least every
`flush_interval` seconds, so a `kill -9` loses at most that much; any number of
readers (this process or another) open their own read-only connections and see
every committed transaction while the run writes. The schema lives here and only here.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from .records import Attention, Command, Event, Histogram, Sample, Scalars

DB_NAME = "nbwatch.db"
_RECORDS = (Scalars, Histogram, Attention, Event, Sample, Command)
_OPS = ("meta", "taken", "truncate")
SCHEMA_VERSION = 1
log = logging.getLogger("nbwatch.store")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS keys (id INTEGER PRIMARY KEY, name TEXT UNIQUE NOT NULL);
CREATE TABLE IF NOT EXISTS steps (step INTEGER PRIMARY KEY, wall REAL NOT NULL);
CREATE TABLE IF NOT EXISTS scalars (
    id INTEGER PRIMARY KEY, step INTEGER NOT NULL, key INTEGER NOT NULL, value REAL);
CREATE UNIQUE INDEX IF NOT EXISTS scalars_key_step ON scalars (key, step);
CREATE TABLE IF NOT EXISTS histograms (
    id INTEGER PRIMARY KEY, step INTEGER NOT NULL, name TEXT NOT NULL,
    edges BLOB NOT NULL, counts BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS histograms_name_step ON histograms (name, step);
CREATE TABLE IF NOT EXISTS attention (
    id INTEGER PRIMARY KEY, step INTEGER NOT NULL, module TEXT NOT NULL, sample INTEGER NOT NULL,
    shape TEXT NOT NULL, weights BLOB NOT NULL, tokens TEXT);
CREATE INDEX IF NOT EXISTS attention_step ON attention (step);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY, step INTEGER NOT NULL, wall REAL NOT NULL, kind TEXT NOT NULL,
    severity TEXT NOT NULL, message TEXT NOT NULL, data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS samples (
    id INTEGER PRIMARY KEY, step INTEGER NOT NULL, wall REAL NOT NULL, text TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS commands (
    id INTEGER PRIMARY KEY, wall REAL NOT NULL, kind TEXT NOT NULL, value REAL,
    source TEXT NOT NULL, taken INTEGER NOT NULL DEFAULT 0);
"""


def is_run_dir(path: str | Path) -> bool:
    """True when `path` holds an nbwatch store."""
    return (Path(path) / DB_NAME).is_file()


def _connect(path: Path, readonly: bool) -> sqlite3.Connection:
    if readonly:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10, check_same_thread=False)
    else:
        con = sqlite3.connect(path, timeout=10, check_same_thread=False)
        con.execute("PRAGMA journal_mode=WAL")
        con.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable across process crashes
    return con


class RunReader:
    """Read-only view of a run folder; safe to use while another process writes it."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / DB_NAME
        if not self.path.is_file():
            raise FileNotFoundError(
                f"{self.run_dir} holds no nbwatch run (no {DB_NAME}); "
                "pass the run_dir given to nbwatch.Monitor"
            )
        self._local = threading.local()

    def _con(self) -> sqlite3.Connection:
        con = getattr(self._local, "con", None)
        if con is None:
            con = self._local.con = _connect(self.path, readonly=True)
        return con

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        return self._con().execute(sql, params).fetchall()

    def close(self) -> None:
        con = getattr(self._local, "con", None)
        if con is not None:
            con.close()
            self._local.con = None

    # -- metadata -----------------------------------------------------------------------
    def meta(self) -> dict[str, Any]:
        return {k: json.loads(v) for k, v in self.query("SELECT key, value FROM meta")}

    def last_step(self) -> int:
        row = self.query("SELECT MAX(step) FROM steps")
        return int(row[0][0]) if row and row[0][0] is not None else 0

    def keys(self) -> list[str]:
        return [r[0] for r in self.query("SELECT name FROM keys ORDER BY id")]

    # -- scalars ------------------------------------------------------------------------
    def scalars_long(
        self, keys: Iterable[str] | None = None, after_id: int = 0
    ) -> pd.DataFrame:
        """Scalar rows as a long frame (id, step, key, value), oldest first."""
        sql = (
            "SELECT s.id, s.step, k.name, s.value FROM scalars s JOIN keys k ON s.key = k.id"
            " WHERE s.id > ?"
        )
        params: list[Any] = [after_id]
        if keys is not None:
            keys = list(keys)
            sql += f" AND k.name IN ({','.join('?' * len(keys))})"
            params += keys
        rows = self.query(sql + " ORDER BY s.id", params)
        df = pd.DataFrame(rows, columns=["id", "step", "key", "value"])
        df["value"] = df["value"].astype("float64")
        return df

    def df(self, keys: Iterable[str] | None = None) -> pd.DataFrame:
        """One row per step (the index), one column per scalar; NaN where a step lacks one."""
        long = self.scalars_long(keys)
        if long.empty:
            return pd.DataFrame(index=pd.Index([], name="step", dtype="int64"))
        wide = long.pivot(index="step", columns="key", values="value")  # (key, step) is unique
        wide.columns.name = None
        order = [k for k in self.keys() if k in wide.columns]
        wide = wide[order]
        trained = [c for c in order if not c.startswith("system/")]
        if trained and keys is None:  # a row per step: not the sampler's reading before step 1
            wide = wide[wide[trained].notna().any(axis=1)]
        return wide

    def walls(self) -> pd.Series:
        """Wall-clock time (seconds since the epoch) at which each step was recorded."""
        rows = self.query("SELECT step, wall FROM steps ORDER BY step")
        return pd.Series(
            [r[1] for r in rows], index=pd.Index([r[0] for r in rows], name="step"), name="wall"
        )

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


class RunStore(RunReader):
    """The writable store of one run: records go through `put()` to one writer thread."""

    def __init__(self, run_dir: str | Path, flush_interval: float = 0.2):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / DB_NAME
        con = _connect(self.path, readonly=False)
        con.executescript(_SCHEMA)
        con.execute(
            "INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (json.dumps(SCHEMA_VERSION),)
        )
        con.commit()
        self._wcon = con
        self._key_ids = dict((n, i) for i, n in con.execute("SELECT id, name FROM keys"))
        self._local = threading.local()
        self._buf: list[Any] = []
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
        """Queue a record (Scalars, Histogram, Attention, Event, Sample) for the next commit."""
        if self.error is not None:
            raise RuntimeError(f"the run store at {self.path} stopped writing") from self.error
        if not isinstance(record, _RECORDS) and not (isinstance(record, tuple) and record
                                                     and record[0] in _OPS):
            raise TypeError(f"cannot store a {type(record).__name__}")  # here, not in a batch
        with self._cond:
            self._buf.append(record)

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
            raise RuntimeError(f"the run store at {self.path} failed to write") from self.error
        if not ok:
            raise TimeoutError(f"the run store at {self.path} did not commit within {timeout}s")

    def close(self) -> None:
        if self._thread.is_alive():
            self.flush()
            self._stop.set()
            with self._cond:
                self._cond.notify_all()
            self._thread.join(timeout=10)
        super().close()

    # -- writer thread ------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(
                        lambda: self._stop.is_set() or self._queued > self._written,
                        self.flush_interval,
                    )
                    batch, self._buf = self._buf, []
                    target = self._queued
                if batch:
                    self._write(batch)
                with self._cond:
                    self._written = max(self._written, target)
                    self._cond.notify_all()
                if self._stop.is_set():
                    break
        except BaseException as e:  # never die silently: flush() re-raises it
            self.error = e
            log.exception("nbwatch store writer failed; records after this point are lost")
            with self._cond:
                self._cond.notify_all()
        finally:
            self._wcon.close()

    def _key(self, name: str) -> int:
        kid = self._key_ids.get(name)
        if kid is None:
            cur = self._wcon.execute("INSERT INTO keys (name) VALUES (?)", (name,))
            kid = self._key_ids[name] = int(cur.lastrowid)
        return kid

    def _write(self, batch: list[Any]) -> None:
        con = self._wcon
        ids = self._key_ids
        rows: list[tuple[int, int, float]] = []  # consecutive Scalars: one executemany
        steps: list[tuple[int, float]] = []

        def flush_scalars() -> None:
            if rows:
                con.executemany(
                    "INSERT OR REPLACE INTO scalars (step, key, value) VALUES (?, ?, ?)", rows)
                rows.clear()
            if steps:
                con.executemany("INSERT OR IGNORE INTO steps VALUES (?, ?)", steps)
                steps.clear()

        with con:  # one transaction
            for r in batch:
                if isinstance(r, Scalars):
                    step = r.step
                    system = True
                    for k, v in r.values.items():
                        kid = ids.get(k)
                        rows.append((step, kid if kid is not None else self._key(k), float(v)))
                        if system and not k.startswith("system/"):
                            system = False
                    if not system:
                        steps.append((step, r.wall))
                    continue
                flush_scalars()  # records keep their order (a truncate, a meta write…)
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
                    for table in ("scalars", "steps", "histograms", "attention", "samples"):
                        con.execute(f"DELETE FROM {table} WHERE step > ?", (r[1],))
                else:
                    raise TypeError(f"cannot store a {type(r).__name__}")
            flush_scalars()
