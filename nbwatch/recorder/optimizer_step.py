"""The optimizer step, measured from its own hooks, without reading the device: the
gradient norms, the clip and the skip of a non-finite step are computed and applied on
the device; the figures are copied at the step's end (step_end.py, host_copy.py) and read
at a later boundary, where the "grads" rules see them (`read_grads`).

    optimizer.step()  pre-hook   LR factor on · grad norms (one _foreach_norm) · the clip
                                 and the skip (clip_skip.py: device tensors, one
                                 _foreach_mul_, found_inf or zeroed gradients) · weights
                                 snapshot on update-ratio steps
                      (update)
                      post-hook  update ratios (on the device) · LR factor off
    a later boundary  read_grads per-layer norms, the loop's own clips divided out, the
                                 "grads" rules (their clip lowers the limit from the next
                                 step)

The skip of a non-finite step: an optimizer that takes `found_inf` (torch's fused Adam,
AdamW, SGD and Adagrad, and any step a GradScaler drives) skips it in its own kernel, the
weights and the optimizer's state untouched. Any other (the foreach default of
`torch.optim.AdamW(model.parameters())` on CUDA) gets the step's gradients zeroed on the
device instead: the weights stay finite, but its momentum and weight decay still move them
once, as a zero-gradient step would. Knowing which one the step needs would take a read
of the device before the update, which stalls the GPU.

A loop that clipped the gradients itself before `optimizer.step()` hands the pre-hook
clipped ones: `grad_norm/global` and `grad_norm/<layer>` are the norms before that clip
(own_clips.py), `grad_norm/clipped` the norm after it (and after nbwatch's own clip).
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from .. import controls as ctl
from ..probes import weights as wprobe
from ..probes.grads import Layers, grad_names, layer_norms, param_grad_norms
from ..records import Event
from . import host_copy
from .clip_skip import (
    COEF,
    FLAG_DEFAULTS,
    FOUND_INF,
    KEPT,
    SCALE,
    act,
    act_on_host,
    arm_skip,
    by_device,
    drop_found_inf,
)
from .lr_factor import LrFactor
from .own_clips import OwnClips
from .own_time import OwnTime, counted
from .spec import Progress, RunSpec
from .state import InFlight, Taking

if TYPE_CHECKING:
    from ..alerts.engine import AlertEngine
    from ..controls import ControlState
    from ..probes.logits import TrainLogits
    from .layer_changes import LayerWatch

class Measuring(Protocol):
    """What the optimizer's hooks read and move of their run (a `StepRecorder`)."""

    own: OwnTime
    step: int
    start_step: int
    progress: Progress
    spec: RunSpec
    opt: torch.optim.Optimizer
    scaler: Any
    layers: Layers
    grad_names: list[str]
    skip_nonfinite: bool
    engine: AlertEngine
    control: ControlState
    lr: LrFactor
    own_clips: OwnClips
    flight: InFlight
    framework_clip: float | None
    train_logits: TrainLogits
    hook_measures: bool
    layer_watch: LayerWatch

    def _emit(self, ev: Event, level: int | None = None) -> None: ...
    def relayer(self, step: int) -> None: ...


def overflowed(rec: Measuring) -> bool:
    """Whether the GradScaler lowered its scale since the last end of step (it skipped
    the optimizer); True when that cannot be told (its first steps). A read of the device:
    only asked when the optimizer did not step."""
    from .host_copy import values

    scale = getattr(rec.scaler, "_scale", None)
    ref = rec.flight.scale_ref
    if not isinstance(scale, torch.Tensor) or ref is None:
        return True
    return values((scale < ref.to(scale.device)).float().reshape(1))[0] > 0


