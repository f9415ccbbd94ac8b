"""One writer per run folder: an flock on the folder, released by the OS when the writer's
process dies, so readers can tell a live writer from a killed one exactly."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

from .schema import DB_NAME, _connect


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
    if exclusive:
        _HELD.add(fd)
    return fd


def unlock(fd: int) -> None:
    """Release a writer lock taken by `_lock_dir`."""
    if fd >= 0:
        _HELD.discard(fd)
        os.close(fd)


# A forked child (a DataLoader worker) shares the lock's open file description: unless the
# child closes its copy, the lock outlives the writer for as long as the worker lives.
_HELD: set[int] = set()


def _drop_in_child() -> None:
    for fd in list(_HELD):
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_in_child)


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
        con = _connect(run_dir / DB_NAME, readonly=True)
        try:
            meta = {k: json.loads(v) for k, v in con.execute("SELECT key, value FROM meta")}
        finally:
            con.close()
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


