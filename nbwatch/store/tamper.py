"""What another program did to a live run's files: the writer's check once per flush
(deleted, replaced or truncated store, deleted WAL, deleted folder), and what it can
still save from its own open connection."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time
from pathlib import Path

from ..records import Event
from .recover import fold
from .rows import WRITE, Meta
from .schema import DB_NAME

Identity = tuple[tuple[int, int, int] | None, tuple[int, int] | None]


def identity(path: Path) -> Identity:
    """(device, inode, size) of `nbwatch.db` and (device, inode) of its WAL; None for
    one that does not exist. Two stat calls, made once per flush of the writer."""
    try:
        st = os.stat(path)
        db = (st.st_dev, st.st_ino, st.st_size)
    except FileNotFoundError:
        db = None
    try:
        st = os.stat(path.with_name(path.name + "-wal"))
        wal = (st.st_dev, st.st_ino)
    except FileNotFoundError:
        wal = None
    return db, wal


def damage(path: Path, was: Identity) -> tuple[str, str] | None:
    """(kind, what happened) when another program deleted, replaced or truncated the
    store at `path`, or deleted its WAL or its folder, since the identity `was`."""
    run_dir = path.parent
    if not run_dir.exists():  # writes still go through, to the unlinked files
        now = moved_to(was[0])
        if now is not None:
            return "moved", (f"the run folder {run_dir} was moved to {now.parent} while the "
                             "run wrote to it")
        return "folder", f"the run folder {run_dir} was deleted while the run wrote to it"
    (db, wal), (old, old_wal) = identity(path), was
    if db is None:
        return "deleted", f"the run store {path} was deleted while the run wrote to it"
    if old is not None and db[:2] != old[:2]:
        return "replaced", (f"the run store {path} was replaced by another file while the"
                            f" run wrote to it (inode {old[1]} became {db[1]}: another program,"
                            " a copy or a sync wrote over it)")
    if old is not None and db[2] < old[2]:
        return "truncated", (f"the run store {path} was truncated from {old[2]} to {db[2]}"
                             " bytes by another program while the run wrote to it")
    if old_wal is not None and wal != old_wal:
        return "wal", (f"the run store's write-ahead log {path.name}-wal in "
                       f"{run_dir} was deleted while the run wrote to it")
    return None


def moved_to(db: tuple[int, int, int] | None) -> Path | None:
    """Where the store file of identity `db` is now, read from this process's own open
    files (Linux's /proc/self/fd): a folder renamed under a live run, not deleted."""
    fds = Path("/proc/self/fd")
    if db is None or not fds.is_dir():
        return None
    for fd in fds.iterdir():
        with contextlib.suppress(OSError):
            st = os.stat(fd)
            if (st.st_dev, st.st_ino) == db[:2]:
                target = os.readlink(fd)
                if not target.endswith(" (deleted)") and os.path.exists(target):
                    return Path(target)
    return None


def drop_own_wal(path: Path, own: tuple[int, int] | None) -> None:
    """Once `nbwatch.db` is another file (or none), the writer's WAL (`own`: its device
    and inode) beside it would be applied to that file by its next reader: remove it (and
    its index), if still the writer's."""
    wal = path.with_name(path.name + "-wal")
    try:
        st = os.stat(wal)
    except FileNotFoundError:
        return
    if (st.st_dev, st.st_ino) == own:
        for p in (wal, path.with_name(path.name + "-shm")):
            with contextlib.suppress(OSError):
                p.unlink()


def rescue(con: sqlite3.Connection, run_dir: Path, step: int, what: str) -> str:
    """The writer's own connection `con` still reads the run it wrote (the old file and
    its WAL): record the failure there and copy it all into a new run folder beside.
    Returns where it went, or why it could not."""
    try:
        dest = run_dir / f"recovered-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        with con:
            WRITE[Event](con, Event(step, "error", "critical", what, {}))
            WRITE[Meta](con, Meta("state", json.dumps("failed")))
        dest.mkdir()
        con.execute("VACUUM INTO ?", (str(dest / DB_NAME),))
        out = sqlite3.connect(dest / DB_NAME)
        try:
            if out.execute("PRAGMA journal_mode").fetchone()[0] == "wal":
                fold(out)
        finally:
            out.close()
    except (sqlite3.Error, OSError) as e:
        return f"Its records could not be saved elsewhere ({type(e).__name__}: {e}). "
    return (f"This run's records (steps up to {step}) were saved to {dest}: open them with"
            f" nbwatch.open_run({str(dest)!r}). ")
