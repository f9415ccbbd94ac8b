"""The watch on a loop's own clipping, for the Monitors' optimizer hooks
(monitor/optimizer_hooks.py).

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

import functools
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class Watcher(Protocol):
    """What notes a loop's clips of its model's gradients (optimizer_hooks.OptimizerWatch)."""

    param_ids: set[int]
    owner: Any  # asked clips_are_the_loops()
    clips: ClipWatch

    def saw_clip(self, params: list, max_norm: float, total: torch.Tensor) -> None: ...


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
        unwatch_clips(None)  # the Monitors that watched were collected: torch's are back
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


def watch_clips(watch: Watcher) -> None:
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


def unwatch_clips(watch: Watcher | None) -> None:
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
        unwatch_clips(None)


def clips_watched() -> bool:
    """Whether torch's clipping is wrapped now (while a Monitor may record a loop's own)."""
    return bool(_WRAPPED)
