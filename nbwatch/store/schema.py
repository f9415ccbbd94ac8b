"""The run folder's SQLite schema, its version, connections, and what a store failure means.

The schema lives here and only here (every SQL statement is in the `nbwatch.store`
package).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sqlite3
import time
from pathlib import Path
from urllib.parse import quote

from ..records import Command

DB_NAME = "nbwatch.db"
SCHEMA_VERSION = 4  # 3: histograms as blocks (histograms.py), attention maps packed;
# 4: histogram counts as byte planes ("u2p+z"; a 3's counts read as they are)
MAX_PENDING = 1_000_000  # scalars queued for the writer before put() waits (back-pressure)

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
-- the system sampler's readings on their own wall-clock timeline: one row per layout and
-- commit, `first`/`last` the wall times it spans, walls (f8), steps (i8) and values of
-- each sample. Schema 2 gained it: the first writer that opens an older folder adds it
-- (no semicolon in these comments: the migration splits this script on them)
CREATE TABLE IF NOT EXISTS system_samples (
    id INTEGER PRIMARY KEY AUTOINCREMENT, layout INTEGER NOT NULL, first REAL NOT NULL,
    last REAL NOT NULL, first_step INTEGER NOT NULL, last_step INTEGER NOT NULL,
    walls BLOB NOT NULL, steps BLOB NOT NULL, "values" BLOB NOT NULL,
    merged_from INTEGER);
CREATE INDEX IF NOT EXISTS system_samples_last ON system_samples (last);
-- schema 3: a layout's histograms for a run of steps a row (histograms.py)
CREATE TABLE IF NOT EXISTS hist_layouts (
    id INTEGER PRIMARY KEY, names TEXT NOT NULL, bins INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS hist_blocks (
    id INTEGER PRIMARY KEY AUTOINCREMENT, layout INTEGER NOT NULL, first INTEGER NOT NULL,
    last INTEGER NOT NULL, steps BLOB NOT NULL, edge_kind TEXT NOT NULL, edges BLOB NOT NULL,
    count_type TEXT NOT NULL, counts BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS hist_blocks_layout_last ON hist_blocks (layout, last);
-- schema 2's histograms, a row each: read as they are, rewritten as blocks by a writer
CREATE TABLE IF NOT EXISTS histograms (
    id INTEGER PRIMARY KEY AUTOINCREMENT, step INTEGER NOT NULL, name TEXT NOT NULL,
    edges BLOB NOT NULL, counts BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS histograms_name_step ON histograms (name, step);
CREATE TABLE IF NOT EXISTS attention (
    id INTEGER PRIMARY KEY AUTOINCREMENT, step INTEGER NOT NULL, module TEXT NOT NULL,
    sample INTEGER NOT NULL, shape TEXT NOT NULL, weights BLOB NOT NULL, tokens TEXT,
    encoding TEXT);  -- how `weights` is packed (rows.py), NULL: float16 (schema 2)
CREATE INDEX IF NOT EXISTS attention_step ON attention (step);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, step INTEGER NOT NULL, wall REAL NOT NULL,
    kind TEXT NOT NULL, severity TEXT NOT NULL, message TEXT NOT NULL, data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS samples (
    id INTEGER PRIMARY KEY AUTOINCREMENT, step INTEGER NOT NULL, wall REAL NOT NULL,
    text TEXT NOT NULL, content TEXT);  -- content: an image or table (JSON), NULL: text
CREATE TABLE IF NOT EXISTS commands (
    id INTEGER PRIMARY KEY AUTOINCREMENT, wall REAL NOT NULL, kind TEXT NOT NULL, value REAL,
    source TEXT NOT NULL, taken INTEGER NOT NULL DEFAULT 0, payload TEXT, cid TEXT);
"""
COMMAND_COLUMNS = ("id", "wall", "kind", "value", "source", "taken")  # before payload, cid
ATTENTION_COLUMNS = ("id", "step", "module", "sample", "shape", "weights", "tokens")  # schema 2
SAMPLE_COLUMNS = ("id", "step", "wall", "text")  # before content


