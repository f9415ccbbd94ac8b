"""The optimizer step, measured from its own hooks: gradient norms and one host copy
(measure), the "grads" rules that may skip or clip it (clip decision), a weights snapshot
before the update and update ratios after it.

    optimizer.step()  pre-hook   LR factor on · grad norms · ONE host copy · "grads"
                                 rules (skip, clip) · clip · weights snapshot
                      (update)
                      post-hook  update ratios · LR factor off for the scheduler

A loop that clipped the gradients itself before `optimizer.step()` hands the pre-hook
clipped ones: `grad_norm/global` and `grad_norm/<layer>` are the norms before that clip
(own_clips.py), `grad_norm/clipped` the norm after it (and after nbwatch's own clip).
"""

from __future__ import annotations

import math
import time
from typing import Any, Protocol

import torch

from .. import controls as ctl
from ..probes import weights as wprobe
from ..probes.grads import Layers, clip_, layer_norms, param_grad_norms
from ..records import Event
from .lr_factor import LrFactor
from .own_clips import OwnClips
from .own_time import OwnTime, counted
from .spec import RunSpec
from .state import InFlight, Taking


class Measuring(Protocol):
    """What the optimizer's hooks read and move of their run (a `StepRecorder`)."""

    own: OwnTime
    step: int
    start_step: int
    ended: bool
    spec: RunSpec
    opt: Any  # torch.optim.Optimizer
    scaler: Any
    layers: Layers
    grad_names: list[str]
    skip_nonfinite: bool
    engine: Any  # AlertEngine
    control: Any  # ControlState
    lr: LrFactor
    own_clips: OwnClips
    flight: InFlight
    framework_clip: float | None
    train_logits: Any  # probes.logits.TrainLogits

    def _emit(self, ev: Event, level: int | None = None) -> None: ...
    def complete(self, step: int, values: dict[str, float], alerts: list,
                 overflow: bool = False, lr_planned: bool | None = None) -> None: ...
    def flush_deferred(self) -> None: ...


def overflowed(rec: Measuring) -> bool:
    """Whether the GradScaler lowered its scale since the last end of step (it skipped
    the optimizer); True when that cannot be told (its first steps)."""
    scale = getattr(rec.scaler, "_scale", None)
    ref = rec.flight.scale_ref
    if not isinstance(scale, torch.Tensor) or ref is None:
        return True
    return bool((scale < ref.to(scale.device)).item())


@counted
def pre_step(rec: Measuring, explicit: bool = True, clips: list | None = None,
             clip_note: str | None = None, found_inf: torch.Tensor | None = None) -> None:
    """The step's gradient figures, one host copy, the rules that can still skip or clip
    this step, and a weights snapshot on histogram steps. Called by the optimizer's
    pre-hook (`explicit=False`), or by a framework adapter at the moment its framework
    has the gradients but has not clipped them yet. `clips`: the loop's own clips of
    this step (`optimizer_hooks.ClipCall`), whose factors are divided out; `clip_note`:
    why those of this step cannot all be ("partial", "changed"); `found_inf`: a GradScaler's
    verdict on this step's gradients, unscaled by the caller (> 0: it skips the step)."""
    fl = rec.flight
    if rec.ended:  # a loop that goes on after its stop: nothing more is measured
        return
    rec.train_logits.hold()  # an own loop's last training forward is this step's batch
    if fl.stepped:
        raise RuntimeError(
            "optimizer.step() ran twice without mon.log() in between: call "
            "mon.log(loss=...) once after every optimizer.step()"
        )
    if not explicit and fl.taking is not None and fl.taking.explicit:
        return  # the adapter measured this step already, before its framework clipped
    t0 = time.perf_counter()
    rec.lr.on()
    step = rec.step + 1
    norms, layer_of, grads = param_grad_norms(rec.layers)
    clips = clips or []
    values, host_norms = copy_to_host(rec, norms, [c.total for c in clips], found_inf)
    # the LR this step uses: read after the copy, which records a step that waited for it
    # (a GPU's), whose alert may cut the LR
    lrs = ctl.lrs(rec.opt)
    totals = [values.pop(f"_clip{i}") for i in range(len(clips))]
    unscale = 1.0 / values.pop("_grad_scale", 1.0)
    if values.pop("_found_inf", 0.0):  # the fused optimizer skips this step itself
        values.update({"lr": lrs[0], "amp/overflow": 1.0})
        fl.taking = Taking(step, values, [], True, None, t0, time.perf_counter(),
                           explicit=explicit)
        return
    host = [n * unscale for n in host_norms]
    if clips or clip_note:
        total, per_layer, current = rec.own_clips.before(step, host, layer_of, clips,
                                                        totals, clip_note)
        said, rec.own_clips.said[:] = list(rec.own_clips.said), []
        for ev in said:
            rec._emit(ev)
    else:
        total, per_layer = layer_norms(host, layer_of, len(rec.layers))
        current = total
    values.update(zip(rec.grad_names, [total, *per_layer]))
    values["lr"] = lrs[0]
    for i, lr in enumerate(lrs[1:], start=1):
        values[f"lr/group{i}"] = lr

    alerts, skip = decide(rec, step, values)
    clip_or_skip(rec, grads, values, skip, current)
    first = rec.step == rec.start_step
    hist = due(rec.spec.hist_every, step, first) and not skip
    every = rec.spec.update_every
    ratios = due(rec.spec.hist_every if every is None else every, step, first) and not skip
    before = wprobe.snapshot(rec.layers) if ratios else None
    fl.taking = Taking(step, values, alerts, skip, before, t0, time.perf_counter(),
                       explicit=explicit, hist=hist)


