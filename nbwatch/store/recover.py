"""What a killed writer can leave in a run folder, and putting it right at the next open.

- A checkpoint's temp file (`.step_00000005.pt.tmp-PID`): swept at the next writer open
  when its PID is gone or it is older than that open.
- A WAL (`nbwatch.db-wal`, `-shm`) not folded into `nbwatch.db` (a kill before the close
  finished): readable as it is; folded at the next open that can write.
- A hot rollback journal (`nbwatch.db-journal`: a kill during a migration's VACUUM, or
  while an older nbwatch left WAL mode at close with `journal_mode=DELETE`): no read-only
  connection can read the database until one read-write open rolls the journal back,
  with every committed record. A reader does that open itself when no writer holds the
  folder; where it cannot write, its error names the one command that does:
  `nbwatch recover DIR`.
- In network mode (`mode.py`) the rollback journal is the store's own journal: it exists
  while each commit runs, and a writer killed then leaves it hot. A reader that finds it
  with the writer's heartbeat dead (`lock.heartbeat_alive`) rolls it back the same way,
  and so does the next writer's open (a resume).

The close itself leaves WAL mode through `journal_mode=OFF` (`fold`), which writes the
header in one page write and no journal, so a kill at any instant of a close leaves either
a readable WAL or the one finished file, never a hot journal.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sqlite3
import sys
import time
from pathlib import Path

from .lock import _lock_dir, _pid_alive, read_heartbeat, unlock, writer_alive
from .schema import DB_NAME

log = logging.getLogger("nbwatch.store")

_TEMP = re.compile(r"^\..+\.tmp-(\d+)$")


def temp_path(path: Path) -> Path:
    """Where a file of nbwatch's is written before its rename (`.NAME.tmp-PID`)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def sweep_temp_files(directory: Path, before: float) -> list[Path]:
    """Remove the temp files (`.NAME.tmp-PID`) in `directory` that a killed or failed write
    left: those whose process is gone, and any older than `before` (the writer's open: no
    live writer of this folder has one in flight then). Returns what was removed."""
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    removed = []
    for entry in entries:
        m = _TEMP.match(entry.name)
        if m is None:
            continue
        try:
            if not entry.is_file(follow_symlinks=False):
                continue
            stale = entry.stat(follow_symlinks=False).st_mtime < before
            if stale or not _pid_alive(int(m.group(1))):
                os.unlink(entry.path)
                removed.append(Path(entry.path))
        except OSError:
            continue
    if removed:
        names = ", ".join(p.name for p in removed[:4]) + (" …" if len(removed) > 4 else "")
        log.info("%s: removed %d temp file(s) a killed or failed write left: %s",
                 directory, len(removed), names)
    return removed


def journal_of(db: Path) -> Path:
    return db.with_name(db.name + "-journal")


_JOURNAL_MAGIC = bytes.fromhex("d9d505f920a163d7")


def hot_journal(db: Path) -> bool:
    """A rollback journal that a killed writer left, as SQLite tells one: its header holds
    the journal's magic number. An empty one is not hot, nor one whose header is still zero
    (under synchronous=FULL a commit writes the magic only once the journal is synced,
    before it changes the database file: a kill before that changed nothing)."""
    try:
        with open(journal_of(db), "rb") as f:
            return f.read(8) == _JOURNAL_MAGIC
    except OSError:
        return False


def leftovers(db: Path) -> list[Path]:
    """The files besides `nbwatch.db` that a writer killed mid-write can leave."""
    return [p for p in (db.with_name(db.name + s) for s in ("-journal", "-wal", "-shm"))
            if p.exists()]


HELD = "a reader held the database open"


def fold(con: sqlite3.Connection, tries: int = 20) -> str | None:
    """Checkpoint the WAL into the database file and leave WAL mode without a hot journal
    at any instant: WAL → OFF writes the header in one page write (no journal), then
    OFF → DELETE writes nothing. None when folded, else why not: `HELD` (another
    connection kept it from folding, tried `tries` times), or the error (a full disk).
    Each pragma's rows are read to their end: a statement left at a row stays active while
    anything keeps its cursor alive (a `gc.get_objects()` in another thread), and SQLite
    then refuses the change of journal mode ("from within a transaction")."""
    for _ in range(tries):
        try:
            con.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
            if con.execute("PRAGMA journal_mode=OFF").fetchall()[0][0] == "off":
                con.execute("PRAGMA journal_mode=DELETE").fetchall()
                return None
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) and "busy" not in str(e):
                return f"{type(e).__name__}: {e}"
        time.sleep(0.05)
    return HELD


