"""`FitRun`: the handle `nbwatch.hf.start(...)` and `nbwatch.lightning.start(...)` return
at once, before the framework has built its optimizer (so before the Monitor exists): it
queues the controls until then and reads the run folder, with the Monitor's surface.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import controls as ctl
from ..interrupts import wait_only
from ..lifecycle import LIVE, RunState
from ..ownership import forked_from, refuse_in_training_thread
from ..records import Command, Event
from ..run import Readout, Run, started_run
from ..runner import run_in_thread
from ..store import RunStore, is_run_dir

if TYPE_CHECKING:
    from ..monitor import Monitor


class FitRun(ctl.Controls, Readout):
    """A framework's fit running in a background thread, watched by nbwatch.

    `pause resume stop checkpoint set_clip scale_lr`, `state`, `step`, `wait()`, `df`,
    `events`, `export_html`, `show()`: as on a `Monitor`.
    """

    def __init__(self, run_dir: Path, name: str, commands: ctl.CommandQueue):
        self.run_dir, self.name = Path(run_dir), name
        self._commands = commands
        self.monitor: Monitor | None = None  # set by the callback when the fit begins
        self._error: BaseException | None = None
        self._error_tb: Any = None
        self._done = threading.Event()
        self._pid = os.getpid()  # a forked child never ends this fit's run
        self._thread: threading.Thread | None = None
        self._placeholder = False  # this handle wrote the folder's first records

    def _start(self, fit: Callable[[], Any], end: Callable[[BaseException | None], None]
               ) -> FitRun:
        from .._omp import release_caller_pool

        def body() -> None:
            err: BaseException | None = None
            try:
                fit()
            except BaseException as e:  # noqa: BLE001 - recorded, re-raised by wait()
                err = e
                self._error, self._error_tb = e, e.__traceback__
            finally:
                end(err)
                self._ended_unopened(err)
                atexit.unregister(self._at_exit)

        if not is_run_dir(self.run_dir):
            # The dashboard names this folder now, seconds (a model load, a dataset map)
            # before the fit's first step opens the run: it must open from the start.
            _write_folder(self.run_dir, {"name": self.name, "state": "starting",
                                         "started": time.time()})
            self._placeholder = True
        release_caller_pool()
        self._thread = run_in_thread(body, f"nbwatch-fit-{self.name}", self._done)
        atexit.register(self._at_exit)
        return self

    def _ended_unopened(self, error: BaseException | None, why: str | None = None) -> None:
        """The fit ended (or the process does) before its first step opened the run: say
        so in the folder, which would otherwise read `starting` for ever."""
        if not self._placeholder or self.monitor is not None:
            return
        self._placeholder = False
        if error is not None:
            msg = f"{type(error).__name__}: {error}"
            meta = {"state": "failed"}
            ev = Event(0, "error", "critical", msg,
                       {"traceback": "".join(traceback.format_exception(error))})
        else:
            why = why or "the fit returned before its first optimizer step"
            meta, ev = {"state": "stopped", "stopped_by": why}, Event(
                0, "state", "warning", f"{why}: nothing was trained",
                {"state": "stopped", "reason": why})
        with contextlib.suppress(Exception):  # the fit's own error matters more
            _write_folder(self.run_dir, meta, ev)

    def _at_exit(self) -> None:
        """The process ends while the fit has not opened its run yet (a kernel shut down
        during the Trainer's setup); once open, the Monitor's own exit hook stops it."""
        if self._done.is_set() or forked_from(self._pid):
            return
        from ..notebook import in_notebook

        why = "kernel shut down" if in_notebook() else "the program exited"
        self._ended_unopened(None, f"{why} before the first step")

    # -- controls -----------------------------------------------------------------------
    def submit(self, command: Command) -> None:
        if self.monitor is not None:  # the fit has begun: the Monitor's rules, its queue
            self.monitor.submit(command)
            return
        ctl.refuse_early(command, self.state, self.running)  # a rewind: refused when taken
        self._commands.put(command)

    # -- what the caller reads ----------------------------------------------------------
    @property
    def state(self) -> RunState:
        if self.monitor is not None and self.monitor.state != RunState.CREATED:
            return self.monitor.state
        if self._done.is_set():  # ended before its first step opened the run
            return RunState.FAILED if self._error is not None else RunState.STOPPED
        return RunState.STARTING

    @property
    def running(self) -> bool:
        return self.state in LIVE and not self._done.is_set()

    @property
    def step(self) -> int:
        return self.monitor.step if self.monitor is not None else 0

    @property
    def stopping(self) -> bool:
        return self.monitor is not None and self.monitor.stopping

    @property
    def error(self) -> BaseException | None:
        return self._error or (self.monitor.error if self.monitor is not None else None)

    def wait(self, timeout: float | None = None) -> FitRun:
        """Block until the fit returns; re-raise its exception, if any."""
        refuse_in_training_thread("wait()", (self._thread,))
        with wait_only(self):
            ended = self._done.wait(timeout)
        if not ended:
            raise TimeoutError(f"the fit is still running at step {self.step} after {timeout}s")
        if self._thread is not None:
            self._thread.join()
        if self.monitor is not None:
            self.monitor.wait_closed()
        if self._error is not None:  # with its own traceback, however often it is asked
            raise self._error.with_traceback(self._error_tb)
        return self

    def _run(self) -> Run | None:
        return started_run(self.run_dir)

    def __repr__(self) -> str:
        return f"<nbwatch.FitRun {self.name!r} {self.state} at step {self.step} in {self.run_dir}>"


def _write_folder(run_dir: Path, meta: dict[str, Any], event: Event | None = None) -> None:
    """Write `meta` (and `event`) into the run folder's store, and close it."""
    store = RunStore(run_dir)
    try:
        for k, v in meta.items():
            store.set_meta(k, v)
        if event is not None:
            store.put(event)
    finally:
        store.close()