def due(every: int, step: int, first: bool) -> bool:
    """A figure taken every `every` steps (0: never) is due at `step` (and at a run's or a
    resumed run's first step)."""
    return every > 0 and (step % every == 0 or first)


def copy_to_host(rec: Measuring, norms: list[torch.Tensor],
                 clip_totals: list[torch.Tensor] | None = None,
                 found_inf: torch.Tensor | None = None
                 ) -> tuple[dict[str, float], list[float]]:
    """The step's one device→host copy: the previous step's deferred figures (recorded
    here), the runner's staged loss, the norms the loop's own clips computed
    (`_clip<i>`), a fused optimizer's AMP flags and the gradient norms. Returns this
    step's named figures and the norms, still scaled."""
    fl = rec.flight
    dev = rec.layers.params[0].device
    names: list[str] = []
    parts: list[torch.Tensor] = []
    deferred, fl.deferred = fl.deferred, None
    if deferred is not None:  # the previous step's loss: one copy for both steps
        names += deferred.names
        parts += deferred.parts
    if fl.staged is not None:  # this step's loss, from the runner
        names += fl.staged[0]
        parts += fl.staged[1]
        fl.staged = None
    for i, t in enumerate(clip_totals or ()):
        names.append(f"_clip{i}")
        parts.append(t.detach() if t.dim() == 0 else t.detach().reshape(()))
    # A GradScaler calls a fused optimizer's step even on an overflow, with `found_inf`
    # set, and (unless unscale_ ran) with still-scaled gradients and their scale
    scale = getattr(rec.opt, "grad_scale", None)
    if found_inf is None:
        found_inf = getattr(rec.opt, "found_inf", None)
    if isinstance(scale, torch.Tensor):
        names.append("_grad_scale")
        parts.append(scale.reshape(()).float())
    if isinstance(found_inf, torch.Tensor):
        names.append("_found_inf")
        parts.append(found_inf.reshape(()).float())
    parts += norms
    host = to_host(parts, dev) if parts else []  # the sync
    k, nd = len(names), len(deferred.names) if deferred is not None else 0
    if deferred is not None:
        deferred.values.update(zip(deferred.names, host[:nd]))
        rec.complete(deferred.step, deferred.values, deferred.alerts,
                     lr_planned=deferred.lr_planned)
    return dict(zip(names[nd:], host[nd:k])), host[k:]


def decide(rec: Measuring, step: int, values: dict[str, float]) -> tuple[list, bool]:
    """The "grads" rules on this step's figures: its alerts, and whether to skip it.
    A clip rule that fired lowers the clip limit (never raises it)."""
    if rec.flight.pending and rec.engine.short_history():
        rec.flush_deferred()  # the rules' first steps: they see every step before this one
    alerts = rec.engine.observe("grads", step, values)
    nonfinite = not (math.isfinite(values["grad_norm/global"])
                     and math.isfinite(values.get("loss/train", 0.0)))
    # Skipping depends on the figures, not on the alert's episode: a second non-finite
    # step in a row is skipped too.
    skip = (nonfinite and rec.skip_nonfinite) or any(
        "skip_step" in a.rule.actions for a in alerts)
    for a in alerts:
        if "clip" in a.rule.actions and not skip:
            limit = float(a.rule.params.get("max_norm", 1.0))
            if rec.control.clip is None or rec.control.clip > limit:
                rec.control.clip = limit
    return alerts, skip


def clip_or_skip(rec: Measuring, grads: list[torch.Tensor], values: dict[str, float],
                 skip: bool, g: float) -> None:
    """Clip the gradients, whose norm is `g` now (after the loop's own clip, if any), and
    note the framework's own clipping; or drop them."""
    clip = rec.control.clip
    applied = clip and not skip and math.isfinite(g)
    after = clip_(grads, g, clip) if applied else g
    if rec.framework_clip and not skip and math.isfinite(after):
        after = after * min(1.0, rec.framework_clip / (after + 1e-6))
    values["grad_norm/clipped"] = after
    if skip:
        # A parameter without a gradient is left alone by every torch optimizer, its
        # state included: the step changes nothing.
        for group in rec.opt.param_groups:
            for p in group["params"]:
                p.grad = None
        values["skipped"] = 1.0


@counted
def post_step(rec: Measuring) -> None:
    """Optimizer post-hook: update ratios, and the LR factor off for the scheduler."""
    t = rec.flight.taking
    if t is None:
        return
    if t.before is not None:  # on device: copied with the step's other figures
        t.ratios = wprobe.update_ratios(rec.layers, t.before)
        t.before = None
    rec.lr.off()
    t.t_post = time.perf_counter()
    rec.flight.stepped = True


def to_host(parts: list[torch.Tensor], device: torch.device | None = None) -> list[float]:
    """One device→host copy of 0-dim tensors: one stack (dtypes promoted), one tolist."""
    if len(parts) == 1:
        return [parts[0].item()]
    try:
        return torch.stack(parts).tolist()
    except RuntimeError:  # on several devices (a model split across GPUs)
        dev = device or parts[-1].device
        return torch.stack([t.to(dev) for t in parts]).tolist()
