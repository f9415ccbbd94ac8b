"""Steering between steps: commands (buttons, the API, other processes through the
store; pause blocks here, stop ends the loop here), the DDP ranks' meeting that carries
rank 0's commands to all, and the actions of alerts."""

from __future__ import annotations

import logging
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from .. import controls as ctl
from ..controls import make_command
from ..distributed import meet_gap, merge_ranks
from ..probes.data import NOTED, mask_notes
from ..records import Command, CommandKind, Event
from .lr_factor import LrFactor
from .outcomes import Applied, Expired, Outcome, Refused
from .rewind import Rewinding, do_rewind, do_skip, resolve_rewind
from .spec import RunSpec
from .state import Inbox, InFlight, RankMeeting

if TYPE_CHECKING:
    from ..alerts.engine import AlertEngine
    from .batches import BatchIds
    from .own_time import OwnTime


class Steered(Rewinding, Protocol):
    """What steering reads and moves of the run it steers (a `StepRecorder`); a command
    may rewind it."""

    own: OwnTime
    start_step: int
    spec: RunSpec
    engine: AlertEngine
    commands: ctl.CommandQueue
    control: ctl.ControlState
    lr: LrFactor
    batch_ids: BatchIds
    inbox: Inbox
    ranks: RankMeeting
    flight: InFlight
    on_alert: Callable[[Event], Any] | None
    paused_tick: Callable[[], None] | None
    log: logging.Logger

    def _emit(self, ev: Event, level: int | None = None) -> None: ...
    def _set_state(self, state: str) -> None: ...
    def _checkpoint(self, reason: str, announce: bool = True) -> Event | None: ...


def poll_commands(rec: Steered, force: bool = False) -> list[Command]:
    """Commands queued in this process, and (every 0.25 s, or when `force`) those other
    processes wrote into the store; each taken once."""
    cmds = rec.commands.drain()
    now = time.monotonic()
    box = rec.inbox
    if force or now - box.last_poll > 0.25:  # other processes write into the store
        box.last_poll = now
        for rid, wall, cmd in rec.store.pending_commands(box.last_id, fresh=force):
            rec.store.mark_taken(rid)
            box.last_id = rid
            if isinstance(cmd, str):  # unreadable: said, never guessed at
                rec._emit(Event(rec.step, "command", "warning", f"refused: {cmd}",
                                {"outcome": "refused", "reason": cmd, "row": rid}))
            elif wall < box.opened_wall:  # sent to an earlier run: never replayed
                record_outcome(rec, cmd, Expired(f"sent before this run opened (row {rid})"))
            else:
                cmds.append(cmd)
    return cmds


def take_final_stop(rec: Steered) -> None:
    """The loop is over: a stop sent in its last moments still says how it ended (the
    loop may have seen `stopping` and returned), and a checkpoint asked while its last
    step was recorded (the poll of other processes' commands runs every 0.25 s) is taken,
    of that last step (then the final one, of the same step, is not written twice);
    everything else expires."""
    if rec.dist is not None:
        return  # the ranks' last meeting carries it (finish → sync_ranks)
    cmds = poll_commands(rec, force=True)
    taken = (CommandKind.STOP, CommandKind.CHECKPOINT)
    for cmd in cmds:
        if cmd.kind in taken:
            apply(rec, cmd)
    for cmd in cmds:
        if cmd.kind not in taken:
            record_outcome(rec, cmd, Expired(f"the run ended at step {rec.step} before "
                                             "taking it"))


def expire_pending(rec: Steered) -> None:
    """The run ends: every command not taken yet is expired, here and in the store, so
    that a resume never applies what was asked of this run."""
    left = rec.commands.close()  # a command sent from now on is refused at the call
    for cmd in left + poll_commands(rec, force=True):
        record_outcome(rec, cmd, Expired(f"the run ended at step {rec.step} before "
                                         "taking it"))


def apply_commands(rec: Steered, block: bool = True) -> None:
    """Apply queued commands; while paused (and `block`), wait here for more."""
    p = rec.progress
    if rec.dist is not None:
        d = rec.dist
        if p.paused or d.due(rec.step, rec.start_step):
            sync_ranks(rec)
        return
    with rec.own:  # the poll is watching's cost; what a command does is the user's
        cmds = poll_commands(rec)
        if cmds:  # a command acts after every step before it is recorded
            rec.flush_deferred()
    for cmd in cmds:
        apply(rec, cmd)
    if p.paused and block and not rec.spec.trial:
        rec.flush_deferred()  # the page shows the step it is paused at
        rec.store.flush()
    while p.paused and block and not rec.spec.trial:
        got = rec.commands.get(timeout=0.1)
        for one in ([got] if got else []) + poll_commands(rec):
            apply(rec, one)


