"""A Monitor's hooks on its optimizer: the pre- and post-hooks that hand each optimizer
step to the recorder (gradient figures are taken at the optimizer's own step, so a loop
of the user's needs no change), one Monitor per optimizer, the check that no second
optimizer steps the monitored model's parameters, and the watch on a loop's own clipping.

Framework wrappers that only look like optimizers (accelerate's `AcceleratedOptimizer`
subclasses `torch.optim.Optimizer` but never runs its `__init__`, so it has no hooks)
are looked through: the hooks go on the optimizer they wrap, whose `step()` runs once per
real update (not on accumulation micro-batches), and the scheduler behind accelerate's
`AcceleratedScheduler` is the one nbwatch reads and checkpoints.

A loop that clips its gradients itself (`torch.nn.utils.clip_grad_norm_` before
`optimizer.step()`, `accelerator.clip_grad_norm_`) hands the optimizer's pre-hook
clipped gradients. While a Monitor may record such a loop, torch's clipping is watched:
`torch.nn.utils.clip_grad._clip_grads_with_norm_` (what `clip_grad_norm_` and
`clip_grad_norm` scale with, looked up at each call, so however the user imported them)
and its public name `torch.nn.utils.clip_grads_with_norm_` are wrapped to note each
call's norm and limit, from which the recorder recovers the norms before the clip (one
factor scales every gradient a call covers). The wrap calls torch's own function, does
nothing for parameters no Monitor watches, and is undone when the last such Monitor's run
closes (or its hooks go to another Monitor).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..lifecycle import RunState

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
    def recorder_for_step(self, open_loop: bool = True) -> StepRecorder | None:
        """The recorder this optimizer step goes to (with `open_loop`, a loop's run opens
        at its first), or None (the Monitor's run has ended, or none is open)."""
    def clips_are_the_loops(self) -> bool:
        """Whether a clip of the model's gradients now is the loop's own."""


def _stepped(optimizer: Any) -> set[int]:
    return {id(p) for g in optimizer.param_groups for p in g["params"]}


def _busy(what: str, other: Owner) -> str:
    return (f"{what} by a running Monitor ({other.name!r}, {other.state} at step {other.step});"
            " stop() and wait() it first (it trains on: `%nbwatch RUN_DIR` shows its dashboard "
            "again, and nbwatch.attach(RUN_DIR).stop() stops it where no variable names it)")


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
        _watch_clips(self)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        _unwatch_clips(self)

    def open_run(self) -> None:
        """A run opens: refuse a second optimizer on the model from now on."""
        self._global_hook = register_optimizer_step_pre_hook(self._foreign_hook)

    def close_run(self) -> None:
        """The run closed: other optimizers are free, and its loop's clips no longer this
        Monitor's to note (torch's clipping is torch's again)."""
        if self._global_hook is not None:
            self._global_hook.remove()
            self._global_hook = None
        _unwatch_clips(self)

    def _pre_hook(self, optimizer: Any, args: Any, kwargs: Any) -> tuple | None:
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


class ClipWatch:
    """The clips of a loop's own since its last optimizer step (its state, and the rules
    that make them usable or not)."""

    def __init__(self) -> None:
        self.clips: list[ClipCall] = []
        self.partial = False  # one ran before a later backward of the same step
        self.marks: tuple = ()  # the gradients as the last of those clips left them

    def saw(self, step: int, params: list, max_norm: float, total: torch.Tensor) -> None:
        """A clip at `step` just scaled these gradients by min(1, max_norm / (total +
        1e-6)) (torch's rule): note it for the next optimizer step."""
        if self.clips:
            if self.clips[0].step != step:
                self.clips = []  # an earlier step's (that optimizer step was skipped)
            elif not _unchanged(self.marks) or len(self.clips) >= _MAX_CLIPS:
                # the gradients changed since the last clip of this step: a backward (a clip
                # on each accumulation micro-batch); what that clip cut cannot be recovered
                self.clips, self.partial = [], True
        self.clips.append(ClipCall(step, tuple(map(id, params)), float(max_norm), total))
        self.marks = _marks(params)

    def take(self, step: int) -> tuple[list[ClipCall], str | None]:
        """The clips of the optimizer step now taken after `step`, and what makes them
        unusable, if anything: "partial" (one ran before a later backward of the step: the
        norms are those before the step's last clip), "changed" (the gradients changed
        after the last clip: none can be recovered)."""
        clips, partial = self.clips, self.partial
        if not clips and not partial:
            return clips, None
        self.clips, self.partial = [], False
        if clips and clips[0].step != step:
            clips = []  # an earlier step's, whose optimizer step was skipped
        if clips and not _unchanged(self.marks):
            return [], "changed"
        return clips, "partial" if partial else None

    def clear(self) -> None:
        self.clips, self.partial, self.marks = [], False, ()


@dataclass(frozen=True)
class ClipCall:
    """One clip of the loop's own: which parameters (their ids, in the call's order), its
    limit, and the norm it scaled by (a device tensor, copied with the step's figures)."""

    step: int  # the Monitor's step when it clipped (the optimizer step after it is step+1)
    ids: tuple[int, ...]
    max_norm: float
    total: torch.Tensor


def _marks(params: list) -> tuple:
    """Weak references to two of the clipped gradients (the first and the last there
    are), with their versions: a backward or any in-place change after the clip moves
    them."""
    first = next(p.grad for p in params if p.grad is not None)
    last = next(p.grad for p in reversed(params) if p.grad is not None)
    return tuple((weakref.ref(g), g._version) for g in ((first,) if last is first
                                                        else (first, last)))


def _unchanged(marks: tuple) -> bool:
    for ref, version in marks:
        g = ref()
        if g is None or g._version != version:
            return False
    return True


# -- the wrap of torch's clipping (see the module's docstring) ----------------------------
_WATCHERS: weakref.WeakSet = weakref.WeakSet()  # OptimizerWatches whose loop's clips are noted
_WRAPPED: list[tuple[Any, str, Any, Any]] = []  # (module, name, torch's, ours) while wrapped
_LOCK = threading.Lock()
_MAX_CLIPS = 64  # clips noted for one optimizer step (a loop that clips and never steps)


def _observe(params: list, max_norm: Any, total: Any) -> None:
    """After a clip: hand it to the Monitor watching these parameters, if any."""
    if not _WATCHERS:
        _unwatch_clips(None)  # the Monitors that watched were collected: torch's are back
        return
    if not params or not isinstance(total, torch.Tensor):
        return
    if hasattr(total, "full_tensor"):  # FSDP2: the full gradients' norm (every rank clips)
        total = total.full_tensor()
    first = next((p for p in params if p.grad is not None), None)
    if first is None:
        return
    for watch in list(_WATCHERS):
        if id(first) in watch.param_ids:
            if watch.owner.clips_are_the_loops():
                watch.saw_clip(params, max_norm, total)
            return


def _params(parameters: Any) -> list:
    if isinstance(parameters, torch.Tensor):
        return [parameters]
    return list(parameters)  # a generator is consumed once, here


def _wrap_with_norm(torch_fn: Any) -> Any:
    @functools.wraps(torch_fn)
    def clip_grads_with_norm_(parameters: Any, max_norm: float, total_norm: torch.Tensor,
                              foreach: bool | None = None) -> None:
        params = _params(parameters)
        torch_fn(params, max_norm, total_norm, foreach)
        _observe(params, max_norm, total_norm)

    clip_grads_with_norm_.__nbwatch_wraps__ = torch_fn  # type: ignore[attr-defined]
    return clip_grads_with_norm_


def _wrap_clip_norm(torch_fn: Any) -> Any:
    """For a torch whose clip_grad_norm_ scales the gradients itself (before 2.6)."""
    @functools.wraps(torch_fn)
    def clip_grad_norm_(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> Any:
        params = _params(parameters)
        total = torch_fn(params, max_norm, *args, **kwargs)
        _observe(params, max_norm, total)
        return total

    clip_grad_norm_.__nbwatch_wraps__ = torch_fn  # type: ignore[attr-defined]
    return clip_grad_norm_


def _clips_through(module: Any, name: str) -> bool:
    """Whether this torch's `clip_grad_norm_` scales the gradients through `module.name`
    (the function nbwatch then watches): asked of torch itself, by one clip of a one-element
    gradient with that name spied on, not read from its code."""
    real = getattr(module, name)
    called: list[bool] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        called.append(True)
        return real(*args, **kwargs)

    p = torch.zeros(1, requires_grad=True)
    p.grad = torch.ones(1)
    setattr(module, name, spy)
    try:
        module.clip_grad_norm_([p], 1.0)
    finally:
        setattr(module, name, real)
    return bool(called)


def _targets() -> list[tuple[Any, str, Any]]:
    """(module, name, wrapper factory) of the functions to wrap in this torch."""
    import torch.nn.utils as nn_utils
    import torch.nn.utils.clip_grad as clip_grad

    inner = getattr(clip_grad, "_clip_grads_with_norm_", None)
    if inner is not None and _clips_through(clip_grad, "_clip_grads_with_norm_"):
        out = [(clip_grad, "_clip_grads_with_norm_", _wrap_with_norm)]
        if getattr(nn_utils, "clip_grads_with_norm_", None) is inner:
            out.append((nn_utils, "clip_grads_with_norm_", _wrap_with_norm))
        return out
    return [(clip_grad, "clip_grad_norm_", _wrap_clip_norm),
            (nn_utils, "clip_grad_norm_", _wrap_clip_norm)]


def _watch_clips(watch: OptimizerWatch) -> None:
    with _LOCK:
        _WATCHERS.add(watch)
        weakref.finalize(watch, _collected)  # a Monitor dropped unused: it watches no more
        if _WRAPPED:
            return
        made: dict[int, Any] = {}  # one wrapper per torch function, whatever its names
        for module, name, factory in _targets():
            fn = getattr(module, name)
            ours = made.setdefault(id(fn), factory(fn))
            _WRAPPED.append((module, name, fn, ours))
            setattr(module, name, ours)


def _unwatch_clips(watch: OptimizerWatch | None) -> None:
    """This Monitor's loop clips no more; the last one gone, torch's functions are back
    (a name someone else wrapped after us is left to them)."""
    with _LOCK:
        if watch is not None:
            _WATCHERS.discard(watch)
            watch.clips.clear()
        if next(iter(_WATCHERS), None) is not None or not _WRAPPED:  # a live one (a
            return  # collected Monitor's reference may not have left the set yet)
        for module, name, fn, ours in _WRAPPED:
            if getattr(module, name, None) is ours:
                setattr(module, name, fn)
        _WRAPPED.clear()


def _collected() -> None:
    """A watching Monitor was garbage-collected: the last one gone, torch's functions are
    back. Never waits for the lock (the collector may run while this thread holds it; the
    next clip then finds no watcher and undoes the wrap)."""
    if _LOCK.acquire(blocking=False):
        _LOCK.release()
        _unwatch_clips(None)


def clips_watched() -> bool:
    """Whether torch's clipping is wrapped now (while a Monitor may record a loop's own)."""
    return bool(_WRAPPED)
