"""The end of a loop's run as the process or the user ends it: the reason said before the
stop is taken, and the final record that a second Ctrl-C may cut short."""

from __future__ import annotations

import contextlib

from ..distributed import NullStore
from ..recorder import StepRecorder
from ..recorder.spec import Progress
from ..records import Event
from ..store import RunStore


def interrupted(step: int) -> str:
    """The stop reason of a Ctrl-C (`run.meta["stopped_by"]`)."""
    return f"interrupted (Ctrl-C) at step {step}"


def record_stop_reason(store: RunStore | NullStore | None, rank: int, step: int,
                       why: str, progress: Progress | None = None) -> None:
    """Say now, before the stop is taken, why the run ends and that it is stopped: the
    process may be killed before the run gets to record it (rank 0's store only). A
    failure before the stop is taken (a rank that dies first) says the run failed, and
    keeps `why` as what had been asked (`progress.stop_said`, recorder/failure.py)."""
    if progress is not None:
        progress.stop_said = why
    if store is None or rank != 0:
        return
    with contextlib.suppress(Exception):  # a dead store: the stop still goes ahead
        store.set_meta("stopped_by", why)
        store.set_meta("state", "stopped")
        store.put(Event(step, "state", "warning", f"{why}: the run is stopped",
                        {"state": "stopped", "reason": why}))
        store.flush(timeout=0.5)


def finish(rec: StepRecorder, outcome: str, why: str | None = None) -> None:
    """`rec.finish(outcome)`, said first `why` where given (`record_stop_reason`); Ctrl-C
    pressed a second time while they run (`finish_first`) abandons the final checkpoint,
    and the run ends a stop all the same."""
    try:
        if why is not None:
            record_stop_reason(rec.store, 0 if rec.dist is None else rec.dist.rank, rec.step,
                               why, rec.progress)
        rec.finish(outcome)
    except KeyboardInterrupt:
        rec.abandon_end()
        raise