def sync_ranks(rec: Steered, final: bool = False) -> None:
    """Meet the other ranks: figures to rank 0, rank 0's commands to all, applied here at
    this same step on every rank; while paused, meet again every 0.1 s."""
    d = rec.dist
    assert d is not None
    if final:
        rec.flush_deferred()
    # otherwise the rows of the steps read so far (each rank reads step N at the end of
    # step N + 1): the exchange waits for no copy of the device
    rk = rec.ranks
    while True:
        # a rewind's checkpoint is chosen by rank 0, for every rank to reload the same
        cmds = ([resolve_rewind(rec, c) for c in checked_only(rec, poll_commands(rec))]
                if d.rank == 0 else [])
        t0 = time.perf_counter()
        gap = meet_gap(rk.rows, d.every, d.gap) if d.rank == 0 else 0
        rows, cmds = d.exchange(rk.rows, cmds, rec.step, final, gap)
        rk.sync_s = time.perf_counter() - t0
        rk.rows = []
        if cmds and not final:  # (the same on every rank) a command acts after every step
            # before it is recorded: the steps still under way are read, and their rows meet
            with rec.own:
                rec.flush_deferred()
            t0 = time.perf_counter()
            more, _ = d.exchange(rk.rows, [], rec.step, final)
            rk.sync_s += time.perf_counter() - t0
            rk.rows = []
            rows = [a + b for a, b in zip(rows, more)]  # per rank
        if d.rank == 0:
            record_ranks(rec, rows)
        for c in cmds:
            apply(rec, c)
        rk.met_at = time.perf_counter()
        if final or not rec.progress.paused:
            return
        rec.flush_deferred()  # paused: the page shows the step it is paused at
        if d.rank == 0:
            if rec.paused_tick is not None:  # a SIGTERM's stop, taken at the next meeting
                rec.paused_tick()
            time.sleep(0.1)  # the others wait in the next exchange


def record_ranks(rec: Steered, rows: list) -> None:
    """Rank 0: every rank's figures of the steps since the last exchange, what their
    masks' counts say (once a job), and the straggler rule on their recent step times."""
    times, d = rec.ranks.step_times, rec.dist
    assert d is not None  # ranks meet only under torchrun
    # the ranks' mask counts (no column): said once a job, here, whichever rank's batch
    counts = sorted(((step, r, {k: figs.pop(k) for k in NOTED if k in figs})
                     for r, of_rank in enumerate(rows) for step, figs in of_rank),
                    key=lambda c: c[:2])
    for step, r, got in counts:
        for note in mask_notes(got, rec.flight.masks_said, f"rank {r}'s batch: "):
            rec._emit(Event(step, "probe", "warning", note))
    for sc in merge_ranks(rows):
        rec.store.put(sc)
        for r in range(d.world):
            # busy time outside collectives: a fast rank's step also holds its wait for
            # the slow one (inside backward), so step time alone hides a straggler
            # (`time/busy`, from the step's start to its last forward's end; start()'s:
            # its data wait and forward)
            busy = sc.values.get(f"rank{r}/time/busy")
            fwd = sc.values.get(f"rank{r}/time/forward")
            if busy is None and fwd is not None:
                busy = fwd + sc.values.get(f"rank{r}/time/data", 0.0)
            if busy is not None:
                times.setdefault(r, deque(maxlen=50)).append(busy)
        if sc.values.get("rank0/time/step") is not None:  # a straggler's share of a step
            times.setdefault(-1, deque(maxlen=50)).append(sc.values["rank0/time/step"])
    recent = {r: float(np.median(ts)) for r, ts in times.items() if len(ts) >= 20}
    step = recent.pop(-1, 0.0)
    raise_alerts(rec, rec.engine.observe("ranks", rec.step, None, rank_step_times=recent,
                                         step_time=step))


def checked_only(rec: Steered, cmds: list[Command]) -> list[Command]:
    """The commands whose arguments check (`controls.checked`); each other one refused now,
    with its outcome (before rank 0 resolves a rewind and sends it to every rank)."""
    out = []
    for cmd in cmds:
        try:
            out.append(ctl.checked(cmd))
        except (TypeError, ValueError) as e:
            record_outcome(rec, cmd, Refused(str(e)))
    return out


