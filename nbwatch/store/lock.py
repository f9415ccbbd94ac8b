"""One writer per run folder. On a local disk: an flock on the folder, released by the OS
when the writer's process dies, so readers can tell a live writer from a killed one
exactly. In network mode (`mode.py`: NFS, Lustre, GPFS, where flock may be missing and is
not seen from other hosts): a heartbeat file, `nbwatch.writer`, that the writer claims
with `O_EXCL` and rewrites every `BEAT_EVERY` seconds (pid, host, wall time); a reader
counts it dead after `DEAD_AFTER` seconds without a beat, or at once when its pid is gone
on this host. The writer removes it when it closes; a killed writer leaves it, stale."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

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


HEARTBEAT_NAME = "nbwatch.writer"
BEAT_EVERY = 1.0  # s between two beats of a network-mode writer
DEAD_AFTER = 10 * BEAT_EVERY  # s without a beat before a reader counts the writer gone
_BEAT_SIZE = 512  # the file is rewritten in place, padded to this size: one small write


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return pid > 0  # someone else's live process (or a pid that cannot be asked)
    return True


def read_heartbeat(run_dir: Path) -> dict[str, Any] | None:
    """The heartbeat of `run_dir`'s network-mode writer: its fields, plus `mtime` (the file's)
    and `torn: True` where the text cannot be read (a claim being written); None when there
    is no heartbeat file. Opened, read and closed: on NFS an open sees the newest write."""
    path = Path(run_dir) / HEARTBEAT_NAME
    try:
        with open(path, "rb") as f:
            text = f.read(4 * _BEAT_SIZE)
            mtime = os.fstat(f.fileno()).st_mtime
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        info = json.loads(text.decode())
        if not isinstance(info, dict):
            raise ValueError
    except ValueError:
        info = {"torn": True}
    info["mtime"] = mtime
    return info


def heartbeat_alive(info: dict[str, Any], now: float | None = None) -> bool:
    """Whether the writer of a heartbeat (`read_heartbeat`) is alive: it beat within its
    dead time (`dead_after`, DEAD_AFTER by default), and, on this host, its pid lives. By
    the writer's clock: hosts of a cluster must agree within seconds (NTP)."""
    now = time.time() if now is None else now
    if info.get("closed"):
        return False
    dead_after = float(info.get("dead_after", DEAD_AFTER))
    wall = info.get("wall")
    if not isinstance(wall, (int, float)):
        wall = info["mtime"]
    if now - float(wall) > dead_after:
        return False
    pid = info.get("pid")
    return not (info.get("host") == socket.gethostname() and isinstance(pid, int)
                and not _pid_alive(pid))


def _describe(info: dict[str, Any]) -> str:
    age = time.time() - float(info.get("wall", info["mtime"]))
    return (f"pid {info.get('pid', '?')} on host {info.get('host', '?')}, last heartbeat "
            f"{age:.1f} s ago")


class Heartbeat:
    """A network-mode writer's claim on its run folder: the `nbwatch.writer` file, taken
    with `O_EXCL` (a stale one, of a dead writer, is renamed away first: one taker wins),
    rewritten in place every `every` seconds by a thread, removed by `release()`."""

    def __init__(self, run_dir: Path, every: float = BEAT_EVERY,
                 dead_after: float | None = None):
        self.path = Path(run_dir) / HEARTBEAT_NAME
        self.every = float(every)
        self.dead_after = float(dead_after if dead_after is not None else 10 * every)
        self.token = uuid.uuid4().hex
        self.started = time.time()
        self.fd = self._claim()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="nbwatch-heartbeat",
                                        daemon=True)
        self._thread.start()

    def _claim(self) -> int:
        for _ in range(50):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                info = read_heartbeat(self.path.parent)
                if info is None:
                    continue  # removed meanwhile: try again
                if info.get("torn") and time.time() - info["mtime"] < DEAD_AFTER:
                    time.sleep(0.02)  # another writer's claim, being written right now
                    continue
                if heartbeat_alive(info):
                    raise RunInUse(_in_use(self.path.parent, _describe(info))) from None
                with contextlib.suppress(FileNotFoundError):  # one taker wins the rename
                    dead = self.path.with_name(f".{HEARTBEAT_NAME}.dead-{self.token}")
                    os.rename(self.path, dead)
                    dead.unlink()
                continue
            try:
                self._write(fd)
            except BaseException:
                os.close(fd)
                with contextlib.suppress(OSError):
                    self.path.unlink()
                raise
            return fd
        raise RunInUse(_in_use(self.path.parent, "another writer claiming it at this moment"))

    def _write(self, fd: int) -> None:
        data = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                           "wall": time.time(), "every": self.every,
                           "dead_after": self.dead_after, "started": self.started,
                           "token": self.token}).encode()
        os.pwrite(fd, data.ljust(_BEAT_SIZE), 0)
        os.fsync(fd)  # to the file server now, not at the client's leisure

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self._write(self.fd)
            except OSError:  # a full disk or a gone folder: the store's writer says so
                continue

    def release(self) -> None:
        """Stop beating and remove the file, if it is still this writer's."""
        self._stop.set()
        self._thread.join(timeout=5)
        info = read_heartbeat(self.path.parent)
        if info is not None and info.get("token") == self.token:
            with contextlib.suppress(OSError):
                self.path.unlink()
        with contextlib.suppress(OSError):
            os.close(self.fd)


