"""Is a run alive? One answer for `Run`, `attach`, `ls`, `compare` and the dashboard.

Liveness is read from the store: the run folder's writer lock (exact on this host: the OS
drops the lock of a killed process), or in network mode (a shared filesystem, see
`store/mode.py`) the writer's heartbeat file, which readers on any host see (dead after
`store.lock.DEAD_AFTER` s without a beat, at once on the writer's host when its pid is
gone); else the newest of the
last step's wall time, the last event's, a `heartbeat` in meta and the modification time of
the database and its WAL (the writer's system sampler commits a row every second, even
while paused). A run whose meta says live but whose writer is gone, or that nothing has
touched for `stale_after` seconds, is "stale".
"""

from __future__ import annotations

import contextlib
import socket
import sqlite3
import time
from pathlib import Path
from typing import Any

from ..lifecycle import ENDED, LIVE, STALE
from . import DB_NAME, RunReader, writer_alive
from .lock import heartbeat_alive, read_heartbeat

__all__ = ["ENDED", "LIVE", "STALE_AFTER", "RunFailed", "last_write", "run_state"]

# s without a write before a live-looking run counts as gone. On this host the writer lock
# answers at once; the time matters for a writer on another host (a shared file system).
STALE_AFTER = 30.0


class RunFailed(RuntimeError):
    """The attached run ended with an error in its own process; `traceback` is its text."""

    def __init__(self, message: str, traceback: str | None = None):
        super().__init__(message)
        self.traceback = traceback


def last_write(run_dir: Path, reader: RunReader | None = None) -> float | None:
    """Wall time (epoch seconds) of the newest sign of life in a run folder, or None.

    >>> time.time() - last_write(Path("runs/exp1"))   # seconds since the writer last wrote
    """
    db = run_dir / DB_NAME
    times = []
    for p in (db, db.with_name(DB_NAME + "-wal")):
        with contextlib.suppress(FileNotFoundError):  # no WAL once the writer closed
            times.append(p.stat().st_mtime)
    if reader is not None:
        times += [t for t in reader.last_signs_of_life() if t is not None]
    return max(times) if times else None


def _writer_alive(run_dir: Path, meta: dict[str, Any]) -> bool | None:
    """Whether the run's writer is alive, from its heartbeat file (network mode, any host)
    or the run folder's writer lock (exact on this host: the OS drops the lock of a killed
    process); None where neither can tell: a local-mode writer on another host, or one
    that has not written its pid yet."""
    beat = read_heartbeat(run_dir)
    if beat is not None:
        return heartbeat_alive(beat)
    if meta.get("store_mode") == "network" and "pid" in meta:
        return False  # its writer removes the heartbeat only when it closes
    if "pid" not in meta or meta.get("host") != socket.gethostname():
        return None
    return writer_alive(run_dir)


def run_state(run_dir: Path, meta: dict[str, Any], reader: RunReader | None,
              stale_after: float) -> str:
    """The run's state from its meta, or 'stale' where meta says live (starting, running,
    paused, stopping) but the writer is gone: its lock is free (on this host), or, where the
    lock cannot tell (another host), nothing was written for `stale_after` seconds. A writer
    that holds its lock is alive however long it is silent (paused, a long eval)."""
    state = str(meta.get("state", "starting"))
    if state in LIVE:
        alive = _writer_alive(run_dir, meta)
        if alive is not None:
            return state if alive else STALE
        try:
            t = last_write(run_dir, reader)
        except sqlite3.OperationalError:  # the writer is creating the schema right now
            t = last_write(run_dir)
        if t is not None and time.time() - t > stale_after:
            return STALE
    return state
