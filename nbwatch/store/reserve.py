"""A little disk space set aside while a run writes. On a full disk it is given back, so
that the store can still record that the run failed and why: without it the run's last
word was lost with the rest, and the folder read 'stale' (a writer that vanished)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
from pathlib import Path

from ..records import Event
from .batch import write_batch
from .histograms import HistTables
from .rows import Meta
from .tables import ScalarTables

log = logging.getLogger("nbwatch.store")

NAME = ".nbwatch-reserve"
SIZE = 256 << 10  # a few commits of a meta row and an event, with their WAL frames


def set_aside(run_dir: Path) -> Path | None:
    """Fill `run_dir/.nbwatch-reserve` with `SIZE` bytes; None where the disk has not even
    that (the run's first write says the disk is full)."""
    path = run_dir / NAME
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size < SIZE:
                try:
                    os.posix_fallocate(fd, 0, SIZE)
                except (AttributeError, OSError):  # not on every filesystem: write it
                    os.pwrite(fd, bytes(SIZE), 0)
                    os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        give_back(path)
        return None
    return path


def give_back(path: Path | None) -> None:
    if path is not None:
        with contextlib.suppress(OSError):
            path.unlink()


def last_words(con: sqlite3.Connection, tables: ScalarTables, hists: HistTables,
               reserve: Path | None, message: str) -> bool:
    """The disk is full: give the reserve back and record, in the space it leaves, that
    the run failed at its last recorded step, with `message`. False where even that
    could not be written."""
    give_back(reserve)
    try:
        row = con.execute("SELECT MAX(last) FROM walls").fetchone()
        step = int(row[0]) if row and row[0] is not None else 0
        write_batch(con, tables, hists, [
            Meta("state", json.dumps("failed")), Meta("step", json.dumps(step)),
            Event(step, "error", "critical", message, {"rule": "store"})])
    except sqlite3.Error as e:
        log.error("the run's failure could not be recorded either: %s", e)
        return False
    return True