@counted
def pre_step(rec: Measuring, explicit: bool = True, clips: list | None = None,
             clip_note: str | None = None, found_inf: torch.Tensor | None = None) -> None:
    """The step's gradient figures, its clip and its skip, all on the device, and a
    weights snapshot on update-ratio steps. Called by the optimizer's pre-hook
    (`explicit=False`), or by a framework adapter at the moment its framework has the
    gradients but has not clipped them yet. `clips`: the loop's own clips of this step
    (`clip_watch.ClipCall`), whose factors are divided out when read; `clip_note`:
    why those of this step cannot all be ("partial", "changed"); `found_inf`: a
    GradScaler's verdict on this step's gradients, unscaled by the caller (> 0: it skips
    the step)."""
    fl = rec.flight
    if rec.progress.ended:  # a loop that goes on after its stop: nothing more is measured
        return
    if not explicit:  # the optimizer's own pre-hook
        if fl.taking is not None and fl.taking.explicit:
            # the adapter measured this step already, before its framework clipped; a fused
            # optimizer's skip is handed over now (a GradScaler sets its own found_inf last)
            if fl.taking.skip is not None:
                arm_skip(rec, fl.taking.skip)
            return
        if not (rec.hook_measures or fl.measure_in_hook):
            return  # the adapter measures at its framework's moment
        fl.measure_in_hook = False
    rec.train_logits.hold()  # an own loop's last training forward is this step's batch
    if fl.stepped:
        raise RuntimeError(
            "optimizer.step() ran twice without mon.log() in between: call "
            "mon.log(loss=...) once after every optimizer.step()"
        )
    t0 = time.perf_counter()
    rec.lr.on()
    step = rec.step + 1
    rec.relayer(step)
    lrs = ctl.lrs(rec.opt)
    host = {"lr": lrs[0], **{f"lr/group{i}": lr for i, lr in enumerate(lrs[1:], start=1)}}
    norms, layer_of, grads = param_grad_norms(rec.layers)
    # a layer frozen in place: gone from the next step
    rec.layer_watch.note_gradless(rec.layers, len(rec.layers.params) - len(grads))
    staged_names, staged = fl.staged if fl.staged is not None else ([], [])
    fl.staged = None
    clips = clips or []
    groups: dict[str, list[torch.Tensor]] = {"staged": list(staged)}
    zeroing, fused_skip = False, None
    limits: dict[str, tuple[float, float]] = {}
    present = (tuple(i for i, p in enumerate(rec.layers.params) if p.grad is not None)
               if clips else None)
    read: dict[str, list[float]] | None = None
    if norms:
        if fl.limits is None:  # the run's first step
            fl.limits = rec.engine.norm_limits()
        limits = fl.limits
        totals = [c.total.detach().reshape(()) for c in clips]
        if host_copy.deferred(norms[0].device):  # an accelerator: nothing is read here
            grouped = by_device(grads)  # one device and dtype each
            per_param = _stack(norms, single=len(grouped) == 1)
            loss = staged[staged_names.index("loss/train")] \
                if "loss/train" in staged_names else None
            flags, zeroing, fused_skip = act(rec, per_param, grouped, loss, found_inf, limits,
                                             in_hook=not explicit)
            groups.update(norms=[per_param], flags=flags, clips=totals)
        else:  # on a CPU a read costs no wait, and a host float is cheaper than a tensor
            read = act_on_host(rec, norms, grads, staged_names, staged, totals, found_inf,
                               limits)
            groups = {}
    first = rec.step == rec.start_step
    hist = due(rec.spec.hist_every, step, first)
    every = rec.spec.update_every
    ratios = due(rec.spec.hist_every if every is None else every, step, first) and bool(norms)
    if read is not None and not read["flags"][KEPT]:
        ratios = False
    early, fl.early, before = fl.early, None, None
    if ratios:  # a closure's step: the weights it started from, where they still apply
        before = (early[2] if early is not None and early[0] == step and early[1] is
                  rec.layers else wprobe.snapshot(rec.layers))
    fl.taking = Taking(step, host, groups, layer_of, list(staged_names), clips, clip_note,
                       present, zeroing, limits, t0, time.perf_counter(),
                       explicit=explicit, hist=hist, before=before, skip=fused_skip,
                       read=read, layers=rec.layers)


def snapshot_early(rec: Measuring) -> None:
    """A step whose gradients its closure makes: the weights it starts from, where its
    update ratios are due, taken before the closure runs (SAM's moves them first)."""
    every, step = rec.spec.update_every, rec.step + 1
    if due(rec.spec.hist_every if every is None else every, step, rec.step == rec.start_step):
        rec.flight.early = (step, rec.layers, wprobe.snapshot(rec.layers))


def due(every: int, step: int, first: bool) -> bool:
    """A figure taken every `every` steps (0: never) is due at `step` (and at a run's or a
    resumed run's first step)."""
    return every > 0 and (step % every == 0 or first)


def _stack(norms: list[torch.Tensor], single: bool) -> torch.Tensor:
    """The norms as one float32 tensor; `single`: all on one device."""
    dev = norms[0].device
    if not single and any(n.device != dev for n in norms):  # a model split across devices
        norms = [n.to(dev, non_blocking=True) for n in norms]
    return torch.stack(norms).float()


class Reading(Protocol):
    """What reading a step's gradient figures uses of its run (a `StepRecorder`)."""

    layers: Layers
    grad_names: list[str]
    engine: AlertEngine
    control: ControlState
    own_clips: OwnClips
    layer_watch: LayerWatch
    framework_clip: float | None
    flight: InFlight
    opt: torch.optim.Optimizer

    def _emit(self, ev: Event, level: int | None = None) -> None: ...