def apply(rec: Steered, cmd: Command) -> None:
    """Apply one command through the dispatch table; record its one outcome."""
    step = rec.step  # where it was taken (a rewind moves the step)
    try:
        cmd = ctl.checked(cmd)
    except (TypeError, ValueError) as e:  # written into the store by hand: said, not done
        record_outcome(rec, cmd, Refused(str(e)), step)
        return
    if rec.progress.stopping and cmd.kind is not CommandKind.STOP:
        outcome: Outcome = Refused(f"the run is stopping at step {rec.step}")
    else:
        outcome = DISPATCH[cmd.kind](rec, cmd)
    record_outcome(rec, cmd, outcome, step)


def record_outcome(rec: Steered, cmd: Command, outcome: Outcome,
                   step: int | None = None) -> None:
    """The command's one outcome event, naming its id: applied, refused or expired (once:
    a command two ends of the run both find, a failure's and the close's, is said once)."""
    if cmd.id in rec.inbox.ended:
        return
    rec.inbox.ended.add(cmd.id)
    step = rec.step if step is None else step
    data = {"command": cmd.kind.value, "id": cmd.id, "outcome": outcome.word,
            "source": cmd.source, **cmd.payload, **outcome.data}
    value = next(iter(cmd.payload.values()), None)  # the one number a button sends
    if value is not None:
        data.setdefault("value", value)
    if isinstance(outcome, Applied):
        if outcome.kind != "action":  # a checkpoint: its own event is the outcome
            data = {**data, **outcome.event_data}
        rec._emit(Event(step, outcome.kind, outcome.severity, outcome.message, data))
    else:
        rec._emit(Event(step, "command", "warning" if isinstance(outcome, Refused)
                        else "info", f"{cmd.kind.value} {outcome.word}: {outcome.reason}",
                        {**data, "reason": outcome.reason}))


# -- the dispatch table's handlers: each changes the run, or refuses and changes nothing --
def do_pause(rec: Steered, cmd: Command) -> Outcome:
    if rec.progress.paused:
        return Refused(f"the run is paused already (at step {rec.step})")
    rec._set_state("paused")
    if cmd.source.startswith("alert:") and (rec.dist is None or rec.dist.rank == 0):
        say_alert_pause(rec, cmd.source.removeprefix("alert:"))
    return Applied(f"paused at step {rec.step}")


def say_alert_pause(rec: Steered, rule: str) -> None:
    """An alert paused the run: no one asked, and a script (or a cell in `wait()` without
    a dashboard) would wait for ever without a word. Say it on stderr, and how to go on."""
    where = str(rec.store.run_dir)
    print(f"nbwatch: alert {rule} paused run {rec.store.run_dir.name!r} at step {rec.step}; "
          f"it waits for a resume or a stop: mon.resume() / mon.stop() (or the dashboard's "
          f"buttons), or from a shell `nbwatch resume {where}` (`nbwatch stop ...`), or "
          f"from Python nbwatch.attach({where!r}).resume(). "
          f"Alerts that should not pause: Monitor(alerts={{{rule!r}: "
          f"{{'actions': [...]}}}}) without 'pause'", file=sys.stderr, flush=True)


def do_resume(rec: Steered, cmd: Command) -> Outcome:
    if not rec.progress.paused:
        return Refused(f"the run is not paused (step {rec.step})")
    rec._set_state("running")
    rec.flight.t_boundary = time.perf_counter()  # the pause is no step's time
    return Applied(f"resumed at step {rec.step}")


def do_stop(rec: Steered, cmd: Command) -> Outcome:
    if rec.progress.stopping:
        return Refused(f"a stop was taken already (step {rec.step})")
    if cmd.source == "exit":
        # the process is ending: `stopped` is recorded already (exiting.py), and the stop
        # checkpoint may not finish before the kernel's SIGTERM: writing `stopping` now
        # would leave the folder reading `stopping`, then `stale`
        rec.progress.move("stopping")
    else:
        rec._set_state("stopping")
    return Applied(f"stop requested at step {rec.step}")


def do_checkpoint(rec: Steered, cmd: Command) -> Outcome:
    ev = rec._checkpoint("manual", announce=False)
    if ev is None:  # the framework saves its own way, or a trial writes nothing
        return Applied(f"manual checkpoint at step {rec.step} asked of the framework")
    if ev.data.get("already"):  # one file, one checkpoint event
        return Applied(ev.message)
    return Applied(ev.message, kind="checkpoint", event_data=ev.data)


