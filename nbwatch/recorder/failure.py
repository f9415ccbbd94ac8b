"""A run's failure, recorded: the error and the state first (under torchrun the launcher
may end the process any moment now), then what helps after it: the rank that failed
first, the emergency checkpoint. Each part on its own: a dead store must not cost the
checkpoint, nor the reverse. A signal handler that interrupts the recording thread reads
`Progress.failing_in` and `error_said` (monitor/exiting.py). A stop asked and said before
it was taken (a SIGTERM's, `stopped_by`) does not outlive a failure that came first: the
run reads `failed`, the stop kept as context (`stop_asked`)."""

from __future__ import annotations

import contextlib
import logging
import threading
import traceback
from typing import TYPE_CHECKING, Any, Protocol

from ..distributed import lost_peer, peer_errors
from ..records import Event

if TYPE_CHECKING:
    from ..checkpoint import Checkpointer
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
    ckpt: Checkpointer
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
    # what the failure says, before a SIGTERM's handler (exiting.py) may see it and say it
    # first: a killed rank says nothing itself, so its process is looked for, a moment at most
    dead = (rec.dist.dead_ranks(wait=1.0)
            if rec.dist is not None and not rec.ended and lost_peer(e) else [])
    msg, data, peers_later = _what_failed(rec, e, dead)
    p.error_message = msg
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

    def say() -> None:
        if p.error_said:  # a SIGTERM's handler said it, interrupting this (exiting.py)
            return
        p.error_said = True
        rec._emit(Event(rec.step, "error", "critical", msg, {"traceback": p.traceback, **data}),
                  logging.ERROR)

    for record in (rec.record_stepped, rec.flush_deferred, say,
                   lambda: rec._set_state("failed"), lambda: unsay_stop(rec.store, p),
                   lambda: _said_by_peers(rec, peers_later),
                   lambda: _emergency_checkpoint(rec, lost_peer(e)),
                   rec.expire_pending):
        try:
            record()
        except BaseException as ce:  # noqa: BLE001 - the original error matters more
            rec.log.error("recording the failure failed too: %s\n%s", ce, p.traceback)
    with contextlib.suppress(Exception):
        rec.store.flush(timeout=30)
    p.failure_recorded.set()


def _what_failed(rec: Failing, e: BaseException, dead: list[int]
                 ) -> tuple[str, dict[str, Any], bool]:
    """The failure's message, its event's data, and whether a peer's own error may reach
    the folder after it; `dead`: the ranks whose process ended."""
    msg = f"{type(e).__name__}: {e}"
    data: dict[str, Any] = {}
    peers_later = False
    if rec.dist is not None:
        if lost_peer(e):
            who = (f"rank {' and '.join(map(str, dead))} died (its process ended)" if dead
                   else "lost contact with another rank (it died or hangs)")
            msg = f"{who}, so this rank stops: {str(e).splitlines()[0][:300]}"
            if dead:
                data["dead_ranks"] = dead
            if rec.dist.rank == 0:  # which rank failed, and why, where it could say
                peers = peer_errors(rec.store.run_dir, rec.inbox.opened_wall, wait=0)
                peers_later = not peers
                if peers:
                    msg = ("another rank failed, so this rank stops: "
                           + "; ".join(x["message"] for x in peers))
                    data = {"rank_errors": peers}
        msg = f"[rank {rec.dist.rank}/{rec.dist.world}] {msg}"
    said = rec.progress.stop_said
    if said:  # what was asked, not how the run ended
        msg += (f" (while stopping: {said})" if rec.progress.stopping
                else f" (a stop had been asked, not taken yet: {said})")
        data["stop_asked"] = said
    return msg, data, peers_later


def unsay_stop(store: RunStore | NullStore, p: Progress) -> None:
    """A failure ends a run whose stop was said before it was taken (`stopped_by`, set at
    once by `monitor/ending.record_stop_reason`): that reason goes, kept as `stop_asked`."""
    if p.stop_said:
        store.set_meta("stopped_by", None)
        store.set_meta("stop_asked", p.stop_said)


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


def _emergency_checkpoint(rec: Failing, lost: bool) -> None:
    """The weights the failure left, unless no optimizer step changed them since the run
    (or its resume) began: a checkpoint of untrained weights would be clutter, and a wrong
    point to resume from; or a sharded one where a rank cannot take part (`lost`: this
    rank's failure was losing a peer, which the save says at once). Said in an event
    either way."""
    if rec.step > rec.start_step:
        left = (rec.dist.not_failed() if rec.dist is not None and rec.ckpt.every_rank
                and not lost else [])
        if not left:
            rec._checkpoint("emergency")
            return
        # a sharded checkpoint is a collective: with ranks still training (blocked in one
        # of theirs until this one's process ends), it would wait out the group's timeout
        newest = rec.ckpt.steps()[-1][0] if rec.ckpt.steps() else None
        since = (f"resume=True continues from step {newest}" if newest is not None
                 else "there is no earlier checkpoint")
        rec._emit(Event(rec.step, "checkpoint", "critical",
                        f"emergency checkpoint at step {rec.step} not written: a sharded "
                        f"(FSDP2) checkpoint needs every rank at once, and "
                        f"{', '.join(left)} cannot take part; {since}",
                        {"reason": "emergency", "failed": True, "ranks": left}),
                  logging.ERROR)
        return
    since = f"its resume at step {rec.step}" if rec.start_step else "it began"
    rec._emit(Event(rec.step, "state", "info",
                    f"no emergency checkpoint: no optimizer step had changed the "
                    f"weights since {since}", {"checkpoint": "skipped"}))
