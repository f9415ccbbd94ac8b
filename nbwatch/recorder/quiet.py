"""A quiet loop's steps, recorded from the system sampler's thread (step_end.py:
`record_if_quiet`): which thread is doing it, and what it leaves for the loop's own thread
to carry out at its next step's end (alerts, their actions, a rule's lasting clip)."""

from __future__ import annotations

import threading
from typing import Any, Protocol

from .optimizer_step import lower_clip
from .state import InFlight

_SAMPLER = threading.local()  # `.quiet`: this thread records a quiet loop's steps


class Holding(Protocol):
    """What holding and raising a quiet loop's alerts uses of its run (a `StepRecorder`)."""

    flight: InFlight
    control: Any

    def _raise_alerts(self, alerts: list) -> None: ...


def on_sampler(quiet: bool) -> None:
    """This thread starts (or ends) recording a quiet loop's steps."""
    _SAMPLER.quiet = quiet


def on_sampler_thread() -> bool:
    """On the sampler's thread, recording a quiet loop's steps (`record_if_quiet`)."""
    return getattr(_SAMPLER, "quiet", False)


def waiting(fl: InFlight) -> bool:
    """Steps wait for their record (asked without the lock: the loop may take them now)."""
    try:
        return bool(fl.pending) or bool(fl.copies and fl.copies[0].copy.ready())
    except IndexError:  # the loop took the last one meanwhile
        return False


def raise_or_hold(rec: Holding, alerts: list) -> None:
    """Raise `alerts` now, or on the sampler's thread hold them for the loop."""
    if on_sampler_thread():
        rec.flight.held_alerts.extend(alerts)
    else:
        rec._raise_alerts(alerts)


def raise_held(rec: Holding) -> None:
    """On the loop's thread: the lasting clips and the alerts of the steps a quiet loop had
    recorded for it."""
    fl = rec.flight
    for limit in fl.held_clips:
        lower_clip(rec.control, limit)
    fl.held_clips.clear()
    if fl.held_alerts:
        alerts, fl.held_alerts[:] = list(fl.held_alerts), []
        rec._raise_alerts(alerts)
