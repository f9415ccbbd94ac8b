"""Ctrl-C while a run ends in the foreground: the first press lets the final checkpoint
and the store's last commit finish, then interrupts; a second press abandons them. Ctrl-C
in a `wait()` for a run in the background ends the wait, not the run, and says so. And
`Terminated`: how a script's SIGTERM unwinds its loop (monitor/exiting.py).

Without it a press during the close (the cell's `with` block, the Trainer's end) cut the
checkpoint's write or the store's last commit short: the run read 'stale' and could not
be resumed, though every step had run. After a second press the run still ends a stop,
its steps recorded, without the final checkpoint (`opening._finish`)."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_NOTES = hasattr(BaseException, "add_note")  # Python 3.11+; on 3.10 the message is the args


class Terminated(SystemExit):
    """SIGTERM while a script's run trains (`kill`, a scheduler's preemption, `docker
    stop`): raised in the main thread, it unwinds the loop as Ctrl-C does (the run ends
    `stopped` with a stop checkpoint, every step recorded) and exits the process with
    status 143, as the signal would have."""

    def __init__(self, why: str) -> None:
        super().__init__(128 + signal.SIGTERM)
        self.why = why


@contextmanager
def wait_only(run: Any) -> Iterator[None]:
    """A wait for `run` (a handle with `running`, `state`, `step`, `run_dir`): Ctrl-C ("Interrupt
    kernel") ends the wait, not the run, and its KeyboardInterrupt says so (it said nothing,
    and the run trained on unseen by whoever pressed it to stop training)."""
    try:
        yield
    except KeyboardInterrupt as e:
        if run.running:
            note = (f"nbwatch: Ctrl-C ended the wait, not the run: it is {run.state} at step "
                    f"{run.step} in {run.run_dir}; stop() or the Stop button stops it")
            if _NOTES:
                e.add_note(note)
            else:  # Python 3.10 has no notes: the interrupt's own message says it
                e.args = (*e.args, note)
        raise


@contextmanager
def finish_first(what: str, interrupted: bool = False) -> Iterator[None]:
    """Hold Ctrl-C while `what` runs (the main thread, under Python's own handler only:
    a handler of the user's or a framework's is left as it is); raise the held
    KeyboardInterrupt once it is done, unless the block ends a Ctrl-C already
    (`interrupted`)."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    pressed: list[bool] = []

    def on_sigint(signum: int, frame: Any) -> None:
        if pressed:
            raise KeyboardInterrupt
        pressed.append(True)
        print(f"nbwatch: Ctrl-C waits until {what} (a second or two); press Ctrl-C again "
              "to abandon that (the run then ends without its final checkpoint)",
              file=sys.stderr, flush=True)

    signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if pressed and not interrupted:
        raise KeyboardInterrupt
