"""How a run ends when its process does: the interpreter's exit under a running
training thread, a script's loop that ended without `with`/close(), a script's SIGTERM and
torchrun's. A part of `Monitor`: it reads the run's session and training thread, and
registers itself with `atexit` (and a script's SIGTERM handler) while a run may need it.

A script's SIGTERM (`kill`, a scheduler's preemption or time limit, `docker stop`) would
end the process at once, its last steps still in the store's queue and the run read
`stale`. While a run trains in a script whose SIGTERM is Python's default, it raises
`Terminated` in the main thread instead: a loop there unwinds as Ctrl-C does, a training
thread is stopped as at the interpreter's exit, the run ends `stopped` ("terminated by
SIGTERM at step N", said before the stop checkpoint), and the process exits 143. A second
SIGTERM ends it at once. A handler of the user's and IPython's (a notebook's kernel) are
left as they are. Under torchrun a SIGTERM may say a rank failed: `record_sigterm`."""

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
from ..interrupts import Terminated
from ..notebook import in_notebook
from ..ownership import forked_from
from ..recorder.failure import unsay_stop
from ..records import Event
from ..store import RunStore
from .background import TrainingThread
from .ending import interrupted, record_stop_reason
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
        self.terminated: str | None = None  # why, once a SIGTERM ends the run
        self.stop_asked = False  # under torchrun: rank 0 asked the SIGTERM's stop

    def arm_thread(self) -> None:
        """A run trains in the background: stop it if the interpreter exits under it."""
        atexit.register(self.stop_at_exit)
        _arm_sigterm(self)

    def disarm_thread(self) -> None:
        atexit.unregister(self.stop_at_exit)
        _disarm_sigterm(self)

    def arm_loop(self) -> None:
        """A loop of one's own opened its run: record how the process ends it."""
        atexit.register(self.at_exit)
        _arm_sigterm(self)

    def disarm_loop(self) -> None:
        atexit.unregister(self.at_exit)
        _disarm_sigterm(self)

    def ends_on_sigterm(self) -> bool:
        """Whether a SIGTERM now ends this Monitor's run (one that trains, in the process
        that opened it, not under torchrun)."""
        run = self._session
        rec = run.recorder
        return (not forked_from(self._pid) and run.running
                and (rec is None or rec.dist is None))

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
        _disarm_sigterm(self)  # from here a SIGTERM ends the process as it would
        kernel = in_notebook()
        # a script's Ctrl-C in mon.wait() (or after it) ends the program with this; IPython
        # sets it for every traceback it shows: an interrupted cell, long before
        ctrl_c = not kernel and isinstance(
            getattr(sys, "last_exc", None) or getattr(sys, "last_value", None),
            KeyboardInterrupt)
        what = ("SIGTERM" if self.terminated else
                "the kernel shut down" if kernel else
                "Ctrl-C ended the program" if ctrl_c else "the program exited")
        run = self._session
        why = self.terminated or (interrupted(run.step) if ctrl_c else
                                  f"{what.removeprefix('the ')} at step {run.step}")
        record_stop_reason(run.store, run.setup.rank, run.step, why, run.progress)
        with contextlib.suppress(RuntimeError):  # it ended a moment ago
            self._send("stop", source="exit")
        deadline = time.monotonic() + exit_budget()
        ended.wait(max(0.0, deadline - time.monotonic()))
        for t in threads:
            if t is not None:
                t.join(max(0.0, deadline - time.monotonic()))
        done = ended.is_set()
        hint = ("" if self.terminated or ctrl_c else
                "A last cell with mon.wait() lets a notebook run headless to its end."
                if kernel else "Call mon.wait() to let a run finish.")
        print(f"nbwatch: {what} while run {run.setup.name!r} was training; it was stopped at "
              f"step {run.step} ({run.state}), "
              f"{'with a checkpoint' if done else 'before its stop checkpoint was written'}, "
              f"in {run.setup.run_dir}. {hint}".rstrip(), file=sys.stderr)

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
        if self.terminated:  # a SystemExit leaves no sys.last_exc
            exc = Terminated(self.terminated)
        with contextlib.suppress(Exception):
            run.end_loop(exc)

    def record_sigterm(self, store: RunStore | NullStore) -> None:
        """torchrun sends SIGTERM to every rank when it is sent one, and to the survivors
        when a rank dies, sometimes before the lost connection reaches the training
        thread. No failure known: the run stops (a dead rank fails it at the meeting);
        where a framework's handler (Lightning's) takes SIGTERM, the signal is its own to
        answer (Lightning raises its SIGTERMException on every rank at one batch boundary,
        which the adapter ends as a stop). Otherwise die as asked once the failure is
        recorded (where it is being recorded in the thread the signal interrupted, at
        once)."""
        if threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)
        # a handler of a framework's (Lightning's) or the user's: theirs to stop the run
        ours = previous in (signal.SIG_DFL, None)
        if not ours and self._session.setup.rank != 0:
            return

        def on_sigterm(signum: int, frame: Any) -> None:
            if forked_from(self._pid):  # a DataLoader worker, ended by its parent
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
                os.kill(os.getpid(), signum)
                return
            run = self._session
            p = run.progress
            interrupted = p.failing_in is threading.current_thread()
            if run.running and p.error is None and ours:
                if self.terminated is None:  # the launcher's own, maybe
                    self._stop_at_meeting(signum)
                    return
                # a second one before the ranks met: the launcher ends the job because a
                # rank failed. The failure is recorded before this rank dies (it read
                # `stopped` by the first SIGTERM, no failure said); a third ends it at once
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
                if run.mode == "loop":  # this thread trains: it records the failure itself
                    return
                _await(lambda: p.error is not None or not run.running, 10)
            if run.running and p.error is None:  # the framework's: it stops the fit
                signal.signal(signum, previous)
                if callable(previous):
                    previous(signum, frame)
                return
            if p.error is not None and interrupted and not p.failure_recorded.is_set():
                # this handler interrupted the thread recording the failure (a loop of
                # one's own, in the main thread): it cannot wait for it. The error and the
                # state, if not yet said, now; then the recording goes on (the emergency
                # checkpoint), its error ends the process, and a second SIGTERM (or
                # torchrun's SIGKILL, 30 s on) ends it at once.
                with contextlib.suppress(Exception):
                    if not p.error_said:
                        store.put(Event(run.step, "error", "critical", p.error_message or
                                        f"[rank 0] {type(p.error).__name__}: {p.error}",
                                        {"traceback": p.traceback}))
                        p.error_said = True
                    store.set_meta("state", "failed")
                    unsay_stop(store, p)
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
                return
            elif p.error is not None:  # the training thread is recording it
                p.failure_recorded.wait(15)  # torchrun kills 30 s after its SIGTERM
            with contextlib.suppress(Exception):
                store.flush(timeout=5)
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
            os.kill(os.getpid(), signum)

        signal.signal(signal.SIGTERM, on_sigterm)

    def _stop_at_meeting(self, signum: int) -> None:
        """torchrun's SIGTERM, no failure known: rank 0 asks a stop, which every rank takes
        at the ranks' next meeting (within ~2 s, before torchrun's SIGKILL 30 s on), with
        the stop checkpoint, and the other ranks train on to it; a rank that died fails
        the run there instead. A loop of one's own asks it at its next log(), where the
        main thread holds no lock of the store's (`raise_if_terminated`)."""
        self.terminated = f"terminated by SIGTERM at step {self._session.step}"
        if self._session.mode == "loop":
            if self not in _ENDED_BY_SIGTERM:
                _ENDED_BY_SIGTERM.append(self)
        else:  # the main thread waits for the training thread
            self.ask_stop()

    def ask_stop(self) -> None:
        """Rank 0 asks, once, the stop of a SIGTERM under torchrun."""
        run = self._session
        if self.stop_asked or run.setup.rank != 0 or self.terminated is None:
            return
        self.stop_asked = True
        record_stop_reason(run.store, 0, run.step, self.terminated, run.progress)
        with contextlib.suppress(RuntimeError):  # it ended a moment ago
            self._send("stop", source="exit")


