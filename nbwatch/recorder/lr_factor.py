"""The LR factor (`scale_lr`, an alert's cut) around the user's scheduler.

The factor is divided out after the optimizer step and put back once the scheduler has
stepped: closed-form schedules (recomputed from base_lrs) and chainable ones (×gamma of
the current LR) both yield factor × schedule, and the scheduler's own object and
state_dict stay untouched.
"""

from __future__ import annotations

from .. import controls as ctl


class LrFactor:
    """Part of `StepRecorder` (its state is set in `StepRecorder.__init__`)."""

    def _lr_off(self) -> None:
        c = self.control
        if self.sched is not None and c.lr_factor != 1.0 and not c.lr_raw:
            ctl.scale_lrs(self.opt, 1.0 / c.lr_factor)
            c.lr_raw = True

    def _scheduler_pending(self) -> bool:
        """The optimizer stepped but the scheduler has not yet (it steps after log())."""
        if self.sched is None or self._sched_count is None:
            return False
        n = ctl.steps_taken(self.sched)
        return n is not None and n == self._sched_count

    def _lr_on(self, only_if_scheduled: bool = False) -> None:
        c = self.control
        if not c.lr_raw:
            return
        if only_if_scheduled:
            n = ctl.steps_taken(self.sched)
            if n is not None and n == self._sched_count:
                return  # the loop steps its scheduler after log(): the next step puts it on
        ctl.scale_lrs(self.opt, c.lr_factor)
        c.lr_raw = False

    def _repair_lr_after_overflow(self) -> bool:
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