def read_grads(rec: Reading, t: Taking, got: dict[str, list[float]]
               ) -> tuple[dict[str, float], list]:
    """The step's gradient figures from its copy, read on the host at a later boundary:
    per-layer norms (the loop's own clips divided out), the clip, the skip, the runner's
    staged figures, and the "grads" rules on them (a clip they ask for, `lasting_clip`,
    lowers the limit from the next step; their alerts are raised with the step's
    record)."""
    values = dict(t.host)
    values.update(zip(t.staged, got.get("staged", ())))
    flags = got.get("flags")
    if flags is None:  # no parameter had a gradient
        return values, []
    flags = [*flags, *FLAG_DEFAULTS[len(flags):]]
    if flags[FOUND_INF] > 0:  # the GradScaler's overflow: the optimizer skipped it
        values["amp/overflow"] = 1.0
        return values, []
    unscale = 1.0 / flags[SCALE]
    norms = [n * unscale for n in got.get("norms", ())]
    layers = t.layers if t.layers is not None else rec.layers
    names = rec.grad_names if layers is rec.layers else grad_names(layers)
    if t.clips or t.clip_note:
        total, per_layer, current = rec.own_clips.before(
            t.step, norms, t.layer_of, t.clips, got.get("clips", []), t.clip_note, t.present,
            layers)
        said, rec.own_clips.said[:] = list(rec.own_clips.said), []
        for ev in said:
            rec._emit(ev)
    else:
        total, per_layer = layer_norms(norms, t.layer_of, len(layers))
        current = total
    per_layer = rec.layer_watch.frozen_zeros(layers, per_layer)
    values[names[0]] = total
    if None in per_layer:  # a layer without a gradient this step: no figure
        values.update((k, v) for k, v in zip(names[1:], per_layer) if v is not None)
        if not rec.flight.said_no_grad:
            rec.flight.said_no_grad = True
            rec._emit(no_grad_event(t.step, [k for k, v in zip(names[1:], per_layer)
                                             if v is None]))
    else:
        values.update(zip(names[1:], cast("list[float]", per_layer)))
    skipped = flags[KEPT] == 0
    # the device's clip factor on the host's (float64) norm
    after = current * flags[COEF] if flags[COEF] != 1.0 else current
    if rec.framework_clip and not skipped and math.isfinite(after):
        after = after * min(1.0, rec.framework_clip / (after + 1e-6))
    values["grad_norm/clipped"] = after
    if skipped:
        values["skipped"] = 1.0
    alerts = rec.engine.observe("grads", t.step, values, limits=t.limits,
                                **({"skip": "zeroed", "fusable": "fused" in rec.opt.defaults}
                                   if t.zeroing else {}))
    return values, alerts


def no_grad_event(step: int, names: list[str]) -> Event:
    """Said once a run: layers without a gradient at `step`, whose norms are left blank."""
    shown = [n.removeprefix("grad_norm/") for n in names[:5]]
    more = f" and {len(names) - 5} more" if len(names) > 5 else ""
    return Event(step, "probe", "info",
                 f"no gradient at step {step} for {', '.join(shown)}{more}: their gradient "
                 "norms are left blank while they have none (frozen in place, not used in "
                 "the forward, an expert no token reached, a layer LayerDrop skipped this "
                 "step); a layer used by the loss should have one", {"layers": shown})


def lasting_clip(alerts: list, values: dict[str, float]) -> float | None:
    """The clip the "grads" rules' alerts of a step ask for from the next step on (the
    smallest max_norm; none for a skipped step), to lower the Clip control's to."""
    if "skipped" in values:
        return None
    limits = [float(a.rule.params.get("max_norm", 1.0)) for a in alerts
              if "clip" in a.rule.actions]
    return min(limits) if limits else None


def lower_clip(control: ControlState, limit: float | None) -> None:
    """The Clip control's limit lowered to `limit` (a rule's lasting clip)."""
    if limit is not None and (control.clip is None or control.clip > limit):
        control.clip = limit


@counted
def post_step(rec: Measuring) -> None:
    """Optimizer post-hook: update ratios, and the LR factor off for the scheduler."""
    fl = rec.flight
    if fl.found_inf_set or fl.scale_set:
        drop_found_inf(rec)
    t = fl.taking
    if t is None:
        return
    if t.before is not None:  # on device: copied with the step's other figures
        t.ratios = wprobe.update_ratios(rec.layers, t.before)
        t.before = None
    rec.lr.off()
    t.t_post = time.perf_counter()
    fl.stepped = True