def writer_alive(run_dir: str | Path) -> bool:
    """True while a live writer holds `run_dir`: from its heartbeat file in network mode,
    else from the folder's flock (exact on this host: the OS drops the lock of a killed
    process)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return False
    info = read_heartbeat(run_dir)
    if info is not None:
        return heartbeat_alive(info)
    return flock_held(run_dir)


def flock_held(run_dir: Path) -> bool:
    """True while a local-mode writer holds the folder's flock."""
    try:
        fd = _lock_dir(run_dir, exclusive=False)
    except OSError:  # no flock here (Lustre without -o flock): no local-mode writer either
        return False
    if fd is None:
        return True
    if fd >= 0:
        os.close(fd)
    return False


def drop_dead_heartbeat(run_dir: Path) -> None:
    """For a local-mode writer that holds the flock: raise RunInUse while a network-mode
    writer's heartbeat is alive; remove a dead one's, so that readers go by the flock."""
    info = read_heartbeat(run_dir)
    if info is None:
        return
    if heartbeat_alive(info):
        raise RunInUse(_in_use(run_dir, _describe(info)))
    with contextlib.suppress(FileNotFoundError):
        dead = run_dir / f".{HEARTBEAT_NAME}.dead-{uuid.uuid4().hex}"
        os.rename(run_dir / HEARTBEAT_NAME, dead)
        dead.unlink()


def _writer_meta(run_dir: Path) -> dict[str, Any] | None:
    """The run's meta, for naming its writer (None where it cannot be read yet)."""
    try:
        con = _connect(run_dir / DB_NAME, readonly=True)
        try:
            return {k: json.loads(v) for k, v in con.execute("SELECT key, value FROM meta")}
        finally:
            con.close()
    except Exception:  # noqa: BLE001 - only for a message
        return None


def _writer_named(run_dir: Path) -> str:
    """'pid 123 on host x, started 12:01:02' from the run's meta, as far as it says."""
    meta = _writer_meta(run_dir)
    if meta is None:
        return "a writer whose meta is not readable yet"
    parts = [f"pid {meta['pid']}" if "pid" in meta else "a process",
             f"on host {meta['host']}" if "host" in meta else ""]
    opened = meta.get("opened", meta.get("started"))  # this writer's open: a resume's too
    if isinstance(opened, (int, float)):
        parts.append("started " + time.strftime("%H:%M:%S", time.localtime(opened)))
    return " ".join(p for p in parts if p)


def check_no_writer(run_dir: str | Path) -> None:
    """Raise RunInUse, naming the live writer, when another one holds `run_dir`."""
    if writer_alive(run_dir):
        raise RunInUse(_in_use(Path(run_dir)))


def _mine(run_dir: Path, info: dict[str, Any] | None) -> bool:
    """Whether this very process writes `run_dir`: it holds the folder's lock, or (network
    mode) the heartbeat names it."""
    if info is not None:
        return info.get("pid") == os.getpid() and info.get("host") == socket.gethostname()
    try:
        here = os.stat(run_dir)
        return any((st.st_dev, st.st_ino) == (here.st_dev, here.st_ino)
                   for st in map(os.fstat, list(_HELD)))
    except OSError:
        return False


def _in_use(run_dir: Path, who: str | None = None) -> str:
    info = read_heartbeat(run_dir)
    if who is None:
        who = _describe(info) if info is not None else _writer_named(run_dir)
    if _mine(run_dir, info):
        return (f"{run_dir} is being written by a run of this very process ({who}): an "
                "earlier Monitor on it still trains (a cell run again?). Stop that run "
                "first (nbwatch.attach(run_dir).stop(), or its Monitor's stop() and "
                "wait()), reopen its dashboard with %nbwatch RUN_DIR, or choose another "
                "run_dir")
    return (f"{run_dir} is being written by another nbwatch run ({who}): a "
            "run folder has one writer at a time. Follow it with nbwatch.attach(run_dir), stop"
            " it first, or choose another run_dir")




def take_folder(run_dir: Path, network: bool) -> tuple[int, Heartbeat | None]:
    """The run folder's writer lock: `(flock fd, None)` on a local disk, `(-1, heartbeat)`
    in network mode. Waits a moment for a reader's probe or a closing writer to let go;
    raises `RunInUse`, naming the holder, after that."""
    if network:  # no flock: it may be missing, other hosts do not see it
        if flock_held(run_dir):  # a local-mode writer of another process
            raise RunInUse(_in_use(run_dir, _writer_named(run_dir)))
        for _ in range(20):  # a closing writer's heartbeat, for a moment
            try:
                return -1, Heartbeat(run_dir)
            except RunInUse:
                time.sleep(0.05)
        return -1, Heartbeat(run_dir)  # raises RunInUse, naming it
    for _ in range(20):  # a reader's probe holds a shared lock for a moment
        lock = _lock_dir(run_dir, exclusive=True)
        if lock is not None:
            break
        time.sleep(0.05)
    else:
        raise RunInUse(_in_use(run_dir))
    try:
        drop_dead_heartbeat(run_dir)  # a network-mode writer's, before this one
    except RunInUse:
        unlock(lock)
        raise
    return lock, None