def recover(run_dir: str | Path, *, locked: bool = False) -> str | None:
    """Roll back a hot journal and fold a leftover WAL with one read-write open, so the run
    folder is one readable file again. Only when no writer holds the folder (`locked`: the
    caller is that writer). Returns None when done (or nothing to do), else why not."""
    run_dir = Path(run_dir)
    db = run_dir / DB_NAME
    if not leftovers(db):
        return None
    fd = None
    if not locked:
        if writer_alive(run_dir):
            return "a live writer holds the run folder"
        # a network-mode folder: its dead writer's heartbeat said so, and no flock is taken
        # there (it may be missing); SQLite's own locks order the rollback with a new writer
        if read_heartbeat(run_dir) is None:
            for _ in range(10):  # a reader's probe holds a shared lock for a moment
                try:
                    fd = _lock_dir(run_dir, exclusive=True)
                except OSError as e:
                    return f"the folder cannot be locked: {e}"
                if fd is not None:
                    break
                time.sleep(0.02)
            else:
                return "a live writer holds the run folder"
    try:
        con = sqlite3.connect(db, timeout=5, isolation_level=None, check_same_thread=False)
        try:
            con.execute("SELECT count(*) FROM sqlite_master").fetchone()  # rolls it back
            if hot_journal(db):
                return "the journal could not be rolled back here"
            if con.execute("PRAGMA journal_mode").fetchone()[0] == "wal" and (
                    why := fold(con, 3)) is not None:
                if why != HELD:
                    return why
                log.info("%s: another reader holds the database open; its WAL stays", db)
        finally:
            con.close()
    except sqlite3.Error as e:
        return f"{type(e).__name__}: {e}"
    finally:
        if fd is not None:
            unlock(fd)
    return None


def unreadable(db: Path, why: str | None) -> str:
    """What to tell a reader that meets a hot journal it could not roll back."""
    journal = journal_of(db)
    return (f"{db} cannot be read as it is: {journal.name} beside it is a rollback journal "
            "that a writer killed mid-write left behind, and only a read-write open rolls it"
            f" back (every committed record is kept){f' — not possible here: {why}' if why else ''}"
            f". Run once: nbwatch recover {str(db.parent)!r} where the folder"
            f" can be written, or copy the whole folder ({journal.name} included) somewhere"
            " writable and open the copy")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: nbwatch recover RUN_DIR", file=sys.stderr)
        return 2
    run_dir = Path(argv[0])
    db = run_dir / DB_NAME
    if not db.is_file():
        print(f"{run_dir} holds no {DB_NAME}", file=sys.stderr)
        return 1
    had = bool(leftovers(db))
    why = recover(run_dir)
    if why is not None:
        print(f"{db}: not recovered: {why}", file=sys.stderr)
        return 1
    damage = _check(db)
    if damage is not None:
        print(f"{db}: damaged, which this tool cannot mend ({damage}); the files in its "
              "checkpoints/ folder, if any, load with torch.load", file=sys.stderr)
        return 1
    with contextlib.suppress(OSError):
        left = [p.name for p in leftovers(db)]
        if left:
            print(f"{db}: readable; {', '.join(left)} stay while another process holds it open")
            return 0
    print(f"{db}: recovered; the run folder is one file again" if had
          else f"{db}: nothing to recover: one file, and it reads whole")
    return 0


def _check(db: Path) -> str | None:
    """None where SQLite's quick check of `db` finds it whole, else what it found."""
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
        try:
            rows = [r[0] for r in con.execute("PRAGMA quick_check").fetchall()]
        finally:
            con.close()
    except sqlite3.Error as e:
        return f"{type(e).__name__}: {e}"
    return None if rows == ["ok"] else "; ".join(map(str, rows[:3]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
