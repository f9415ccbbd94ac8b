"""How a run ends when its process does: the interpreter's exit under a running
training thread, a script's loop that ended without `with`/close(), and torchrun's
SIGTERM. A part of `Monitor`: it reads the run's session and training thread, and registers
itself with `atexit` while a run may need it."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ..distributed import NullStore
from ..notebook import in_notebook
from ..ownership import forked_from
from ..records import Event
from ..store import RunStore
from .background import TrainingThread
from .session import RunSession


def exit_budget() -> float:
    """Seconds a run may take to stop when the process ends under it: in a kernel, less
    than the 2.5 s before jupyter_client follows its shutdown request with SIGTERM."""
    return 2.0 if in_notebook() else 300.0


class ProcessExit:
    """Ending a Monitor's run as its process ends. `send(kind, source=...)` sends a command
    as the Monitor's API does."""

    def __init__(self, session: RunSession, thread: TrainingThread,
                 send: Callable[..., str]) -> None:
        self._session = session
        self._thread = thread
        self._send = send
        self._pid = os.getpid()  # a forked child never ends this Monitor's run

    def arm_thread(self) -> None:
        """A run trains in the background: stop it if the interpreter exits under it."""
        atexit.register(self.stop_at_exit)

    def disarm_thread(self) -> None:
        atexit.unregister(self.stop_at_exit)

    def arm_loop(self) -> None:
        """A loop of one's own opened its run: record how the process ends it."""
        atexit.register(self.at_exit)

    def disarm_loop(self) -> None:
        atexit.unregister(self.at_exit)

    def stop_at_exit(self) -> None:
        """The interpreter is exiting while the run trains (a script that did not wait(),
        a notebook's kernel shut down or restarted): stop it as the Stop button does — a
        stop checkpoint, state `stopped` — and say so, rather than let the process abort
        under a running thread."""
        if forked_from(self._pid):
            return
        done = self._thread.done
        if done is None or done.is_set():
            self._thread.join_finisher(exit_budget())
            return
        self._stop_for_exit(done, self._thread.threads)

    def _stop_for_exit(self, ended: threading.Event,
                       threads: tuple[threading.Thread | None, ...] = ()) -> None:
        """Stop a run whose loop runs in another thread, because the process is ending.

        The reason and the state `stopped` are recorded first, at once: a kernel that is
        shut down is sent SIGTERM after 2.5 s (jupyter_client's shutdown_wait_time / 2), so
        the stop checkpoint and the store's close get what is left of `exit_budget()`."""
        kernel = in_notebook()
        what = "the kernel shut down" if kernel else "the program exited"
        run = self._session
        why = f"{what.removeprefix('the ')} at step {run.step}"
        self._record_ending(why)
        with contextlib.suppress(RuntimeError):  # it ended a moment ago
            self._send("stop", source="exit")
        deadline = time.monotonic() + exit_budget()
        ended.wait(max(0.0, deadline - time.monotonic()))
        for t in threads:
            if t is not None:
                t.join(max(0.0, deadline - time.monotonic()))
        done = ended.is_set()
        print(f"nbwatch: {what} while run {run.setup.name!r} was training; it was stopped at "
              f"step {run.step} ({run.state}), "
              f"{'with a checkpoint' if done else 'before its stop checkpoint was written'}, "
              f"in {run.setup.run_dir}. "
              + ("A last cell with mon.wait() lets a notebook run headless to its end."
                 if kernel else "Call mon.wait() to let a run finish."), file=sys.stderr)

    def _record_ending(self, why: str) -> None:
        """Say now, before the stop is taken, why the run ends and that it is stopped: the
        process may be killed before the training thread gets to record it."""
        run = self._session
        store = run.store
        if store is None or run.setup.rank != 0:
            return
        with contextlib.suppress(Exception):  # a dead store: the stop still goes ahead
            store.set_meta("stopped_by", why)
            store.set_meta("state", "stopped")
            store.put(Event(run.step, "state", "warning", f"{why}: the run stops there",
                            {"state": "stopped", "reason": why}))
            store.flush(timeout=0.5)

    def at_exit(self) -> None:
        """A script's loop that ended without `with`/close(): record how the process ended.
        A loop still running in another thread (a framework's fit) is stopped instead: it
        did not end, so it must not read `finished`."""
        if forked_from(self._pid):
            return
        run = self._session
        loop, rec = run.loop_thread, run.recorder
        if (loop is not None and loop is not threading.main_thread() and loop.is_alive()
                and rec is not None and not rec.ended):
            self._stop_for_exit(run.closed)
            return
        exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
        if exc is run.exc_at_open:  # e.g. an earlier notebook cell's error: not this loop's
            exc = None
        with contextlib.suppress(Exception):
            run.end_loop(exc)

    def record_sigterm(self, store: RunStore | NullStore) -> None:
        """torchrun ends the survivors with SIGTERM when a rank dies, sometimes before the
        lost connection reaches the training thread: record the failure, then die as asked."""
        if threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)

        def on_sigterm(signum: int, frame: Any) -> None:
            if forked_from(self._pid):  # a DataLoader worker, ended by its parent
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
                os.kill(os.getpid(), signum)
                return
            run = self._session
            if run.running and run.progress.error is None:
                run.progress.move("failed")
                with contextlib.suppress(Exception):
                    store.put(Event(run.step, "error", "critical",
                                    f"[rank 0] terminated by SIGTERM at step {run.step}: "
                                    "the launcher stops the job when a rank fails", {}))
                    store.set_meta("state", "failed")
            elif run.progress.error is not None:  # the training thread is recording it
                run.progress.failure_recorded.wait(20)  # torchrun kills after 30 s
            with contextlib.suppress(Exception):
                store.flush(timeout=5)
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
            os.kill(os.getpid(), signum)

        signal.signal(signal.SIGTERM, on_sigterm)
