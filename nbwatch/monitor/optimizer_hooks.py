"""A Monitor's hooks on its optimizer: the pre- and post-hooks that hand each optimizer
step to the recorder (gradient figures are taken at the optimizer's own step, so a loop
of the user's needs no change), one Monitor per optimizer, the check that no second
optimizer steps the monitored model's parameters, and the watch on a loop's own clipping.

Framework wrappers that only look like optimizers (accelerate's `AcceleratedOptimizer`
subclasses `torch.optim.Optimizer` but never runs its `__init__`, so it has no hooks)
are looked through: the hooks go on the optimizer they wrap, whose `step()` runs once per
real update (not on accumulation micro-batches), and the scheduler behind accelerate's
`AcceleratedScheduler` is the one nbwatch reads and checkpoints.
A loop that clips its gradients itself is watched by monitor/clip_watch.py.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..lifecycle import RunState
from ..ownership import own_loop_here
from .accumulation import BackwardCount
from .clip_watch import ClipWatch, unwatch_clips, watch_clips

if TYPE_CHECKING:
    from ..recorder import StepRecorder

# The Monitor whose hooks are on each optimizer: one at a time (a cell run twice makes a
# second Monitor on the same optimizer; the first one's hooks must go).
_OWNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer → ref(watch)


def hooked_optimizer(optimizer: Any) -> Any:
    """The optimizer that takes the hooks: `optimizer`, or the one a wrapper that never ran
    `Optimizer.__init__` holds as `.optimizer` (accelerate's AcceleratedOptimizer)."""
    for _ in range(4):
        inner = getattr(optimizer, "optimizer", None)
        if hasattr(optimizer, "_optimizer_step_pre_hooks") or not isinstance(
                inner, torch.optim.Optimizer) or inner is optimizer:
            break
        optimizer = inner
    return optimizer


def inner_scheduler(scheduler: Any) -> Any:
    """The LR scheduler behind a framework's wrapper (accelerate's AcceleratedScheduler
    keeps it as `.scheduler`, and steps it only on real updates)."""
    for _ in range(4):
        inner = getattr(scheduler, "scheduler", None)
        if scheduler is None or isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler) \
                or inner is None or inner is scheduler or not callable(
                    getattr(inner, "step", None)):
            break
        scheduler = inner
    return scheduler


class Owner(Protocol):
    """What the hooks ask of the run they serve (a Monitor's `RunSession`)."""

    @property
    def name(self) -> str: ...
    @property
    def step(self) -> int: ...
    @property
    def state(self) -> RunState: ...
    @property
    def running(self) -> bool: ...
    mode: str | None  # "loop": a loop of one's own (`log()`): ownership.own_loop_here
    framework: str | None
    loop_thread: threading.Thread | None  # where an own loop's log() runs
    def recorder_for_step(self, open_loop: bool = True) -> StepRecorder | None:
        """The recorder this optimizer step goes to (with `open_loop`, a loop's run opens
        at its first), or None (the Monitor's run has ended, or none is open)."""
    def clips_are_the_loops(self) -> bool:
        """Whether a clip of the model's gradients now is the loop's own."""


def _stepped(optimizer: Any) -> set[int]:
    return {id(p) for g in optimizer.param_groups for p in g["params"]}


def _busy(what: str, other: Owner) -> str:
    head = f"{what} by a running Monitor ({other.name!r}, {other.state} at step {other.step});"
    if own_loop_here(other):
        # a loop of one's own on this very thread, which is here, not in the loop: a cell
        # that raised or was interrupted mid-loop left its run open, and nothing trains it
        return head + (" its loop of your own, on this thread, left it open (the cell ended "
                       "mid-loop: an error or Ctrl-C) and nothing trains it: stop() and wait() "
                       "it first (a `with nbwatch.Monitor(...) as mon:` around the loop closes "
                       "its run however the cell ends)")
    return head + (" stop() and wait() it first (it trains on: `%nbwatch RUN_DIR` shows its "
                   "dashboard again, and nbwatch.attach(RUN_DIR).stop() stops it where no "
                   "variable names it)")


