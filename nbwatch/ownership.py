"""Which process and thread own a run: a forked child does not, the training thread may
not wait for the run's own end, and a loop's step is logged from the loop's thread."""

from __future__ import annotations

import os
import threading
from typing import Any


def forked_from(owner_pid: int) -> bool:
    """This process is a fork of the one that owns the run (a DataLoader worker, an
    `os.fork()`): its exit must not stop, record or wait for the parent's run, whose
    training thread it does not have."""
    return os.getpid() != owner_pid


def refuse_in_training_thread(what: str, threads: tuple[threading.Thread | None, ...]) -> None:
    """A wait for the run's end from the thread that runs it (an `on_alert` callback, a
    `step_fn`) would wait for itself: refuse it."""
    if threading.current_thread() in threads:
        raise RuntimeError(
            f"{what} was called from the run's own training thread (in on_alert, step_fn, "
            f"val_fn or sample_fn?): it would wait for itself for ever. Call it from the "
            f"thread that started the run; to end the run from there, call mon.stop()")


def refuse_other_thread(loop: threading.Thread | None) -> None:
    """`log()` records the optimizer step the loop just took: from another thread (a
    logger, a callback's thread) it would be taken as that step's record."""
    here = threading.current_thread()
    if loop is not None and loop is not here and loop.is_alive():
        raise RuntimeError(
            f"mon.log() was called from thread {here.name!r} while the training loop runs in "
            f"{loop.name!r}: log() records the optimizer step the loop just took, so call it "
            "in the loop, once after each optimizer.step()")


def own_loop_here(session: Any) -> bool:
    """A Monitor's run (its `mode`, `framework`, `loop_thread`) is a foreground loop of your
    own whose log() runs on this thread: asked from outside the loop, it is between its
    steps (after its last, or left open by a notebook cell that ended mid-loop)."""
    return (session.mode == "loop" and session.framework is None
            and session.loop_thread is threading.current_thread())