# The runs a script's SIGTERM ends now (their ProcessExit), while `_on_sigterm` is the
# process's handler: one handler for all of a script's Monitors.
_ENDED_BY_SIGTERM: list[ProcessExit] = []


def _await(done: Callable[[], bool], timeout: float) -> None:
    """Wait up to `timeout` s for `done()` (a signal handler's wait for another thread)."""
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        time.sleep(0.05)


def _arm_sigterm(exit_: ProcessExit) -> None:
    """Let a SIGTERM end `exit_`'s run, where SIGTERM is Python's default: in a script's
    main thread (a kernel's and torchrun's are their own, IPython would catch the exit, a
    user's handler is kept)."""
    if threading.current_thread() is not threading.main_thread():
        return
    # None while another thread imports IPython: a module half imported runs no shell
    get_ipython = getattr(sys.modules.get("IPython"), "get_ipython", None)
    if get_ipython is not None and get_ipython() is not None:
        return
    handler = signal.getsignal(signal.SIGTERM)
    if handler is not _on_sigterm:
        if handler is not signal.SIG_DFL:
            return
        signal.signal(signal.SIGTERM, _on_sigterm)
    if exit_ not in _ENDED_BY_SIGTERM:
        _ENDED_BY_SIGTERM.append(exit_)


def _disarm_sigterm(exit_: ProcessExit) -> None:
    """`exit_`'s run ended: SIGTERM is Python's default again once no run needs it (only
    the main thread may set it; elsewhere the handler acts as the default would)."""
    if exit_ in _ENDED_BY_SIGTERM:
        _ENDED_BY_SIGTERM.remove(exit_)
    if (not _ENDED_BY_SIGTERM and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is _on_sigterm):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def raise_if_terminated(session: RunSession) -> None:
    """At a loop of one's own's step boundary: raise again the `Terminated` of a SIGTERM
    that did not end the loop. Python prints and drops an exception raised where it cannot
    propagate: a SIGTERM that lands during a fork (a DataLoader starts its worker every
    epoch) is handled in an at-fork callback ("Exception ignored in ..."), and the loop
    trained on, its run never ended. Under torchrun, rank 0 asks the ranks' stop instead."""
    if session.mode != "loop":  # a training thread's run is stopped by the main thread
        return
    rec = session.recorder
    for e in _ENDED_BY_SIGTERM:
        if e._session is session and e.terminated:
            if rec is not None and rec.dist is not None:  # the ranks stop at a meeting
                e.ask_stop()
                return
            raise Terminated(e.terminated)