def do_clip(rec: Steered, cmd: Command) -> Outcome:
    v = cmd.payload["max_norm"]
    rec.control.clip = v
    return Applied(f"gradient clipping at {v:g}" if v else "gradient clipping off")


def do_scale_lr(rec: Steered, cmd: Command) -> Outcome:
    c, f = rec.control, float(cmd.payload["factor"])
    before = [lr * (c.lr_factor if c.lr_raw else 1.0) for lr in ctl.lrs(rec.opt)]
    if not c.lr_raw and (rec.lr.scheduler_pending() or rec.lr.raw_until_next_step()):
        # the loop steps its scheduler after log(), or sets the LR itself before its next
        # step: let it move the plain LR; the factor goes on at the next pre-hook
        ctl.scale_lrs(rec.opt, 1.0 / c.lr_factor)
        c.lr_raw = True
    if not c.lr_raw:  # else the factor goes on when the scheduler has stepped
        ctl.scale_lrs(rec.opt, f)
    c.lr_factor *= f
    rec.lr.explained = True  # the next step's record says the change was asked for
    seen = list(dict.fromkeys(before))  # each LR once; layer-wise decay: the first few
    moved = ", ".join(f"{b:.3g} → {b * f:.3g}" for b in seen[:4]) + (
        f" and {len(seen) - 4} more" if len(seen) > 4 else "")
    groups = f"{len(before)} param groups: " if len(seen) > 1 else ""
    return Applied(f"LR scaled ×{f:g} (factor now {c.lr_factor:g}): {groups}{moved}")


def raise_alerts(rec: Steered, alerts: list) -> None:
    """Record each alert, then carry out its actions (skip and clip are done already)."""
    for a in alerts:
        before = a.rule.params.get("batches_before")
        if before is not None:  # which batches: the step's and those just before it
            a.data["batches"] = rec.batch_ids.around(a.step, int(before))
        rec._emit(a.event)
        if rec.on_alert is not None:
            try:
                rec.on_alert(a.event)
            except Exception as e:  # a user's callback must not kill the run
                rec.log.exception("on_alert callback failed for %s", a.rule.name)
                rec._emit(Event(rec.step, "callback", "warning",
                                f"on_alert callback failed for {a.rule.name}: "
                                f"{type(e).__name__}: {e} (the run goes on)",
                                {"rule": a.rule.name, "error": repr(e)}))
    if rec.progress.ended:  # a batch recorded as the run ends: its alerts said, nothing more done
        return
    for a in alerts:
        acts = a.rule.actions
        src = f"alert:{a.rule.name}"
        if rec.dist is not None and not a.rule.same_on_every_rank:
            # decided on rank 0 alone: applied by every rank at the next exchange
            for act in acts:
                if act in ("pause", "checkpoint"):
                    rec.commands.put(make_command(act, src))
                elif act == "cut_lr":
                    f = float(a.rule.params.get("lr_factor", 0.5))
                    rec.commands.put(make_command("scale_lr", src, factor=f))
            continue
        if "cut_lr" in acts:
            f = float(a.rule.params.get("lr_factor", 0.5))
            apply(rec, make_command("scale_lr", src, factor=f))
        if "rewind" in acts:  # at the next step boundary, as a click would
            rec.commands.put(make_command(
                "rewind", src, steps=int(a.rule.params.get("rewind_steps", 100)),
                skip=int(a.rule.params.get("rewind_skip", 200))))
        if "clip" in acts and rec.control.clip is not None:
            rec._emit(Event(rec.step, "action", "info",
                            f"gradient clipping at {rec.control.clip:g} (alert "
                            f"{a.rule.name})", {"command": "clip", "value": rec.control.clip,
                                                "source": src}))
        if "checkpoint" in acts:
            rec._checkpoint(f"emergency ({a.rule.name})")
        if "pause" in acts and not rec.progress.paused:
            apply(rec, make_command("pause", src))


# The one dispatch table: every command kind, from every source (the API, the dashboard,
# attach through the store, an alert's action), is applied by its handler here.
DISPATCH: dict[CommandKind, Callable[[Any, Command], Outcome]] = {
    CommandKind.PAUSE: do_pause,
    CommandKind.RESUME: do_resume,
    CommandKind.STOP: do_stop,
    CommandKind.CHECKPOINT: do_checkpoint,
    CommandKind.CLIP: do_clip,
    CommandKind.SCALE_LR: do_scale_lr,
    CommandKind.REWIND: do_rewind,  # recorder/rewind.py
    CommandKind.SKIP: do_skip,
}
