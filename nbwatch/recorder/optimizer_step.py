"""The optimizer step, measured from its own hooks, without reading the device: the
gradient norms, the clip and the skip of a non-finite step are computed and applied on
the device; the figures are copied at the step's end (step_end.py, host_copy.py) and read
at a later boundary, where the "grads" rules see them (`read_grads`).

    optimizer.step()  pre-hook   LR factor on · grad norms (one _foreach_norm) · total,
                                 clip coefficient, non-finite flag: device tensors · clip
                                 (_foreach_mul_) · skip (found_inf, or zeroed gradients)
                                 · weights snapshot on update-ratio steps
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
from typing import TYPE_CHECKING, Any, Protocol

import torch

from .. import controls as ctl
from ..probes import weights as wprobe
from ..probes.grads import Layers, clip_factor, grad_names, layer_norms, param_grad_norms
from ..records import Event
from . import host_copy
from .host_copy import to_host
from .lr_factor import LrFactor
from .own_clips import OwnClips
from .own_time import OwnTime, counted
from .spec import Progress, RunSpec
from .state import InFlight, Taking

if TYPE_CHECKING:
    from ..alerts.engine import AlertEngine
    from ..controls import ControlState
    from ..probes.logits import TrainLogits

# the layout of a step's flags group: [total now, total after the clip, skipped,
# the GradScaler's found_inf, its grad_scale]
TOTAL, CLIPPED, SKIPPED, FOUND_INF, SCALE = range(5)
FUSED_TAKE_FOUND_INF = ("Adam", "AdamW", "SGD", "Adagrad")


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
    (`optimizer_hooks.ClipCall`), whose factors are divided out when read; `clip_note`:
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
            per_param = _stack(norms)
            loss = staged[staged_names.index("loss/train")] \
                if "loss/train" in staged_names else None
            flags, zeroing, fused_skip = act(rec, per_param, grads, loss, found_inf, limits,
                                             in_hook=not explicit)
            groups.update(norms=[per_param], flags=[flags], clips=totals)
        else:  # on a CPU a read costs no wait, and a host float is cheaper than a tensor
            read = act_on_host(rec, norms, grads, staged_names, staged, totals, found_inf,
                               limits)
            groups = {}
    first = rec.step == rec.start_step
    hist = due(rec.spec.hist_every, step, first)
    every = rec.spec.update_every
    ratios = due(rec.spec.hist_every if every is None else every, step, first) and bool(norms)
    if read is not None and read["flags"][SKIPPED]:
        ratios = False
    before = wprobe.snapshot(rec.layers) if ratios else None
    fl.taking = Taking(step, host, groups, layer_of, list(staged_names), clips, clip_note,
                       present, zeroing, limits, t0, time.perf_counter(),
                       explicit=explicit, hist=hist, before=before, skip=fused_skip,
                       read=read, layers=rec.layers)


def due(every: int, step: int, first: bool) -> bool:
    """A figure taken every `every` steps (0: never) is due at `step` (and at a run's or a
    resumed run's first step)."""
    return every > 0 and (step % every == 0 or first)


def act(rec: Measuring, per_param: torch.Tensor, grads: list[torch.Tensor],
        loss: torch.Tensor | None, found_inf: torch.Tensor | None,
        limits: dict[str, tuple[float, float]], in_hook: bool = True
        ) -> tuple[torch.Tensor, bool, torch.Tensor | None]:
    """Clip and skip this step on the device, as torch's `clip_grad_norm_` and a
    GradScaler's fused step do: no value is read. Returns the step's flags ([total now,
    after the clip, skipped, found_inf, grad_scale], device), whether its skip zeroes
    the gradients (an optimizer that takes no `found_inf`), and a fused optimizer's skip
    flag still to be handed over (measured by an adapter, before the optimizer's hook).

    The clip: the Clip control's limit, and each clipping rule's `limits` (rule → (the
    norm above which it fires, max_norm): `AlertEngine.norm_limits`; grad_explosion
    clips a step above its limit in that step). A fused optimizer takes
    the clip as its `grad_scale` (divided in its own kernel: no pass of nbwatch's over the
    gradients) when measured in its own pre-hook (`in_hook`: nothing else clips after it);
    any other gets one `_foreach_mul_`."""
    opt, fl = rec.opt, rec.flight
    dev = per_param.device
    if fl.found_inf_set or fl.scale_set:  # ours, left by a step that raised before its
        _drop_found_inf(rec)  # post-hook
    # A GradScaler hands a fused optimizer its scale and verdict (and, unless unscale_
    # ran, still-scaled gradients); an adapter passes its scaler's verdict
    scale = getattr(opt, "grad_scale", None)
    if found_inf is None:
        found_inf = getattr(opt, "found_inf", None)
    total = per_param.square().sum().sqrt()
    if isinstance(scale, torch.Tensor):
        scale = scale.reshape(()).float().to(dev, non_blocking=True)
        total = total / scale
    else:
        scale = None
    inf = (found_inf.reshape(()).float().to(dev, non_blocking=True)
           if isinstance(found_inf, torch.Tensor) else torch.zeros((), device=dev))
    fused = takes_found_inf(opt)
    coef = None
    if grads:
        limit = rec.control.clip
        if limit is not None:  # torch's rule: min(1, max_norm / (total + 1e-6))
            coef = (limit / (total + 1e-6)).clamp(max=1.0)
        for above, max_norm in limits.values():
            c = torch.where(total > above, (max_norm / (total + 1e-6)).clamp(max=1.0), 1.0)
            coef = c if coef is None else torch.minimum(coef, c)
    if coef is not None:
        # a NaN total scales by 1 (the step is skipped); an infinite one by 0, as torch's
        # own clip does
        coef = torch.nan_to_num(coef, nan=1.0)
        if fused and in_hook:  # the optimizer divides by its grad_scale: no pass of ours
            fl.scale_set = not hasattr(opt, "grad_scale")
            # the fused kernels' own inputs, set on the optimizer as torch's GradScaler does
            # (no attribute an Optimizer declares: hence setattr)
            value = (scale if scale is not None else 1.0) / coef
            setattr(opt, "grad_scale", value)  # noqa: B010
        else:
            for gs in _by_device(grads):  # torch's fast path: the factor in their dtype
                torch._foreach_mul_(gs, coef.to(gs[0].device, gs[0].dtype,
                                                non_blocking=True))
        clipped = total * coef
    else:
        clipped = total
    skip = torch.zeros((), dtype=torch.bool, device=dev)
    zeroing, fused_skip = False, None
    if rec.skip_nonfinite and grads:
        skip = ~torch.isfinite(total)
        if loss is not None:
            skip |= ~torch.isfinite(loss.to(dev, non_blocking=True))
        skip &= inf == 0  # a GradScaler's overflow is its own to skip (amp/overflow)
        if fused:  # the optimizer's own kernel skips: nothing else moves
            if in_hook:
                arm_skip(rec, skip)
            else:
                fused_skip = skip  # handed over at the optimizer's own pre-hook
        else:  # a zero-gradient step, decided on the device
            zeroing = True
            zero_where(grads, skip)
    one = torch.ones((), device=dev)
    return torch.stack([total, clipped, skip.float(), inf,
                        scale if scale is not None else one]), zeroing, fused_skip


def act_on_host(rec: Measuring, norms: list[torch.Tensor], grads: list[torch.Tensor],
                staged_names: list[str], staged: list[torch.Tensor],
                totals: list[torch.Tensor], found_inf: torch.Tensor | None,
                limits: dict[str, tuple[float, float]]) -> dict[str, list[float]]:
    """`act` on a CPU, where reading costs no wait: the same clip and flags from one read,
    and an exact skip for any optimizer (its gradients dropped: a parameter without one is
    left alone, its optimizer state too). Returns the groups `act`'s copy would bring."""
    opt = rec.opt
    scale = getattr(opt, "grad_scale", None)
    if found_inf is None:
        found_inf = getattr(opt, "found_inf", None)
    extra = [t.reshape(()) for t in (scale, found_inf) if isinstance(t, torch.Tensor)]
    got = to_host([*norms, *staged, *totals, *extra])
    p, k = len(norms), len(norms) + len(staged)
    per, staged_v, rest = got[:p], got[p:k], got[k:]
    clip_v = rest[:len(totals)]
    rest = rest[len(totals):]
    s = rest.pop(0) if isinstance(scale, torch.Tensor) else 1.0
    inf = rest.pop(0) if isinstance(found_inf, torch.Tensor) else 0.0
    total = math.sqrt(math.fsum(n * n for n in per)) / s
    loss = staged_v[staged_names.index("loss/train")] if "loss/train" in staged_names else 0.0
    skip = rec.skip_nonfinite and inf == 0 and not (math.isfinite(total)
                                                      and math.isfinite(loss))
    coef = 1.0
    if not skip and math.isfinite(total):
        if rec.control.clip is not None:
            coef = clip_factor(rec.control.clip, total)
        for above, max_norm in limits.values():
            if total > above:
                coef = min(coef, clip_factor(max_norm, total))
    if coef < 1.0:
        for gs in _by_device(grads):
            torch._foreach_mul_(gs, coef)
    if skip:
        for group in opt.param_groups:
            for param in group["params"]:
                param.grad = None
    return {"norms": per, "staged": staged_v, "clips": clip_v,
            "flags": [total, total * coef, float(skip), inf, s]}


def arm_skip(rec: Measuring, skip: torch.Tensor) -> None:
    """Hand a fused optimizer this step's skip as its `found_inf` (with a GradScaler's own
    verdict, if it set one: the scaler deletes it after the step; nbwatch deletes its own
    in the post-hook)."""
    opt = rec.opt
    prior = getattr(opt, "found_inf", None)
    rec.flight.found_inf_set = prior is None and not hasattr(opt, "found_inf")
    flag = skip.float()
    setattr(opt, "found_inf", flag if prior is None else torch.maximum(  # noqa: B010
        prior.float().to(flag.device, non_blocking=True), flag))


def _drop_found_inf(rec: Measuring) -> None:
    """The `found_inf` and `grad_scale` nbwatch gave the optimizer (where none had given
    it one: a GradScaler deletes its own after the step) are taken back."""
    fl, opt = rec.flight, rec.opt
    if fl.found_inf_set and hasattr(opt, "found_inf"):
        del opt.found_inf
    if fl.scale_set and hasattr(opt, "grad_scale"):
        del opt.grad_scale
    fl.found_inf_set = fl.scale_set = False


def takes_found_inf(opt: Any) -> bool:
    """Whether `opt.step()` honours `opt.found_inf` (torch's fused implementations)."""
    cached = getattr(opt, "_nbwatch_found_inf", None)
    if cached is None:
        cached = (type(opt).__module__.startswith("torch.optim")
                  and type(opt).__name__ in FUSED_TAKE_FOUND_INF
                  and all(g.get("fused") for g in opt.param_groups))
        opt._nbwatch_found_inf = cached
    return cached


# Integer types as wide as each float: a gradient's bits, to zero it by a multiply
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def zero_where(grads: list[torch.Tensor], skip: torch.Tensor) -> None:
    """Zero every gradient where `skip` (a 0-dim bool on the device) holds, NaN and inf
    included, without a read: their bits times 0 or 1 (a NaN · 0 is NaN; its bits · 0
    are +0.0), one `_foreach_mul_` per device and width, not a launch per gradient."""
    by: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        g = g._values() if g.is_sparse else g  # a sparse one: its values
        bits = _BITS.get(g.element_size())
        if bits is not None:
            try:
                by.setdefault((g.device, bits), []).append(g.view(bits))
                continue
            except RuntimeError:  # a tensor subclass without dtype views
                pass
        g.masked_fill_(skip.to(g.device, non_blocking=True), 0)
    for (dev, bits), views in by.items():
        torch._foreach_mul_(views, (~skip).to(dev, bits, non_blocking=True))


def _by_device(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The gradients grouped by device and dtype (as `clip_grad_norm_` groups them)."""
    first = (grads[0].device, grads[0].dtype)
    if all((g.device, g.dtype) == first for g in grads):
        return [grads]
    by: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        by.setdefault((g.device, g.dtype), []).append(g)
    return list(by.values())


def _stack(norms: list[torch.Tensor]) -> torch.Tensor:
    dev = norms[0].device
    if any(n.device != dev for n in norms):  # a model split across devices
        norms = [n.to(dev, non_blocking=True) for n in norms]
    return torch.stack(norms).float()


class Reading(Protocol):
    """What reading a step's gradient figures uses of its run (a `StepRecorder`)."""

    layers: Layers
    grad_names: list[str]
    engine: AlertEngine
    control: ControlState
    own_clips: OwnClips
    framework_clip: float | None

    def _emit(self, ev: Event, level: int | None = None) -> None: ...


def read_grads(rec: Reading, t: Taking, got: dict[str, list[float]]
               ) -> tuple[dict[str, float], list]:
    """The step's gradient figures from its copy, read on the host at a later boundary:
    per-layer norms (the loop's own clips divided out), the clip, the skip, the runner's
    staged figures, and the "grads" rules on them (a clip they ask for lowers the limit
    from the next step; their alerts are raised with the step's record)."""
    values = dict(t.host)
    values.update(zip(t.staged, got.get("staged", ())))
    flags = got.get("flags")
    if flags is None:  # no parameter had a gradient
        return values, []
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
    values.update(zip(names, [total, *per_layer]))
    skipped = flags[SKIPPED] > 0
    after = current  # the device's clip factor on the host's (float64) norm
    if flags[CLIPPED] != flags[TOTAL]:
        after = current * (flags[CLIPPED] / flags[TOTAL]) if flags[TOTAL] > 0 else 0.0
    if rec.framework_clip and not skipped and math.isfinite(after):
        after = after * min(1.0, rec.framework_clip / (after + 1e-6))
    values["grad_norm/clipped"] = after
    if skipped:
        values["skipped"] = 1.0
    alerts = rec.engine.observe("grads", t.step, values, limits=t.limits,
                                **({"skip": "zeroed"} if t.zeroing else {}))
    for a in alerts:
        if "clip" in a.rule.actions and not skipped:
            limit = float(a.rule.params.get("max_norm", 1.0))
            if rec.control.clip is None or rec.control.clip > limit:
                rec.control.clip = limit
    return values, alerts


@counted
def post_step(rec: Measuring) -> None:
    """Optimizer post-hook: update ratios, and the LR factor off for the scheduler."""
    fl = rec.flight
    if fl.found_inf_set or fl.scale_set:
        _drop_found_inf(rec)
    t = fl.taking
    if t is None:
        return
    if t.before is not None:  # on device: copied with the step's other figures
        t.ratios = wprobe.update_ratios(rec.layers, t.before)
        t.before = None
    rec.lr.off()
    t.t_post = time.perf_counter()
    fl.stepped = True
