"""Follow a run that another process writes (a script, a `torchrun` job): `nbwatch.attach`.

Reading goes through the store's read-only connections, as the dashboard's does. Controls
go the other way as one `commands` row each, written with a short-lived connection; the
writer's runner polls that table every 0.25 s, applies the command between steps and
records an `action` event, which is the acknowledgement.

Liveness (`store/liveness.py`) is read from the store: a run whose meta still says running but
whose writer is gone, or that nothing has touched for `stale_after` seconds, is "stale".
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sqlite3
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pandas as pd

from . import controls as ctl
from .interrupts import wait_only
from .lifecycle import STALE, WAITING
from .records import Command
from .run import EVENT_COLUMNS, Run, started_run
from .store import DB_NAME, is_run_dir, send_command
from .store.liveness import ENDED, LIVE, STALE_AFTER, RunFailed, last_write, run_state
from .text import duration

T = TypeVar("T")


class Attached(ctl.Controls):
    """A run written by another process, followed from here: `nbwatch.attach(run_dir)`.

    The same surface as `Monitor` (pause/resume/stop/checkpoint/set_clip/scale_lr, step,
    state, running, error, traceback, df, events): reads go through a `Run` of the folder
    (once the writer has created its store), commands are rows written to the store.

    >>> att = nbwatch.attach("runs/exp1")
    >>> att.state, att.step
    ('running', 420)
    >>> att.pause()          # the other process pauses after its current step
    >>> att.message
    'paused at step 421 of 2000; last write 0.4 s ago'
    """

    process: subprocess.Popen[bytes]  # the launched job, on a run `nbwatch.torchrun` started

    def __init__(self, run_dir: str | os.PathLike, stale_after: float = STALE_AFTER):
        if not stale_after > 0:
            raise ValueError(f"stale_after must be a positive number of seconds, got "
                             f"{stale_after!r}")
        self.run_dir = Path(run_dir).absolute()  # a later os.chdir (%cd) must not move it
        self.stale_after = float(stale_after)
        self._run: Run | None = None  # set once the writer has created the store
        self.source = f"attach:{socket.gethostname()}:{os.getpid()}"

    # -- reading: a live `Run` of the folder, once its writer has created the store -----
    def _live_run(self) -> Run | None:
        if self._run is None:
            self._run = started_run(self.run_dir)
        return self._run

    def _read(self, read: Callable[[Run], T], default: T) -> T:
        """`read(run)`, or `default` before the writer has created the store."""
        run = self._live_run()
        if run is None:
            return default
        try:
            return read(run)
        except sqlite3.OperationalError:  # the writer is creating the schema right now
            return default

    @property
    def exists(self) -> bool:
        """True once the writer has created the run's store."""
        return is_run_dir(self.run_dir)

    @property
    def meta(self) -> dict[str, Any]:
        return self._read(lambda r: r.meta, {})

    @property
    def name(self) -> str:
        return self._read(lambda r: r.name, self.run_dir.name)

    @property
    def config(self) -> dict[str, Any]:
        return self._read(lambda r: r.config, {})

    @property
    def step(self) -> int:
        """Steps the writer has committed so far (0 while waiting)."""
        return self._read(lambda r: r.step, 0)

    @property
    def seconds_since_write(self) -> float | None:
        """Seconds since the writer last committed anything (None while waiting)."""
        if not self.exists:
            return None
        t = self._read(lambda r: last_write(self.run_dir, r.reader), None)
        if t is None:
            t = last_write(self.run_dir)
        return None if t is None else max(time.time() - t, 0.0)

    @property
    def state(self) -> str:
        """'waiting' (no store yet), 'starting', 'running', 'paused', 'stopped',
        'finished', 'failed', or 'stale' (meta says live, but nothing was written for
        `stale_after` seconds or the writer process is gone)."""
        if not self.exists:
            return WAITING
        run = self._live_run()
        return run_state(self.run_dir, self.meta, run.reader if run is not None else None,
                         self.stale_after)

    @property
    def running(self) -> bool:
        """True while the writer is alive and its run not over (starting/running/paused)."""
        return self.state in LIVE

    @property
    def message(self) -> str:
        """One line saying where the run stands, for people."""
        state = self.state
        if state == WAITING:
            return (f"waiting for a run in {self.run_dir} (no {DB_NAME} yet): start the "
                    "training process with this run_dir")
        meta, step = self.meta, self.step
        of = f" of {meta['max_steps']}" if meta.get("max_steps") else ""
        age = self.seconds_since_write
        ago = f"{duration(age)} ago" if age is not None else "never"
        if state == STALE:
            was = meta.get("state", "running")
            return (f"stale: the writer has written nothing for {ago.removesuffix(' ago')} "
                    f"(its meta still says {was} at step {step}{of}); the process has "
                    "probably been killed or hangs")
        if state == "failed":
            err = self.error
            return f"failed at step {step}{of}: {err}" if err else f"failed at step {step}{of}"
        if state in ENDED:
            return f"{state} at step {step}{of}"
        return f"{state} at step {step}{of}; last write {ago}"

    @property
    def error(self) -> RunFailed | None:
        """The error that ended the run in its own process (message and traceback text)."""
        last = self._read(lambda r: r.reader.last_error(), None)
        return RunFailed(last[0], last[1].get("traceback")) if last is not None else None

    @property
    def traceback(self) -> str | None:
        err = self.error
        return err.traceback if err is not None else None

    @property
    def df(self) -> pd.DataFrame:
        """One row per step (index `step`), one column per scalar."""
        return self._read(lambda r: r.df, pd.DataFrame(index=pd.Index([], name="step")))

    @property
    def events(self) -> pd.DataFrame:
        """Alerts, actions, checkpoints and state changes: step, kind, severity, message."""
        return self._read(lambda r: r.events, pd.DataFrame(columns=EVENT_COLUMNS))

    def wait_started(self, timeout: float = 60.0, poll: float = 0.1) -> Attached:
        """Block until the writer has created the store (raises TimeoutError after `timeout`)."""
        deadline = time.monotonic() + timeout
        while not self.exists:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no nbwatch run appeared in {self.run_dir} within {timeout:g} s; check "
                    "that the training process runs and was given this run_dir")
            time.sleep(poll)
        return self

    def wait(self, timeout: float | None = None, poll: float = 0.25) -> Attached:
        """Block until the run ends; raise `RunFailed` if it failed, RuntimeError if stale."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with wait_only(self):
            while True:
                state = self.state
                if state in ENDED or state == STALE:
                    break
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"the run is still {state} at step {self.step} after "
                                       f"{timeout:g} s")
                time.sleep(poll)
        if state == "failed":
            raise self.error or RunFailed(f"the run in {self.run_dir} failed")
        if state == STALE:
            raise RuntimeError(self.message)
        return self

    # -- controls (a row in the store's commands table) ---------------------------------
    def submit(self, command: Command) -> None:
        state, kind = self.state, command.kind.value
        if state not in LIVE or state == "stopping":
            why = ("has not started yet (no store in the folder)" if state == WAITING else
                   "is stale (its writer stopped writing)" if state == STALE else f"is {state}")
            raise RuntimeError(f"cannot {kind}: the run in {self.run_dir} {why}")
        command = dataclasses.replace(command, source=self.source if command.source == "api"
                                      else f"{self.source}:{command.source}")
        send_command(self.run_dir, command)

    # -- display ------------------------------------------------------------------------
    def show(self) -> Any:
        """Display the live dashboard (its buttons write commands into the store)."""
        from IPython.display import display

        from .widget import Dashboard

        dash = Dashboard.for_monitor(self)  # type: ignore[arg-type]  # duck-typed Monitor
        display(dash)
        return dash

    def close(self) -> None:
        """Close this thread's read connection (others close when their thread ends)."""
        if self._run is not None:
            self._run.reader.close()

    def __enter__(self) -> Attached:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<nbwatch.Attached {self.name!r} in {self.run_dir}: {self.message}>"


def attach(
    run_dir: str | os.PathLike,
    timeout: float | None = None,
    *,
    stale_after: float = STALE_AFTER,
    display: bool | None = None,
) -> Attached:
    """Follow a run that another process writes into `run_dir`, with working controls.

    Returns at once (state 'waiting' until the run's store appears); with `timeout`, first
    waits up to that many seconds for it and raises TimeoutError if it does not appear. In
    a notebook the live dashboard displays.

    >>> att = nbwatch.attach("runs/exp1")   # e.g. a `torchrun train.py` in a terminal
    >>> att.scale_lr(0.5)                   # applied by that process between two steps
    >>> att.df["loss/train"].tail()
    """
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise NotADirectoryError(
            f"attach() takes a run folder (the run_dir a Monitor writes into), and {run_dir} "
            "is a file; pass the folder that holds nbwatch.db")
    att = Attached(run_dir, stale_after=stale_after)
    if timeout is not None:
        att.wait_started(timeout)
    if display is None:
        from .notebook import in_notebook as _in_notebook

        display = _in_notebook()
    if display:
        att.show()
    return att