class OptimizerWatch:
    """A Monitor's hooks on its optimizer, one part of it that owns its state: the pre- and
    post-hooks that hand each step to the recorder, the optimizer taken from another Monitor
    that held it, the check that no second optimizer steps the model while a run is open,
    and the loop's own clips since the last step."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                 owner: Owner):
        self.optimizer, self.owner = optimizer, owner
        self.param_ids = {id(p) for p in model.parameters()}
        self.clips = ClipWatch()  # the loop's own clips since the last step
        self._foreign_ok: weakref.WeakSet = weakref.WeakSet()
        self._inside_step: int | None = None  # the thread inside optimizer.step, if any
        self._hooks: list[Any] = []
        self._global_hook: Any = None  # the check on other optimizers, while a run is open
        # backward passes since the loop's last log(): its micro-batches (accumulation.py)
        self.backwards: BackwardCount | None = None
        self.take()

    def take(self) -> None:
        """Put the hooks on the optimizer, taken from the Monitor that holds them (an ended
        one, or one created on it since, which must not be running), if not already. Refused
        while another Monitor's run trains this model's weights with another optimizer (a
        cell that makes the optimizer, run again: two threads would train one model)."""
        optimizer = self.optimizer
        ref = _OWNERS.get(optimizer)
        previous = ref() if ref is not None else None
        if previous is not None and previous is not self and previous.owner.running:
            raise RuntimeError(_busy("this optimizer is watched", previous.owner))
        for other in [r() for r in list(_OWNERS.values())]:
            if (other is not None and other is not self and other.owner.running
                    and not _stepped(other.optimizer).isdisjoint(_stepped(optimizer))):
                raise RuntimeError(_busy("this optimizer's weights are trained, with another "
                                         "optimizer,", other.owner))
        if previous is self and self._hooks:
            return
        if previous is not None and previous is not self:
            previous.remove()
        _OWNERS[optimizer] = weakref.ref(self)  # never strong: the Monitor holds the
        # optimizer, so a strong value would keep both (and the model) alive for ever
        self._hooks = [optimizer.register_step_pre_hook(self._pre_hook),
                       optimizer.register_step_post_hook(self._post_hook)]
        watch_clips(self)
        mine = [p for g in optimizer.param_groups for p in g["params"]
                if id(p) in self.param_ids]
        me = weakref.ref(self)  # no cycle: the Monitor is freed as soon as it is dropped
        self.backwards = BackwardCount(
            mine, lambda: getattr(me(), "_inside_step", None) == threading.get_ident())

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        unwatch_clips(self)
        if self.backwards is not None:
            self.backwards.remove()
            self.backwards = None

    def open_run(self) -> None:
        """A run opens: refuse a second optimizer on the model from now on."""
        self._global_hook = register_optimizer_step_pre_hook(self._foreign_hook)

    def close_run(self) -> None:
        """The run closed: other optimizers are free, and its loop's clips no longer this
        Monitor's to note (torch's clipping is torch's again)."""
        if self._global_hook is not None:
            self._global_hook.remove()
            self._global_hook = None
        unwatch_clips(self)

    def _pre_hook(self, optimizer: Any, args: Any, kwargs: Any) -> tuple | None:
        if self.backwards is not None:
            self.backwards.stepped()
        self._inside_step = threading.get_ident()
        rec = self.owner.recorder_for_step()
        if rec is None:
            return None  # this Monitor's run has ended: later steps are not recorded
        closure = args[1] if len(args) > 1 else kwargs.get("closure")
        if callable(closure) and rec.hook_measures:
            # LBFGS and the like: the gradients are made inside step(), by the closure
            rec.snapshot_early()
            return _measured_after(closure, args, kwargs, lambda: self._measure(rec))
        self._measure(rec)
        return None

    def _measure(self, rec: StepRecorder) -> None:
        clips, note = self.clips.take(self.owner.step) if rec.hook_measures else ([], None)
        rec.pre_step(explicit=False, clips=clips, clip_note=note)  # (or hands a skip over)

    def _post_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._inside_step = None
        rec = self.owner.recorder_for_step(open_loop=False)
        if rec is not None:
            rec.post_step()

    def _foreign_hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Global pre-hook while a run is open: refuse a second optimizer on the model."""
        if optimizer is self.optimizer or optimizer in self._foreign_ok:
            return
        if self._inside_step == threading.get_ident():
            return  # a wrapper's inner optimizer (ZeroRedundancyOptimizer, Lookahead…)
        shared = sum(p.numel() for g in optimizer.param_groups for p in g["params"]
                     if id(p) in self.param_ids)
        if shared:
            raise RuntimeError(_second_optimizer(optimizer, self.optimizer, shared))
        self._foreign_ok.add(optimizer)

    def inner_hint(self) -> str:
        """Where no step of the Monitor's optimizer ran: the one it holds over the same
        weights, which a loop may step itself (SAM's `first_step`/`second_step` step its
        `base_optimizer`), named as the one to pass; else nothing."""
        for name, inner in vars(self.optimizer).items():
            if isinstance(inner, torch.optim.Optimizer) and inner is not self.optimizer and any(
                    id(p) in self.param_ids for g in inner.param_groups for p in g["params"]):
                outer = type(self.optimizer).__name__
                return (f"; {outer}.step() never ran: where the loop steps the optimizer it "
                        f"holds, .{name} ({type(inner).__name__}), itself, pass that one: "
                        f"nbwatch.Monitor(model, optimizer.{name}, ...)")
        return ""

    def saw_clip(self, params: list, max_norm: float, total: torch.Tensor) -> None:
        """A clip of this model's gradients just scaled them: noted for the next step (on
        the run's clock of nbwatch's own time, once it is open)."""
        rec = self.owner.recorder_for_step(open_loop=False)
        with rec.own if rec is not None else contextlib.nullcontext():
            self.clips.saw(self.owner.step, params, max_norm, total)


def _second_optimizer(other: Any, watched: Any, shared: int) -> str:
    """Why `other`, stepping the monitored model's weights, is refused, and what to do: a
    replacement of the Monitor's optimizer (one re-created mid-run) said as such."""
    held = {id(p) for g in other.param_groups for p in g["params"]}
    head = (f"a second optimizer ({type(other).__name__}, over {shared:,} of the monitored "
            f"model's weights) steps parameters of the monitored model, but the Monitor has "
            f"another ({type(watched).__name__}); one Monitor watches one optimizer: ")
    if all(id(p) in held for g in watched.param_groups for p in g["params"]):
        return head + (
            "this one holds every weight of the Monitor's, as an optimizer re-created "
            "mid-run does, and the Monitor would go on watching the old one. Change the LR "
            "in place instead (for g in optimizer.param_groups: g['lr'] = ...; or "
            "mon.scale_lr(...)), or end this run and give the new optimizer a new Monitor")
    return head + (
        "put all parameter groups in the optimizer you pass to nbwatch.Monitor; where the "
        "groups need two optimizers (Muon and AdamW, a sparse one for the embeddings), pass "
        "one that steps both (docs/loops.md, 'Two optimizers on one model'); where each "
        "network has its own optimizer (a GAN's generator and discriminator), give each "
        "network its own Monitor: Monitor(G, opt_g, run_dir=.../G) and "
        "Monitor(D, opt_d, run_dir=.../D)")


def _measured_after(closure: Callable[[], Any], args: tuple, kwargs: dict,
                    measure: Callable[[], None]) -> tuple[tuple, dict]:
    """`step(closure)`'s arguments with the closure wrapped to `measure` the step once its
    first call has made the gradients: those at the weights the step starts from, as a
    loop without a closure hands them over (LBFGS calls it again as it searches). A clip
    or a skip then acts on those gradients: zeroed, they end LBFGS's step at once."""
    measured = False

    def closure_then_measure() -> Any:
        nonlocal measured
        loss = closure()
        if not measured:
            measured = True
            measure()
        return loss

    if len(args) > 1:
        return (args[0], closure_then_measure, *args[2:]), kwargs
    return args, {**kwargs, "closure": closure_then_measure}
