"""Steering between steps: commands (buttons, the API, other processes through the
store; pause blocks here, stop ends the loop here), the DDP ranks' meeting that carries
rank 0's commands to all, and the actions of alerts."""

from __future__ import annotations

import time
from collections import deque

import numpy as np

from .. import controls as ctl
from ..distributed import merge_ranks
from ..records import Command, Event
from .spec import SAME_ON_EVERY_RANK


class Steering:
    """Part of `StepRecorder` (its state is set in `StepRecorder.__init__`)."""

    def boundary(self) -> bool:
        """Apply queued commands (pause blocks here); True once the run should stop."""
        self.apply_commands()
        return self.stopping

    def _poll_commands(self) -> list[Command]:
        cmds = self.commands.drain()
        now = time.monotonic()
        if now - self._store_poll > 0.25:  # other processes write commands into the store
            self._store_poll = now
            for cid, cmd in self.store.pending_commands(self._command_id):
                self.store.mark_taken(cid)
                self._command_id = cid
                cmds.append(cmd)
        return cmds

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
            cmds = self._poll_commands() if d.rank == 0 else []
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
        c, step = self.control, self.step
        if cmd.kind == "pause" and not c.paused:
            c.paused = True
            self._set_state("paused")
            msg = f"paused at step {step}"
        elif cmd.kind == "resume" and c.paused:
            c.paused = False
            self._set_state("running")
            msg = f"resumed at step {step}"
        elif cmd.kind == "stop":
            self.stopping = True
            msg = f"stop requested at step {step}"
        elif cmd.kind == "checkpoint":
            self._checkpoint("manual")
            return
        elif cmd.kind == "clip":
            c.clip = cmd.value
            msg = f"gradient clipping at {cmd.value:g}" if cmd.value else "gradient clipping off"
        elif cmd.kind == "scale_lr":
            before = ctl.lrs(self.opt)[0] * (c.lr_factor if c.lr_raw else 1.0)
            if not c.lr_raw and self._scheduler_pending():
                # the loop steps its scheduler after log(): let it step the plain schedule
                ctl.scale_lrs(self.opt, 1.0 / c.lr_factor)
                c.lr_raw = True
            if not c.lr_raw:  # else the factor goes on when the scheduler has stepped
                ctl.scale_lrs(self.opt, cmd.value)
            c.lr_factor *= cmd.value
            self.engine.explain_lr()
            msg = (f"LR scaled ×{cmd.value:g} (factor now {c.lr_factor:g}): "
                   f"{before:.3g} → {before * cmd.value:.3g}")
        elif cmd.kind == "rewind":
            return self._rewind(int(cmd.value or 100), cmd.source)
        elif cmd.kind == "skip":
            return self._skip(int(cmd.value or 0), cmd.source)
        else:  # pause while paused, resume while running: nothing to acknowledge
            return
        self._emit(Event(step, "action", "info", msg,
                         {"command": cmd.kind, "value": cmd.value, "source": cmd.source}))

    def _raise_alerts(self, alerts: list) -> None:
        """Record each alert, then carry out its actions (skip and clip are done already)."""
        for a in alerts:
            before = a.rule.params.get("batches_before")
            if before is not None:  # which batches: the step's and those just before it
                a.data["batches"] = self.batches_around(a.step, int(before))
            self._emit(a.event)
            if self.on_alert is not None:
                try:
                    self.on_alert(a.event)
                except Exception:  # a user's callback must not kill the run
                    self.log.exception("on_alert callback failed for %s", a.rule.name)
        for a in alerts:
            acts = a.rule.actions
            if self.dist is not None and a.rule.name not in SAME_ON_EVERY_RANK:
                # decided on rank 0 alone: applied by every rank at the next exchange
                for act in acts:
                    if act in ("pause", "checkpoint"):
                        self.commands.put(Command(act, None, f"alert:{a.rule.name}"))
                    elif act == "cut_lr":
                        f = float(a.rule.params.get("lr_factor", 0.5))
                        self.commands.put(Command("scale_lr", f, f"alert:{a.rule.name}"))
                continue
            if "cut_lr" in acts:
                f = float(a.rule.params.get("lr_factor", 0.5))
                self._apply(Command("scale_lr", f, f"alert:{a.rule.name}"))
            if "rewind" in acts:  # at the next step boundary, as a click would
                src = f"alert:{a.rule.name}"
                self.commands.put(Command("rewind", float(a.rule.params.get(
                    "rewind_steps", 100)), src))
                self.commands.put(Command("skip", float(a.rule.params.get(
                    "rewind_skip", 200)), src))
            if "clip" in acts and self.control.clip is not None:
                self._emit(Event(self.step, "action", "info",
                                 f"gradient clipping at {self.control.clip:g} "
                                 f"(alert {a.rule.name})",
                                 {"command": "clip", "value": self.control.clip,
                                  "source": f"alert:{a.rule.name}"}))
            if "checkpoint" in acts:
                self._checkpoint(f"emergency ({a.rule.name})")
            if "pause" in acts:
                self._apply(Command("pause", None, f"alert:{a.rule.name}"))
