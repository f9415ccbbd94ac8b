"""Writing a run folder: one writer thread per run, records queued by `put()`."""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from ..counts import as_python
from ..records import Command, Event, Histogram, Scalars, SystemSample
from . import reserve, tamper
from .batch import write_batch
from .histograms import HistTables
from .lock import take_folder, unlock
from .migrate import open_for_writing
from .mode import NETWORK, choose
from .reader import RunReader
from .record_reads import COMMANDS_SQL
from .recover import HELD, fold, hot_journal, recover, sweep_temp_files, unreadable
from .rows import WRITE, Meta, Taken, Truncate
from .schema import DB_NAME, KNOWN_CAUSES, MAX_PENDING, StoreFailed, _failure
from .tables import ScalarTables

COMPACT_EVERY = 30.0  # s: a live run's small blocks merged this often (and at close)
# scalars: ... or once this many were written since the last merge, so that the merge at
# close has at most this many to do (0.3-0.5 s measured) however fast the run writes
COMPACT_SCALARS = 1 << 21

log = logging.getLogger("nbwatch.store")


class _Damaged(Exception):
    """Another program changed the store's files under the writer (the message says how)."""


class RunStore(RunReader):
    """The writable store of one run: records go through `put()` to one writer thread.

    `put()` returns at once while fewer than `max_pending` scalars wait for the writer;
    past that it blocks the producer (the training thread) until the writer catches up,
    so memory stays bounded and nothing is dropped.

    `mode` ("local", "network", "auto"; None: `NBWATCH_STORE_MODE`, else auto) picks the
    journal (`mode.py`): WAL and an flock on a local disk; on a shared filesystem a rollback
    journal and a heartbeat file. `self.mode` and the meta's `store_mode` say which.
    """

    def __init__(self, run_dir: str | Path, flush_interval: float = 0.2,
                 max_pending: int = MAX_PENDING, mode: str | None = None):
        self.compact_every = COMPACT_EVERY  # s between merges of a live run's small blocks
        self.compact_scalars = COMPACT_SCALARS  # or scalars written since the last merge
        self._unmerged = 0
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / DB_NAME
        self.mode, self.mode_why = choose(self.run_dir, mode)
        self._lock, self._heartbeat = take_folder(self.run_dir, self.mode == NETWORK)
        self._unlocking = threading.Lock()
        opened = time.time()
        for folder in (self.run_dir, self.run_dir / "checkpoints"):  # what a killed write left
            sweep_temp_files(folder, before=opened)
        self._reserve = reserve.set_aside(self.run_dir)
        try:
            self._open_writer(flush_interval, max_pending)
        except BaseException:
            reserve.give_back(self._reserve)
            self._unlock()
            raise

    def _unlock(self) -> None:
        with self._unlocking:  # close() and the writer thread both may: close the fd once
            unlock(self._lock)
            self._lock = -1
            if self._heartbeat is not None:
                self._heartbeat.release()
                self._heartbeat = None

    def _open_writer(self, flush_interval: float, max_pending: int) -> None:
        self._local = threading.local()
        self._layouts, self._file = {}, None  # RunReader's, for this writer's own reads
        if self.path.is_file():
            if hot_journal(self.path):  # a writer killed mid-write: roll it back first
                why = recover(self.run_dir, locked=True)
                if why is not None:
                    raise StoreFailed(unreadable(self.path, why))
            self._migrate_if_old()
        con = open_for_writing(self.run_dir, self.path, self.mode == NETWORK)
        con.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)",
                        [("store_mode", json.dumps(self.mode)),
                         ("store_mode_why", json.dumps(self.mode_why))])
        con.commit()
        self._wcon = con
        self._files = self._identity()  # what another program must not change under us
        self._tables = ScalarTables(con)
        self._hists = HistTables(con)
        self._buf: list[Any] = []
        self._pending = 0  # scalars in _buf
        self.max_pending = max_pending
        # taken as `with self._mutex`, never `with self._cond`: Condition.__enter__ is Python
        # code, where Ctrl-C's or SIGTERM's exception (interrupts.Terminated) can come
        # in the main thread just after the acquire, leaving the lock held for good: the
        # writer then waits on it forever, and the close at the process's exit 60 s
        self._mutex = threading.RLock()
        self._cond = threading.Condition(self._mutex)
        self._written = 0  # batches committed, for flush()
        self._queued = 0
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._told = False  # the error was raised to a caller: close() does not repeat it
        self.flush_interval = flush_interval
        self._compacted = time.monotonic()
        # the commands not yet taken, as the writer last read them (`command_rows`)
        self._commands: list[tuple] | None = None
        self._commands_read = 0.0
        # not Thread.is_alive(): a join() cut by Ctrl-C makes it False while the thread runs
        self._ended = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="nbwatch-store", daemon=True)
        self._thread.start()

    # -- writer API (any thread) --------------------------------------------------------
    def put(self, record: Any) -> None:
        """Queue a record (Scalars, SystemSample, Histogram, Attention, Event, Sample) for the
        next commit; blocks while the writer is `max_pending` scalars behind."""
        if self.error is not None:
            self._raise_error()
        if isinstance(record, (Scalars, SystemSample)):
            n = len(record.values)
        elif type(record) in WRITE or type(record) in (Histogram, Truncate):
            n = 1
        else:
            raise TypeError(f"cannot store a {type(record).__name__}")  # here, not in a batch
        with self._mutex:
            if self._pending >= self.max_pending:
                self._cond.notify_all()
                while (self._pending >= self.max_pending and not self._ended.is_set()
                       and self.error is None):
                    self._cond.wait(1.0)
                if self.error is not None:
                    self._raise_error()
            self._buf.append(record)
            self._pending += n
            if self._pending >= self.max_pending // 2:
                self._cond.notify_all()  # write now, not at the next interval

    def set_meta(self, key: str, value: Any) -> None:
        self.put(Meta(key, json.dumps(value, default=as_python)))

    def add_command(self, command: Command) -> None:
        self.put(command)

    def mark_taken(self, command_id: int) -> None:
        self.put(Taken(command_id))

    def command_rows(self, after_id: int = 0, fresh: bool = False) -> list[tuple]:
        """The commands not yet taken as the writer thread last read them (every pass of
        its loop, at most every `flush_interval`, and after each commit of a command or
        of its taking), so that the training thread's poll opens no connection of its
        own (~1-2 ms each); `fresh`, or no writer thread: read now."""
        rows = self._commands
        if fresh or rows is None or self._ended.is_set():
            return super().command_rows(after_id)
        return [r for r in rows if r[0] > after_id]

    def truncate_after(self, step: int) -> None:
        """Drop records of steps after `step` (a resumed run recomputes them)."""
        self.put(Truncate(step))

    def flush(self, timeout: float = 10.0) -> None:
        """Block until everything queued so far is committed."""
        with self._mutex:
            self._queued += 1
            target = self._queued
            self._cond.notify_all()
            ok = self._cond.wait_for(
                lambda: (self._written >= target or self.error is not None
                         or self._ended.is_set()), timeout)
        if self.error is not None:
            self._raise_error()
        if not ok:
            raise TimeoutError(f"the run store at {self.path} did not commit within {timeout}s")

    def _raise_error(self) -> NoReturn:
        """Raise the writer's error (called where `self.error` is set)."""
        self._told = True
        error = self.error
        raise StoreFailed(str(error)) from (error.__cause__ if error is not None else None)

    def close(self) -> None:
        """Commit what is queued, fold the WAL into `nbwatch.db` and remove it. A writer that
        failed raises its error here, unless `put()` or `flush()` raised it already."""
        try:
            if not self._ended.is_set() and not self._told:
                self.flush(timeout=60)
        finally:  # a dead writer too: stop it, and never keep the folder locked
            self._stop.set()
            with self._mutex:
                self._cond.notify_all()
            if self._ended.wait(60):
                self._unlock()
        if self.error is not None and not self._told:
            self._raise_error()

    # -- the files under the writer -----------------------------------------------------
    def _identity(self) -> tamper.Identity:
        return tamper.identity(self.path)

    def _damage(self) -> tuple[str, str] | None:
        """What another program did to the store's files since the last check, if
        anything (`tamper.damage`)."""
        return tamper.damage(self.path, self._files)

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        """A read of this run's own store: any SQLite error is a `StoreFailed` that names
        the file and what to do (this writer made the schema, so none is expected)."""
        try:
            return super().query(sql, params)
        except (sqlite3.Error, StoreFailed) as e:  # (the reader's own: its file is gone)
            if self.error is None and self._damage() is not None:
                with contextlib.suppress(Exception):  # the writer's check: it rebuilds a
                    self.flush(timeout=30)             # deleted WAL, or saves the records
                if self.error is None and self._damage() is None:
                    return super().query(sql, params)
            if self.error is not None:
                self._raise_error()
            damage = self._damage()
            raise StoreFailed(f"{damage[1]}; later records are lost. {self._saved_where()}"
                              if damage is not None else _failure(e, self.path)) from e

    def _saved_where(self) -> str:
        folder = self.run_dir / "checkpoints"
        if not any(folder.glob("step_*.pt")):
            return "No checkpoint was written yet: start the run again in a new run_dir"
        return (f"The checkpoints in {folder} still hold the weights: resume from them"
                " (resume=True), into a new run_dir if this one is damaged")

    def _watch(self) -> None:
        """Once per flush: stop at once, saying what happened, when another program changed
        the store's files; a deleted WAL is rebuilt from the writer's own open copy."""
        damage = self._damage()
        if damage is None:
            self._files = self._identity()
            return
        kind, what = damage
        if kind == "folder":  # nothing left to save
            raise _Damaged(f"{what}; later records are lost")
        if kind == "moved":  # its records are there: say so in it, so it reads failed
            now = tamper.moved_to(self._files[0])
            new = str(now.parent) if now is not None else "another folder"
            said = (f"{what}; the run stops, and what it recorded is in {new}: open_run "
                    f"there, or resume from its checkpoints (run_dir={new!r}, resume=True)")
            with contextlib.suppress(sqlite3.Error):
                write_batch(self._wcon, self._tables, self._hists, [
                    Event(self._last_step(), "error", "critical", said, {"moved_to": new}),
                    Meta("state", json.dumps("failed"))])
            raise _Damaged(said)
        if kind == "wal":
            try:
                self._rebuild_wal()
            except sqlite3.Error as e:
                log.warning("rebuilding the WAL of %s failed: %s", self.path, e)
            else:
                self._files = self._identity()
                write_batch(self._wcon, self._tables, self._hists, [Event(
                    self._last_step(), "alert", "warning", f"store: {what}; nbwatch wrote "
                    "every record back from its open copy and started a new one: nothing was "
                    "lost", {"rule": "store"})])
                log.warning("%s; rebuilt from the writer's open copy, nothing lost", what)
                return
        if kind == "deleted":
            time.sleep(0.05)
            if not self.run_dir.exists():  # the whole folder (rmtree): nothing to save
                raise _Damaged(f"the run folder {self.run_dir} was deleted while the run "
                               "wrote to it; later records are lost")
            self._drop_own_wal()
            raise _Damaged(f"{what}; later records are lost")
        saved = self._rescue(what)
        if kind == "replaced":
            self._drop_own_wal()
        raise _Damaged(f"{what}. {saved}")

    def _rebuild_wal(self) -> None:
        """The writer still holds the deleted WAL open: checkpoint it into `nbwatch.db`,
        leave WAL mode (removing what a reader made in its place) and start a new one."""
        con = self._wcon
        why = fold(con)
        if why is not None:
            raise sqlite3.OperationalError(why)
        con.execute("PRAGMA journal_mode=WAL")

    def _drop_own_wal(self) -> None:
        tamper.drop_own_wal(self.path, self._files[1])

    def _last_step(self) -> int:
        row = self._wcon.execute("SELECT MAX(last) FROM walls").fetchone()
        return int(row[0]) if row and row[0] is not None else 0

    def _rescue(self, what: str) -> str:
        """Save what the writer's own connection still reads (`tamper.rescue`)."""
        step = 0
        with contextlib.suppress(sqlite3.Error):
            step = self._last_step()
        return tamper.rescue(self._wcon, self.run_dir, step, what) + self._saved_where()

    # -- writer thread ------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                with self._mutex:
                    self._cond.wait_for(
                        lambda: (self._stop.is_set() or self._queued > self._written
                                 or self._pending >= self.max_pending // 2),
                        self.flush_interval,
                    )
                    # with the batch: a stop set during the last write leaves nothing behind
                    stopping = self._stop.is_set()
                    batch, self._buf = self._buf, []
                    self._unmerged += self._pending
                    self._pending = 0
                    target = self._queued
                    self._cond.notify_all()  # a put() waiting on back-pressure goes on
                if batch:
                    write_batch(self._wcon, self._tables, self._hists, batch)
                    self._compact_now()
                self._watch()
                self._read_commands(any(isinstance(r, (Command, Taken)) for r in batch))
                with self._mutex:
                    self._written = max(self._written, target)
                    self._cond.notify_all()
                if stopping:
                    break
            self._close_tidy()
            self._fold_wal()
        except BaseException as e:  # never die silently: flush() and put() re-raise it
            if isinstance(e, sqlite3.Error):  # the folder moved or removed under it: that
                try:                          # is the cause to say, not SQLite's error
                    self._watch()
                except _Damaged as damaged:
                    e = damaged
                except Exception:  # noqa: BLE001 - the first error is said then
                    pass
            self.error = StoreFailed(str(e) if isinstance(e, _Damaged)
                                     else _failure(e, self.path))
            self.error.__cause__ = e
            if str(self.error).startswith("disk full"):  # said in the space set aside
                reserve.last_words(self._wcon, self._tables, self._hists, self._reserve,
                                   str(self.error))
            if isinstance(e, _Damaged) or str(self.error).startswith(KNOWN_CAUSES):
                log.error("nbwatch store writer stopped: %s", self.error)  # no traceback:
                # what happened, and what to do, is the message
            else:
                log.exception("nbwatch store writer failed; records after this point are lost")
            with self._mutex:
                self._cond.notify_all()
        finally:
            self._wcon.close()
            reserve.give_back(self._reserve)
            if self._stop.is_set():  # close() asked: the folder is free, even when a Ctrl-C
                self._unlock()       # cut close() short while it waited for this thread
            with self._mutex:
                self._ended.set()
                self._cond.notify_all()

    def _close_tidy(self) -> None:
        """Merge the last blocks and give back the pages freed. Every record is committed
        already: with no room for the merge (it writes the merged blocks before removing
        the small ones), the run ends with its records as written, not failed."""
        try:
            with self._wcon:
                removed = self._tables.compact() + self._tables.compact_system()
            if removed:
                self._wcon.executescript("PRAGMA incremental_vacuum;")  # runs to the end
        except sqlite3.OperationalError as e:
            if "full" not in str(e):
                raise
            log.warning("%s: no room on its disk to merge the run's last records at its "
                        "close (%s); every record is committed, and kept as written",
                        self.path, e)

    def _read_commands(self, changed: bool) -> None:
        """Read the commands not yet taken (`command_rows`): when this batch wrote one or
        its taking, else at most every `flush_interval` (another process's)."""
        now = time.monotonic()
        if not changed and now - self._commands_read < self.flush_interval:
            return
        self._commands_read = now
        try:
            self._commands = self._wcon.execute(COMMANDS_SQL, (0,)).fetchall()
        except sqlite3.Error:
            self._commands = None  # the poll reads for itself, and says what is wrong

    def _compact_now(self) -> None:
        """Every `compact_every` s, or once `compact_scalars` were written since, merge what
        the live run committed since into big blocks (what closing does), so that a close
        merges only the last few seconds' blocks."""
        now = time.monotonic()
        if (now - self._compacted < self.compact_every
                and self._unmerged < self.compact_scalars):
            return
        self._compacted = now
        self._unmerged = 0
        with self._wcon:
            self._tables.compact()
            self._tables.compact_system()

    def _fold_wal(self) -> None:
        """Fold the WAL into `nbwatch.db` and leave WAL mode, so that the file alone holds
        every record, through journal mode OFF: a kill at any instant leaves a readable WAL
        or the finished file, never a hot journal (`recover.fold`). A reader holding the
        file open keeps the (emptied) WAL until the next writer folds it. Network mode has
        no WAL: the file is complete after every commit."""
        why = None if self.mode == NETWORK else fold(self._wcon)
        if why == HELD:
            log.warning("%s: a reader held the database open; its WAL is emptied but kept",
                        self.path)
        elif why is not None:  # a full disk: every record is committed, in the WAL
            log.warning("%s: its WAL could not be folded into it (%s); every record is "
                        "kept, in %s-wal beside it, read as it is", self.path, why,
                        self.path.name)
