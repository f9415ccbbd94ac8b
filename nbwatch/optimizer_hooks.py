"""A Monitor's hooks on its optimizer: the pre- and post-hooks that hand each optimizer
step to the recorder (gradient figures are taken at the optimizer's own step, so a loop
of the user's needs no change), one Monitor per optimizer, and the check that no second
optimizer steps the monitored model's parameters."""

from __future__ import annotations

import threading
import weakref
from typing import Any

# The Monitor whose hooks are on each optimizer: one at a time (a cell run twice makes a
# second Monitor on the same optimizer; the first one's hooks must go).
_OWNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class OptimizerHooks:
    """Part of `Monitor`: `_hook_optimizer()` runs in its `__init__`."""

    def _hook_optimizer(self) -> None:
        """Put this Monitor's hooks on its optimizer, taking it from an ended Monitor."""
        model, optimizer = self.model, self.optimizer
        self._param_ids = {id(p) for p in model.parameters()}
        self._foreign_ok: weakref.WeakSet = weakref.WeakSet()
        previous = _OWNERS.get(optimizer)
        if previous is not None and previous is not self:
            if previous.running:
                raise RuntimeError(
                    f"this optimizer is watched by a running Monitor ({previous.name!r}, "
                    f"{previous.state} at step {previous.step}); stop() and wait() it first")
            previous._remove_hooks()
        _OWNERS[optimizer] = self
        self._inside_step: int | None = None  # the thread inside optimizer.step, if any
        self._hooks = [optimizer.register_step_pre_hook(self._pre_hook),
                       optimizer.register_step_post_hook(self._post_hook)]
        self._global_hook: Any = None  # the check on other optimizers, while a run is open

    def _pre_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._inside_step = threading.get_ident()
        rec = self._recorder
        if rec is None:
            if self._mode is not None:
                return  # this Monitor's run has ended: later steps are not recorded
            rec = self._open_loop()
        if rec.hook_measures:
            rec.pre_step(explicit=False)

    def _post_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._inside_step = None
        if self._recorder is not None:
            self._recorder.post_step()

    def _remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _foreign_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Global pre-hook while a run is open: refuse a second optimizer on the model."""
        if optimizer is self.optimizer or optimizer in self._foreign_ok:
            return
        if self._inside_step == threading.get_ident():
            return  # a wrapper's inner optimizer (ZeroRedundancyOptimizer, Lookahead…)
        if any(id(p) in self._param_ids for g in optimizer.param_groups for p in g["params"]):
            raise RuntimeError(
                f"a second optimizer ({type(optimizer).__name__}) steps parameters of the "
                f"monitored model, but the Monitor was given {type(self.optimizer).__name__}; "
                "nbwatch measures and steers one optimizer: put all parameter groups in the "
                "optimizer you pass to nbwatch.Monitor"
            )
        self._foreign_ok.add(optimizer)

