"""nbwatch's own time on the training thread: what watching costs each step, measured
where it is spent (the optimizer's hooks, the step's record, `log()`'s checks, the
runner's staging of the device figures, the command poll) rather than inferred from two
noisy step times. Recorded with each step as `time/nbwatch`.

Not counted: what a user asked for (evals, checkpoints, a command's action, a pause), the
ranks' meeting under torchrun (`time/sync`), and nbwatch's background threads (the store
writer, the system sampler), which take no time of the training thread's own.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar

_now = time.perf_counter
F = TypeVar("F", bound=Callable[..., Any])


class OwnTime:
    """A clock that runs while the training thread is inside nbwatch. Entries nest (a
    `log()` records the step, which runs the rules): only the outermost one counts."""

    __slots__ = ("_total", "_since", "_depth", "_waited")

    def __init__(self) -> None:
        self._total = 0.0
        self._since = 0.0
        self._depth = 0
        self._waited = 0.0  # waits for the device inside nbwatch: not its own work

    def __enter__(self) -> OwnTime:
        if not self._depth:
            self._since = _now()
        self._depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if not self._depth:
            self._total += _now() - self._since

    @property
    def closed(self) -> float:
        """Seconds of the entries closed since the last take (what a caller outside every
        entry subtracts from its own span: a hook of nbwatch's inside a user's forward)."""
        return self._total

    def exclude(self, seconds: float) -> None:
        """`seconds` of the entry now open were a wait for the device (a copy that had not
        landed): counted apart, as `time/device_wait`, not as nbwatch's own work. Outside
        every entry (a copy read for an eval or a checkpoint, which are the user's time)
        the wait was never counted, and is not."""
        if self._depth:
            self._total -= seconds
            self._waited += seconds

    def take_wait(self) -> float:
        """Seconds waited for the device since the last call."""
        waited, self._waited = self._waited, 0.0
        return waited

    def take(self) -> float:
        """Seconds inside nbwatch since the last take, the entry now open included up
        to now (what it does after the take counts towards the next)."""
        total = self._total
        if self._depth:
            now = _now()
            total += now - self._since
            self._since = now
        self._total = 0.0
        return total


def counted(fn: F) -> F:
    """`fn(rec, ...)` runs on `rec.own`'s clock: nbwatch's own time."""
    @functools.wraps(fn)
    def run(rec: Any, *args: Any, **kwargs: Any) -> Any:
        with rec.own:
            return fn(rec, *args, **kwargs)
    return run  # type: ignore[return-value]
