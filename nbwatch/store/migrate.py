"""Older run folders. Schema 1 (nbwatch 0.1.0: one SQLite row per scalar) is rewritten in
place to the current schema the first time it is opened. Schema 2 (a row per histogram,
float16 attention maps) is read as it is; the first writer that opens it (a resume)
rewrites its histograms as blocks (`migrate_v2`)."""

from __future__ import annotations

import json
import sqlite3
import warnings
from pathlib import Path

from . import schema
from .histograms import migrate_histograms
from .mode import probe
from .recover import fold
from .tables import ScalarTables


def migrate_v1(path: Path) -> None:
    """Rewrite a schema-1 `nbwatch.db` as the current schema in one transaction."""
    try:
        con = sqlite3.connect(path, timeout=30, isolation_level=None)
        con.execute("BEGIN IMMEDIATE")
    except sqlite3.OperationalError as e:
        raise RuntimeError(
            f"{path} is an nbwatch 0.1.0 run (schema 1) that must be migrated once before it"
            f" can be read, but it cannot be written here ({e}): copy the run folder somewhere"
            " writable and open the copy") from e
    try:
        if schema._version(con) != 1:  # another process migrated it first
            con.execute("ROLLBACK")
            return
        # schema 1's record tables reused row ids after a truncate: rebuild them
        kept = ("histograms", "attention", "events", "samples", "commands")
        for t in kept:
            con.execute(f"ALTER TABLE {t} RENAME TO {t}_v1")
        for index in ("histograms_name_step", "attention_step"):
            con.execute(f"DROP INDEX IF EXISTS {index}")
        for statement in schema._SCHEMA.split(";"):
            if statement.strip():
                con.execute(statement)
        named = {"commands": schema.COMMAND_COLUMNS, "attention": schema.ATTENTION_COLUMNS,
                 "samples": schema.SAMPLE_COLUMNS}
        for t in kept:
            cols = ", ".join(named[t]) if t in named else "*"
            into = f"{t} ({cols})" if t in named else t
            con.execute(f"INSERT INTO {into} SELECT {cols} FROM {t}_v1")
            con.execute(f"DROP TABLE {t}_v1")
        tables = ScalarTables(con)
        names = dict(con.execute("SELECT id, name FROM keys"))
        walls = dict(con.execute("SELECT step, wall FROM steps"))
        by_step: dict[int, dict[str, float]] = {}
        for step, key, value in con.execute("SELECT step, key, value FROM scalars ORDER BY id"):
            by_step.setdefault(step, {})[names[key]] = float("nan") if value is None else value
        groups: dict[tuple[str, ...], tuple[list, list, list]] = {}
        last_wall = min(walls.values(), default=0.0)
        for step in sorted(by_step):
            values = by_step[step]
            last_wall = walls.get(step, last_wall)
            g = groups.setdefault(tuple(values), ([], [], []))
            g[0].append(step)
            g[1].append(last_wall)
            g[2].append(list(values.values()))
        tables.write(groups)
        migrate_histograms(con)
        con.execute("DROP TABLE scalars")
        con.execute("DROP TABLE steps")
        con.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)",
                    (json.dumps(schema.SCHEMA_VERSION),))
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        con.close()
        raise
    con.execute("VACUUM")
    if con.execute("PRAGMA journal_mode").fetchone()[0] == "wal":
        fold(con)  # the run folder stays one file, without a hot journal at any instant
    con.close()
    warnings.warn(
        f"{path.parent} was written by nbwatch 0.1.0 (store schema 1); it has been migrated in"
        f" place to schema {schema.SCHEMA_VERSION} ({len(by_step)} steps kept). nbwatch 0.1.0"
        " can no longer open it.", UserWarning, stacklevel=4)


def migrate_v2(con: sqlite3.Connection) -> None:
    """Schema 2 → 3 on the writer's connection, in one transaction: the histograms become
    blocks; attention maps stay as they are (their `encoding` is NULL: float16)."""
    with con:
        migrate_histograms(con)
        con.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)",
                    (json.dumps(schema.SCHEMA_VERSION),))


def open_for_writing(run_dir: Path, path: Path, network: bool) -> sqlite3.Connection:
    """The writer's connection to `path`, its tables made or brought up to this schema
    (schema 2's histograms rewritten, schema 3 relabelled: its records are schema 4's too).
    A filesystem without the locks SQLite needs is named, with what to do."""
    try:
        con = schema._connect(path, readonly=False, network=network)
        # in one transaction: a reader never finds some tables made and others not yet
        # (it read 'no such table: walls' from a folder being created, not "not started")
        con.executescript(f"BEGIN IMMEDIATE;{schema._SCHEMA}COMMIT;")
    except sqlite3.OperationalError as e:
        failed = probe(run_dir)
        if failed is None:
            raise
        raise schema.StoreFailed(
            f"the run store {path} cannot be opened: {failed}, and SQLite locks its"
            f" file with them ({e}). Mount the filesystem with locking (Lustre: -o flock;"
            " NFS: without nolock), or give run_dir on a local disk (and copy the folder"
            " to the shared one once the run ends)") from e
    schema.add_columns(con)
    if schema._version(con) == 2:
        migrate_v2(con)
    version = json.dumps(schema.SCHEMA_VERSION)
    if schema._version(con) == 3:
        con.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", (version,))
    con.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (version,))
    return con
