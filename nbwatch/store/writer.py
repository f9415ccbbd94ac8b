"""Writing a run folder: one writer thread per run, records queued by `put()`."""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from ..records import Command, Scalars
from .lock import RunInUse, _in_use, _lock_dir, unlock
from .reader import RunReader
from .rows import WRITE, Meta, Taken, Truncate
from .schema import (
    _SCHEMA,
    DB_NAME,
    MAX_PENDING,
    SCHEMA_VERSION,
    StoreFailed,
    _connect,
    _failure,
)
from .tables import ScalarTables

log = logging.getLogger("nbwatch.store")

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
        unlock(self._lock)
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
        elif type(record) in WRITE or type(record) is Truncate:
            n = 1
        else:
            raise TypeError(f"cannot store a {type(record).__name__}")  # here, not in a batch
        with self._cond:
            if self._pending >= self.max_pending:
                self._cond.notify_all()
                while (self._pending >= self.max_pending and self._thread.is_alive()
                       and self.error is None):
                    self._cond.wait(1.0)
                if self.error is not None:
                    raise StoreFailed(str(self.error)) from self.error.__cause__
            self._buf.append(record)
            self._pending += n
            if self._pending >= self.max_pending // 2:
                self._cond.notify_all()  # write now, not at the next interval

    def set_meta(self, key: str, value: Any) -> None:
        self.put(Meta(key, json.dumps(value, default=str)))

    def add_command(self, command: Command) -> None:
        self.put(command)

    def mark_taken(self, command_id: int) -> None:
        self.put(Taken(command_id))

    def truncate_after(self, step: int) -> None:
        """Drop records of steps after `step` (a resumed run recomputes them)."""
        self.put(Truncate(step))

    def flush(self, timeout: float = 10.0) -> None:
        """Block until everything queued so far is committed."""
        with self._cond:
            self._queued += 1
            target = self._queued
            self._cond.notify_all()
            ok = self._cond.wait_for(
                lambda: (self._written >= target or self.error is not None
                         or not self._thread.is_alive()), timeout)
        if self.error is not None:
            raise StoreFailed(str(self.error)) from self.error.__cause__
        if not ok:
            raise TimeoutError(f"the run store at {self.path} did not commit within {timeout}s")

    def close(self) -> None:
        """Commit what is queued, fold the WAL into `nbwatch.db` and remove it."""
        try:
            if self._thread.is_alive():
                self.flush(timeout=60)
        finally:  # a dead writer too: stop it, and never keep the folder locked
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
                if type(r) is Truncate:
                    if groups:  # scalars queued before a truncate are cut by it
                        self._tables.write(groups)
                    self._tables.truncate(r.step)
                    continue
                WRITE[type(r)](con, r)
            if groups:
                self._tables.write(groups)
