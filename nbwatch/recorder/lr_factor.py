"""The LR factor (`scale_lr`, an alert's cut) around the user's scheduler.

The factor is divided out after the optimizer step and put back once the scheduler has
stepped: closed-form schedules (recomputed from base_lrs) and chainable ones (×gamma of
the current LR) both yield factor × schedule, and the scheduler's own object and
state_dict stay untouched. A loop without a scheduler nbwatch knows does the same between
its steps: the factor is off after the optimizer's step and back on at its next pre-hook,
so whatever the loop does to `g["lr"]` in between (nanoGPT's `g["lr"] = get_lr(it)`, a
`*= gamma`, a scheduler it did not pass) gets the factor once. ReduceLROnPlateau, which the
loop steps at its evals with a metric, is timed as no scheduler, and its cuts are planned.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import controls as ctl

OVER = 3  # steps running with several scheduler steps each before it is said
PER_STEP = 3  # steps running, a scheduler step between each two, for a per-step scheduler


class LrFactor:
    """The factor of `control` on the optimizer's LRs, around the scheduler's steps."""

    def __init__(self, optimizer: torch.optim.Optimizer, scheduler: Any,
                 control: ctl.ControlState):
        # one that steps on a metric at the loop's evals: its steps are not the optimizer's
        self.on_metric = scheduler if ctl.on_metric(scheduler) else None
        self.opt, self.control = optimizer, control
        self.sched = None if self.on_metric is not None else scheduler
        # its step count at the last two ends of step: stepped before or after the log() of
        # an eval's step, its cut shows in the LR of the step after
        self._metric_ends: list[Any] = [None, None]
        self._sched_count: int | None = None  # the scheduler's step count at the post-hook
        self._sched_at_end: int | None = None  # … and at the last end of step
        self._once_each = 0  # optimizer steps running, each one scheduler step after the last
        self.explained = False  # a control moved the LR: the next step's change is planned
        self._over = 0  # steps running whose scheduler stepped more than once (end_step)

    def off(self) -> None:
        """The optimizer stepped: take the factor off, so the scheduler (or the loop, without
        one) moves the plain LR."""
        n = ctl.steps_taken(self.sched) if self.sched is not None else None
        self._count(n)
        c = self.control
        if c.lr_factor != 1.0 and not c.lr_raw:
            ctl.scale_lrs(self.opt, 1.0 / c.lr_factor)
            c.lr_raw = True

    def _count(self, n: int | None) -> None:
        """The scheduler's count `n` at an optimizer step's post-hook: whether it steps once
        a step (`behind`)."""
        once = n is not None and self._sched_count is not None and n - self._sched_count == 1
        self._once_each = self._once_each + 1 if once else 0
        self._sched_count = n

    def skipped(self) -> None:
        """A GradScaler's overflow skipped the optimizer's step (no post-hook), not the
        loop's scheduler: counted as a step, its scheduler's step stepped already where
        the loop steps it before `log()`."""
        n = ctl.steps_taken(self.sched) if self.sched is not None else None
        if n is not None and self._sched_count is not None and n - self._sched_count == 2:
            self._count(n - 1)
        else:
            self._count(n)

    def scheduler_pending(self) -> bool:
        """The optimizer stepped but the scheduler has not yet (it steps after log())."""
        if self.sched is None or self._sched_count is None:
            return False
        n = ctl.steps_taken(self.sched)
        return n is not None and n == self._sched_count

    def behind(self) -> bool:
        """A checkpoint taken now holds the scheduler one step behind the optimizer's: the
        loop steps it once after each optimizer step (seen at the last `PER_STEP` steps:
        not one stepped per epoch, whose steps come between epochs), and has not yet after
        this one."""
        return self._once_each >= PER_STEP and self.scheduler_pending()

    def on(self, only_if_scheduled: bool = False) -> None:
        """Put the factor back on (at the next step's start, or once the scheduler has
        stepped where `only_if_scheduled`; without a scheduler, only at the step's start:
        the loop may set the LR in between)."""
        c = self.control
        if not c.lr_raw:
            return
        if only_if_scheduled:
            if self.sched is None:
                return
            n = ctl.steps_taken(self.sched)
            if n is not None and n == self._sched_count:
                return  # the loop steps its scheduler after log(): the next step puts it on
        ctl.scale_lrs(self.opt, c.lr_factor)
        c.lr_raw = False

    def raw_until_next_step(self) -> bool:
        """Whether a new factor goes on at the next step's start rather than now (no
        scheduler nbwatch knows: the loop may set the LR before then)."""
        return self.sched is None

    def end_step(self) -> str | None:
        """The step's end: the scheduler's count, to tell whether it stepped by the next.
        Returns a warning, once, when the scheduler stepped more than once per optimizer
        step at `OVER` steps running (stepped per micro-batch under accumulation, or twice
        in the loop): its schedule then runs that much faster than the steps."""
        said = None
        if self.sched is not None:
            n, before = ctl.steps_taken(self.sched), self._sched_at_end
            if isinstance(n, int) and isinstance(before, int) and self._over >= 0:
                self._over = self._over + 1 if n - before > 1 else 0
                if self._over >= OVER:
                    self._over = -1  # said once a run
                    said = (f"the scheduler stepped {n - before} times since the last "
                            f"optimizer step, at {OVER} steps running: its schedule runs "
                            f"{n - before}× faster than the optimizer's steps (the LR is "
                            "recorded as it is). Call scheduler.step() once per optimizer "
                            "step: with gradient accumulation, after optimizer.step(), not "
                            "after each micro-batch")
            self._sched_at_end = n
        if self.on_metric is not None:
            self._metric_ends = [self._metric_ends[1], ctl.steps_taken(self.on_metric)]
        return said

    def planned(self) -> bool:
        """The LR of the step just ended moved as planned: the scheduler stepped since the
        last end of step, or a control scaled it (`explained`, cleared here)."""
        explained, self.explained = self.explained, False
        return self.scheduler_moved() or explained

    def scheduler_moved(self) -> bool:
        """The scheduler stepped since the last end of step (or cannot tell: no counter)."""
        if self.on_metric is not None:
            return ctl.steps_taken(self.on_metric) != self._metric_ends[0]
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
