"""Steering between steps: commands (buttons, the API, other processes through the
store; pause blocks here, stop ends the loop here), the DDP ranks' meeting that carries
rank 0's commands to all, and the actions of alerts."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import controls as ctl
from ..controls import make_command
from ..distributed import merge_ranks
from ..records import Command, CommandKind, Event
from .outcomes import Applied, Expired, Outcome, Refused
from .rewind import do_rewind, do_skip, resolve_rewind


class Steering:
    """Part of `StepRecorder` (its state is set in `StepRecorder.__init__`)."""

    def boundary(self) -> bool:
        """Apply queued commands (pause blocks here); True once the run should stop."""
        self.apply_commands()
        return self.stopping

    def _poll_commands(self, force: bool = False) -> list[Command]:
        cmds = self.commands.drain()
        now = time.monotonic()
        if force or now - self._store_poll > 0.25:  # other processes write into the store
            self._store_poll = now
            for rid, wall, cmd in self.store.pending_commands(self._command_id):
                self.store.mark_taken(rid)
                self._command_id = rid
                if isinstance(cmd, str):  # unreadable: said, never guessed at
                    self._emit(Event(self.step, "command", "warning", f"refused: {cmd}",
                                     {"outcome": "refused", "reason": cmd, "row": rid}))
                elif wall < self._opened_wall:  # sent to an earlier run: never replayed
                    self._outcome(cmd, Expired(f"sent before this run opened (row {rid})"))
                else:
                    cmds.append(cmd)
        return cmds

    def take_final_stop(self) -> None:
        """The loop is over: a stop sent in its last moments still says how it ended (the
        loop may have seen `stopping` and returned); everything else expires."""
        if self.dist is not None:
            return  # the ranks' last meeting carries it (finish → _sync_ranks)
        cmds = self._poll_commands(force=True)
        for cmd in cmds:
            if cmd.kind is CommandKind.STOP:
                self._apply(cmd)
        for cmd in cmds:
            if cmd.kind is not CommandKind.STOP:
                self._outcome(cmd, Expired(f"the run ended at step {self.step} before "
                                           "taking it"))

    def expire_pending(self) -> None:
        """The run ends: every command not taken yet is expired, here and in the store, so
        that a resume never applies what was asked of this run."""
        for cmd in self._poll_commands(force=True):
            self._outcome(cmd, Expired(f"the run ended at step {self.step} before taking it"))

    def apply_commands(self, block: bool = True) -> None:
        """Apply queued commands; while paused (and `block`), wait here for more."""
        if self.dist is not None:
            d = self.dist
            if self.control.paused or (self.step > self._start_step and self.step % d.every == 0):
                self._sync_ranks()
            return
        for cmd in self._poll_commands():
            self._apply(cmd)
        if self.control.paused and block and not self.stopping and not self.spec.trial:
            self.flush_deferred()  # the page shows the step it is paused at
            self.store.flush()
        while self.control.paused and block and not self.stopping and not self.spec.trial:
            cmd = self.commands.get(timeout=0.1)
            for c in ([cmd] if cmd else []) + self._poll_commands():
                self._apply(c)

    def _sync_ranks(self, final: bool = False) -> None:
        """Meet the other ranks: figures to rank 0, rank 0's commands to all, applied here
        at this same step on every rank; while paused, meet again every 0.1 s."""
        d = self.dist
        assert d is not None
        self.flush_deferred()
        while True:
            # a rewind's checkpoint is chosen by rank 0, for every rank to reload the same
            cmds = [resolve_rewind(self, c) for c in self._poll_commands()] if d.rank == 0 else []
            t0 = time.perf_counter()
            rows, cmds = d.exchange(self._rank_rows, cmds)
            self._sync_s = time.perf_counter() - t0
            self._rank_rows = []
            if d.rank == 0:
                self._record_ranks(rows)
            for c in cmds:
                self._apply(c)
            if final or not self.control.paused or self.stopping:
                return
            if d.rank == 0:
                time.sleep(0.1)  # the others wait in the next exchange

    def _record_ranks(self, rows: list) -> None:
        for sc in merge_ranks(rows):
            self.store.put(sc)
            for r in range(self.dist.world):
                # busy time outside collectives: a fast rank's step also holds its wait
                # for the slow one (inside backward), so step time alone hides a straggler
                fwd = sc.values.get(f"rank{r}/time/forward")
                data = sc.values.get(f"rank{r}/time/data", 0.0)
                if fwd is not None:
                    self._rank_step_times.setdefault(r, deque(maxlen=50)).append(fwd + data)
        recent = {r: float(np.median(ts)) for r, ts in self._rank_step_times.items()
                  if len(ts) >= 20}
        self._raise_alerts(self.engine.observe("ranks", self.step, None,
                                               rank_step_times=recent))

    def _apply(self, cmd: Command) -> None:
        """Apply one command through the dispatch table; record its one outcome."""
        step = self.step  # where it was taken (a rewind moves the step)
        if self.stopping and cmd.kind is not CommandKind.STOP:
            outcome: Outcome = Refused(f"the run is stopping at step {self.step}")
        else:
            outcome = DISPATCH[cmd.kind](self, cmd)
        self._outcome(cmd, outcome, step)

    def _outcome(self, cmd: Command, outcome: Outcome, step: int | None = None) -> None:
        step = self.step if step is None else step
        data = {"command": cmd.kind.value, "id": cmd.id, "outcome": outcome.word,
                "source": cmd.source, **cmd.payload, **outcome.data}
        value = next(iter(cmd.payload.values()), None)  # the one number a button sends
        if value is not None:
            data.setdefault("value", value)
        if isinstance(outcome, Applied):
            if outcome.kind != "action":  # a checkpoint: its own event is the outcome
                data = {**data, **outcome.event_data}
            self._emit(Event(step, outcome.kind, outcome.severity, outcome.message, data))
        else:
            self._emit(Event(step, "command", "warning" if isinstance(
                outcome, Refused) else "info", f"{cmd.kind.value} {outcome.word}: "
                f"{outcome.reason}", {**data, "reason": outcome.reason}))

    # -- the dispatch table's handlers: each changes the run, or refuses and changes nothing
    def _do_pause(self, cmd: Command) -> Outcome:
        if self.control.paused:
            return Refused(f"the run is paused already (at step {self.step})")
        self.control.paused = True
        self._set_state("paused")
        return Applied(f"paused at step {self.step}")

    def _do_resume(self, cmd: Command) -> Outcome:
        if not self.control.paused:
            return Refused(f"the run is not paused (step {self.step})")
        self.control.paused = False
        self._set_state("running")
        return Applied(f"resumed at step {self.step}")

    def _do_stop(self, cmd: Command) -> Outcome:
        if self.stopping:
            return Refused(f"a stop was taken already (step {self.step})")
        self.stopping = True
        self._set_state("stopping")
        return Applied(f"stop requested at step {self.step}")

    def _do_checkpoint(self, cmd: Command) -> Outcome:
        ev = self._checkpoint("manual", announce=False)
        if ev is None:  # the framework saves its own way, or a trial writes nothing
            return Applied(f"manual checkpoint at step {self.step} asked of the framework")
        return Applied(ev.message, kind="checkpoint", event_data=ev.data)

    def _do_clip(self, cmd: Command) -> Outcome:
        v = cmd.payload["max_norm"]
        self.control.clip = v
        return Applied(f"gradient clipping at {v:g}" if v else "gradient clipping off")

    def _do_scale_lr(self, cmd: Command) -> Outcome:
        c, f = self.control, float(cmd.payload["factor"])
        before = ctl.lrs(self.opt)[0] * (c.lr_factor if c.lr_raw else 1.0)
        if not c.lr_raw and self.lr.scheduler_pending():
            # the loop steps its scheduler after log(): let it step the plain schedule
            ctl.scale_lrs(self.opt, 1.0 / c.lr_factor)
            c.lr_raw = True
        if not c.lr_raw:  # else the factor goes on when the scheduler has stepped
            ctl.scale_lrs(self.opt, f)
        c.lr_factor *= f
        self.engine.explain_lr()
        return Applied(f"LR scaled ×{f:g} (factor now {c.lr_factor:g}): "
                       f"{before:.3g} → {before * f:.3g}")

    def _raise_alerts(self, alerts: list) -> None:
        """Record each alert, then carry out its actions (skip and clip are done already)."""
        for a in alerts:
            before = a.rule.params.get("batches_before")
            if before is not None:  # which batches: the step's and those just before it
                a.data["batches"] = self.batch_ids.around(a.step, int(before))
            self._emit(a.event)
            if self.on_alert is not None:
                try:
                    self.on_alert(a.event)
                except Exception:  # a user's callback must not kill the run
                    self.log.exception("on_alert callback failed for %s", a.rule.name)
        for a in alerts:
            acts = a.rule.actions
            if self.dist is not None and not a.rule.same_on_every_rank:
                # decided on rank 0 alone: applied by every rank at the next exchange
                for act in acts:
                    if act in ("pause", "checkpoint"):
                        self.commands.put(make_command(act, f"alert:{a.rule.name}"))
                    elif act == "cut_lr":
                        f = float(a.rule.params.get("lr_factor", 0.5))
                        self.commands.put(make_command("scale_lr", f"alert:{a.rule.name}",
                                                       factor=f))
                continue
            src = f"alert:{a.rule.name}"
            if "cut_lr" in acts:
                f = float(a.rule.params.get("lr_factor", 0.5))
                self._apply(make_command("scale_lr", src, factor=f))
            if "rewind" in acts:  # at the next step boundary, as a click would
                self.commands.put(make_command(
                    "rewind", src, steps=int(a.rule.params.get("rewind_steps", 100)),
                    skip=int(a.rule.params.get("rewind_skip", 200))))
            if "clip" in acts and self.control.clip is not None:
                self._emit(Event(self.step, "action", "info",
                                 f"gradient clipping at {self.control.clip:g} "
                                 f"(alert {a.rule.name})",
                                 {"command": "clip", "value": self.control.clip,
                                  "source": f"alert:{a.rule.name}"}))
            if "checkpoint" in acts:
                self._checkpoint(f"emergency ({a.rule.name})")
            if "pause" in acts and not self.control.paused:
                self._apply(make_command("pause", src))


# The one dispatch table: every command kind, from every source (the API, the dashboard,
# attach through the store, an alert's action), is applied by its handler here.
DISPATCH: dict[CommandKind, Callable[[Any, Command], Outcome]] = {
    CommandKind.PAUSE: Steering._do_pause,
    CommandKind.RESUME: Steering._do_resume,
    CommandKind.STOP: Steering._do_stop,
    CommandKind.CHECKPOINT: Steering._do_checkpoint,
    CommandKind.CLIP: Steering._do_clip,
    CommandKind.SCALE_LR: Steering._do_scale_lr,
    CommandKind.REWIND: do_rewind,  # recorder/rewind.py
    CommandKind.SKIP: do_skip,
}
