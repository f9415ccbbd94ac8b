"""The LR factor (`scale_lr`, an alert's cut) around the user's scheduler.

The factor is divided out after the optimizer step and put back once the scheduler has
stepped: closed-form schedules (recomputed from base_lrs) and chainable ones (×gamma of
the current LR) both yield factor × schedule, and the scheduler's own object and
state_dict stay untouched. A loop without a scheduler that sets `g["lr"]` itself (nanoGPT's
`get_lr(it)`) is seen at the optimizer's pre-hook: a group's LR that is not the one left
there is the loop's new value, and the factor goes on it.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import controls as ctl


class LrFactor:
    """The factor of `control` on the optimizer's LRs, around the scheduler's steps."""

    def __init__(self, optimizer: torch.optim.Optimizer, scheduler: Any,
                 control: ctl.ControlState):
        self.opt, self.sched, self.control = optimizer, scheduler, control
        self._sched_count: int | None = None  # the scheduler's step count at the post-hook
        self._sched_at_end: int | None = None  # … and at the last end of step
        self.explained = False  # a control moved the LR: the next step's change is planned
        self._left: list[float] | None = None  # the LRs as the factor left them (no scheduler)

    def off(self) -> None:
        """The optimizer stepped: take the factor off, so the scheduler steps the plain
        schedule."""
        self._sched_count = ctl.steps_taken(self.sched) if self.sched is not None else None
        c = self.control
        if self.sched is not None and c.lr_factor != 1.0 and not c.lr_raw:
            ctl.scale_lrs(self.opt, 1.0 / c.lr_factor)
            c.lr_raw = True

    def scheduler_pending(self) -> bool:
        """The optimizer stepped but the scheduler has not yet (it steps after log())."""
        if self.sched is None or self._sched_count is None:
            return False
        n = ctl.steps_taken(self.sched)
        return n is not None and n == self._sched_count

    def on(self, only_if_scheduled: bool = False) -> None:
        """Put the factor back on (at the next step's start, or once the scheduler has
        stepped where `only_if_scheduled`)."""
        c = self.control
        if not c.lr_raw:
            if self.sched is None and not only_if_scheduled and c.lr_factor != 1.0:
                self._onto_loops_lrs()
            return
        if only_if_scheduled:
            n = ctl.steps_taken(self.sched)
            if n is not None and n == self._sched_count:
                return  # the loop steps its scheduler after log(): the next step puts it on
        ctl.scale_lrs(self.opt, c.lr_factor)
        c.lr_raw = False

    def remember(self) -> None:
        """The LRs now carry the factor (it was just applied, or a checkpoint loaded)."""
        self._left = ctl.lrs(self.opt) if self.sched is None else None

    def _onto_loops_lrs(self) -> None:
        """No scheduler: put the factor on each group whose LR the loop set since the
        factor was last applied (an LR the loop sets to exactly the value left there reads
        as unchanged)."""
        now = ctl.lrs(self.opt)
        left = self._left
        if left is not None and len(left) == len(now):
            f = self.control.lr_factor
            for g, was, lr in zip(self.opt.param_groups, left, now, strict=True):
                if lr != was:
                    ctl.scale_group_lr(g, f)
        self.remember()

    def end_step(self) -> None:
        """The step's end: the scheduler's count, to tell whether it stepped by the next."""
        if self.sched is not None:
            self._sched_at_end = ctl.steps_taken(self.sched)

    def planned(self) -> bool:
        """The LR of the step just ended moved as planned: the scheduler stepped since the
        last end of step, or a control scaled it (`explained`, cleared here)."""
        explained, self.explained = self.explained, False
        return self.scheduler_moved() or explained

    def scheduler_moved(self) -> bool:
        """The scheduler stepped since the last end of step (or cannot tell: no counter)."""
        if self.sched is None:
            return False
        n = ctl.steps_taken(self.sched)
        return n is None or n != self._sched_at_end

    def repair_after_overflow(self) -> bool:
        """No optimizer step, so no post-hook took the LR factor off before the loop's
        `scheduler.step()`: a closed-form schedule then dropped it; put it back. Returns
        whether the LR now reads what the next step will use."""
        c = self.control
        if self.sched is None or c.lr_factor == 1.0 or c.lr_raw:
            return True
        n = ctl.steps_taken(self.sched)
        if n is None or n == self._sched_at_end:
            return True  # the scheduler did not step (the runner skips it on an overflow)
        if not ctl.chains(self.sched):
            ctl.scale_lrs(self.opt, c.lr_factor)
        return False