def _answers_itself(handler: Any) -> bool:
    """Whether `handler`, set over `_on_sigterm`, answers SIGTERM itself and calls the one
    it found as a notice only (Lightning's: its loop raises SIGTERMException at the next
    batch), not to hand the signal on for that one's answer (a script's cleanup that then
    calls the handler it found, expecting the default's: the process ends)."""
    module = getattr(handler, "__module__", None)
    return isinstance(module, str) and module.split(".")[0] in ("lightning",
                                                                  "pytorch_lightning")


def _on_sigterm(signum: int, frame: Any) -> None:
    ending = [e for e in _ENDED_BY_SIGTERM if e.ends_on_sigterm()]
    if not ending and _answers_itself(signal.getsignal(signum)):
        # called by a framework's handler set over this one (Lightning's calls the one it
        # found): no run of nbwatch's to end, so the signal is that handler's to answer.
        # This one is left set where a run ended in its training thread (start()), which
        # cannot unset it; any other handler that calls it gets the default's answer
        return
    signal.signal(signum, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    if not ending:  # no run to end (a DataLoader worker forked from here, torchrun's rank)
        os.kill(os.getpid(), signum)
        return
    why = f"terminated by SIGTERM at step {max(e._session.step for e in ending)}"
    for e in ending:
        e.terminated = why
    print(f"nbwatch: {why}: the run stops there, its steps recorded (a second SIGTERM "
          "ends the process at once)", file=sys.stderr, flush=True)
    raise Terminated(why)
