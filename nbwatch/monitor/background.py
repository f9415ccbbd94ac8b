"""The training thread of `start()` and `run()`: started, waited for, and followed by a
finisher that closes the run when the thread ends, whether or not anyone waits."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from .._omp import release_caller_pool
from ..ownership import refuse_in_training_thread
from ..runner import run_in_thread


class TrainingThread:
    """One Monitor's background thread (a new one for each run it starts)."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._finisher: threading.Thread | None = None
        self._done: threading.Event | None = None  # set when the training thread ends

    @property
    def started(self) -> bool:
        """A run was started in the background (by `start()` or `run()`)."""
        return self._done is not None

    @property
    def done(self) -> threading.Event | None:
        """Set when the training thread ends; None before the first start."""
        return self._done

    @property
    def threads(self) -> tuple[threading.Thread | None, ...]:
        """The training thread and its finisher: neither may wait for the run's end."""
        return (self._thread, self._finisher)

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def start(self, target: Callable[[], Any], name: str, on_end: Callable[[], None]) -> None:
        """Run `target` in a new thread; `on_end()` runs in the finisher once it ended."""
        release_caller_pool()
        done = self._done = threading.Event()
        self._thread = run_in_thread(target, name, done)

        def finish() -> None:
            done.wait()
            on_end()

        self._finisher = threading.Thread(target=finish, name="nbwatch-finish", daemon=True)
        self._finisher.start()

    def wait(self, timeout: float | None, step: Callable[[], int]) -> None:
        """Block until the thread and its finisher ended; TimeoutError after `timeout` s
        (saying the step it stands at). Refused from the thread itself."""
        done = self._done
        if done is None:
            raise RuntimeError("wait() before start() or run(): nothing runs in the background")
        refuse_in_training_thread("wait()", self.threads)
        deadline = None if timeout is None else time.monotonic() + timeout
        # Event.wait, not Thread.join: an interrupted join can mark a live thread stopped
        while not done.wait(0.1 if deadline is None
                            else max(0.0, min(0.1, deadline - time.monotonic()))):
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"training still running at step {step()} after {timeout}s")
        # The thread has finished its work: join it so that nothing of it runs while the
        # interpreter shuts down (torch aborts a process whose thread outlives it).
        for t in self.threads:
            if t is not None:
                t.join()

    def join_finisher(self, timeout: float) -> None:
        """Give the finisher `timeout` s (it may be folding the store's WAL right now)."""
        if self._finisher is not None:
            self._finisher.join(timeout)
