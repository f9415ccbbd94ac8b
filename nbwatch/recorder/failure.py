"""A run's failure, recorded: the error and the state first (under torchrun the launcher
may end the process any moment now), then what helps after it: the rank that failed
first, the emergency checkpoint. Each part on its own: a dead store must not cost the
checkpoint, nor the reverse. A signal handler that interrupts the recording thread reads
`Progress.failing_in` and `error_said` (monitor/exiting.py)."""

from __future__ import annotations

import contextlib
import logging
import threading
import traceback
from typing import TYPE_CHECKING, Any, Protocol

from ..distributed import lost_peer, peer_errors
from ..records import Event

if TYPE_CHECKING:
    from ..distributed import Dist, NullStore
    from ..probes.logits import TrainLogits
    from ..store import RunStore
    from .layer_changes import LayerWatch
    from .spec import Progress
    from .state import Inbox


class Failing(Protocol):
    """What recording a failure reads and calls of its run (a `StepRecorder`)."""

    progress: Progress
    step: int
    start_step: int
    train_logits: TrainLogits
    layer_watch: LayerWatch
    dist: Dist | None
    store: RunStore | NullStore
    inbox: Inbox
    log: logging.Logger

    @property
    def ended(self) -> bool: ...
    def record_stepped(self) -> None: ...
    def flush_deferred(self) -> None: ...
    def expire_pending(self) -> None: ...
    def _emit(self, ev: Event, level: int | None = None) -> None: ...
    def _set_state(self, state: str) -> None: ...
    def _checkpoint(self, reason: str, announce: bool = True) -> Event | None: ...


def fail(rec: Failing, e: BaseException) -> None:
    """Record `e` as the end of the run, with an emergency checkpoint."""
    p = rec.progress
    p.failing_in = threading.current_thread()
    p.error, p.error_tb = e, e.__traceback__
    p.traceback = "".join(traceback.format_exception(e))
    if rec.ended:  # the loop raised after its run had ended: said, the state kept
        with contextlib.suppress(Exception):
            rec._emit(Event(rec.step, "error", "critical", f"after the run had "
                            f"{p.state}: {type(e).__name__}: {e}",
                            {"traceback": p.traceback}), logging.ERROR)
        p.failure_recorded.set()
        return
    p.move("failed")  # first (the run has ended): recording it may itself fail
    rec.train_logits.close()
    rec.layer_watch.close()
    msg, data = f"{type(e).__name__}: {e}", {}
    peers_later = False  # a peer's own error may reach the folder after this one
    if rec.dist is not None:
        if lost_peer(e):
            msg = ("lost contact with another rank (it died or hangs), so this rank "
                   f"stops: {str(e).splitlines()[0][:300]}")
            if rec.dist.rank == 0:  # which rank failed, and why, where it could say
                peers = peer_errors(rec.store.run_dir, rec.inbox.opened_wall, wait=0)
                peers_later = not peers
                if peers:
                    msg = ("another rank failed, so this rank stops: "
                           + "; ".join(p["message"] for p in peers))
                    data = {"rank_errors": peers}
        msg = f"[rank {rec.dist.rank}/{rec.dist.world}] {msg}"

    def say() -> None:
        if p.error_said:  # a SIGTERM's handler said it, interrupting this (exiting.py)
            return
        p.error_said = True
        rec._emit(Event(rec.step, "error", "critical", msg, {"traceback": p.traceback, **data}),
                  logging.ERROR)

    for record in (rec.record_stepped, rec.flush_deferred, say,
                   lambda: rec._set_state("failed"),
                   lambda: _said_by_peers(rec, peers_later),
                   lambda: _emergency_checkpoint(rec),
                   rec.expire_pending):
        try:
            record()
        except BaseException as ce:  # noqa: BLE001 - the original error matters more
            rec.log.error("recording the failure failed too: %s\n%s", ce, p.traceback)
    with contextlib.suppress(Exception):
        rec.store.flush(timeout=30)
    p.failure_recorded.set()


def _said_by_peers(rec: Failing, wait: bool) -> None:
    """Rank 0 lost contact and no peer had said why: wait a moment for a peer that failed
    in Python to write its error (after the error and the state are recorded), and
    record it."""
    if not wait or rec.dist is None:
        return
    peers: list[dict[str, Any]] = peer_errors(rec.store.run_dir, rec.inbox.opened_wall)
    if peers:
        rec._emit(Event(rec.step, "error", "critical",
                        "[rank 0] the rank that failed first: "
                        + "; ".join(p["message"] for p in peers),
                        {"rank_errors": peers}), logging.ERROR)


def _emergency_checkpoint(rec: Failing) -> None:
    """The weights the failure left, unless no optimizer step changed them since the run
    (or its resume) began: a checkpoint of untrained weights would be clutter, and a wrong
    point to resume from. Said in an event either way."""
    if rec.step > rec.start_step:
        rec._checkpoint("emergency")
        return
    since = f"its resume at step {rec.step}" if rec.start_step else "it began"
    rec._emit(Event(rec.step, "state", "info",
                    f"no emergency checkpoint: no optimizer step had changed the "
                    f"weights since {since}", {"checkpoint": "skipped"}))