def add_command_columns(con: sqlite3.Connection) -> None:
    """A store made before commands had a payload and an id gains the two columns (they
    are added at the end: older readers and writers of the table go on working)."""
    _add_columns(con, "commands", ("payload", "cid"))


def add_columns(con: sqlite3.Connection) -> None:
    """The columns later schemas added to older tables (at the end, as TEXT)."""
    add_command_columns(con)
    _add_columns(con, "attention", ("encoding",))
    _add_columns(con, "samples", ("content",))


def _add_columns(con: sqlite3.Connection, table: str, cols: tuple[str, ...]) -> None:
    have = {r[1] for r in con.execute(f"PRAGMA table_info({table})")}
    for col in cols:
        if col not in have:
            con.execute(f"ALTER TABLE {table} ADD COLUMN {col} TEXT")


def is_run_dir(path: str | Path) -> bool:
    """True when `path` holds an nbwatch store."""
    return (Path(path) / DB_NAME).is_file()


def _connect(path: Path, readonly: bool, network: bool = False) -> sqlite3.Connection:
    """A connection to a run's store; a writer's (`readonly=False`) in WAL mode, or with
    `network` (a shared filesystem, `mode.py`) with a rollback journal and full syncs."""
    if readonly:
        # `#` and `?` are legal in paths, and so are bytes that are not UTF-8 (as bytes)
        uri = f"file:{quote(os.fsencode(path.resolve()))}?mode=ro"
        return sqlite3.connect(uri, uri=True, timeout=10, check_same_thread=False)
    con = sqlite3.connect(path, timeout=10, check_same_thread=False)
    # a new file only, before WAL writes its header: lets a closing writer give the pages
    # that compaction freed back to the disk
    con.execute("PRAGMA auto_vacuum=INCREMENTAL")
    if network:  # no shared memory across hosts: the journal exists only while a commit runs
        mode = con.execute("PRAGMA journal_mode=DELETE").fetchone()[0]
        if mode != "delete":
            con.close()
            raise sqlite3.OperationalError(
                f"{path} could not leave {mode} mode for a rollback journal (another process"
                " holds it open in WAL mode)")
        con.execute("PRAGMA synchronous=FULL")  # each commit on the file server
        return con
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


# the failures `_failure` explains in full (the message is the cause and the fix)
KNOWN_CAUSES = ("disk full:", "file size limit reached", "the run folder ")


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
        saved = any((path.parent / "checkpoints").glob("step_*"))
        then = ("resume the run from its newest checkpoint" if saved else
                f"resume from the newest checkpoint written, if any (none in "
                f"{path.parent / 'checkpoints'}; checkpoint_every= writes them there, a "
                "framework in its own output folder); without one the weights are in memory "
                "only: save them elsewhere now if they matter")
        return (f"disk full: the run store {path} could not be written ({text}); free space"
                f" on its disk, and {then}; {kept}")
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




def inserted_id(cur: sqlite3.Cursor) -> int:
    """The id of the row the INSERT just run on `cur` added (sqlite3 leaves `lastrowid`
    None only where no row was inserted)."""
    rid = cur.lastrowid
    if rid is None:
        raise sqlite3.InterfaceError("the statement inserted no row")
    return rid


def send_command(run_dir: Path, command: Command) -> int:
    """Write a control command into a run folder written by another process (attach); the
    writer's recorder takes it between two steps. Returns its row id."""
    con = sqlite3.connect(Path(run_dir) / DB_NAME, timeout=10)
    try:
        with con:
            add_command_columns(con)  # a writer of an older nbwatch made the table
            cur = con.execute(*command_row(command))
        return inserted_id(cur)
    finally:
        con.close()


def command_row(command: Command) -> tuple[str, tuple]:
    """The INSERT of one command (the writer's and attach's, the same)."""
    kind, payload, source, cid = command.to_wire()
    return ("INSERT INTO commands (wall, kind, value, source, payload, cid)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            (time.time(), kind, None, source, json.dumps(payload), cid))
