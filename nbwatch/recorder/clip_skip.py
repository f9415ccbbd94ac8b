"""The step's clip and its skip of a non-finite step, decided where the step is taken.

On an accelerator (`act`) nothing is read: torch's own clip, min(1, max_norm / (total +
1e-6)), is computed on the device and applied by one `_foreach_mul_` (or handed to a fused
optimizer as its `grad_scale`), and a non-finite step is skipped through the optimizer's
`found_inf` (fused kernels) or by zeroing its gradients (any other optimizer). Each op here
is a kernel launch on a GPU, a few µs of the host's time a step, so they are kept few
(tests/recorder/test_host_copy.py counts them). On a CPU a read costs no wait
(`act_on_host`): the same decisions on host floats, and an exact skip for any optimizer.
Both return the step's flags, laid out as `TOTAL` ... `SCALE`.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..probes.grads import clip_factor
from .host_copy import to_host
from .state import InFlight

if TYPE_CHECKING:
    from ..controls import ControlState

# the layout of a step's flags group: [total now, the clip's factor, kept (0: skipped),
# the GradScaler's found_inf, its grad_scale], and the values of a tail left out
TOTAL, COEF, KEPT, FOUND_INF, SCALE = range(5)
FLAG_DEFAULTS = (math.nan, 1.0, 1.0, 0.0, 1.0)
# a CPU scalar (whatever the default device): a GPU's kernel takes it as an argument
_ONE = torch.ones((), dtype=torch.float32, device="cpu")
FUSED_TAKE_FOUND_INF = ("Adam", "AdamW", "SGD", "Adagrad")


class Deciding(Protocol):
    """What the clip and the skip use of their run (a `StepRecorder`)."""

    opt: torch.optim.Optimizer
    flight: InFlight
    control: ControlState
    skip_nonfinite: bool


def act(rec: Deciding, per_param: torch.Tensor, groups: list[list[torch.Tensor]],
        loss: torch.Tensor | None, found_inf: torch.Tensor | None,
        limits: dict[str, tuple[float, float]], in_hook: bool = True
        ) -> tuple[list[torch.Tensor], bool, torch.Tensor | None]:
    """Clip and skip this step on the device, as torch's `clip_grad_norm_` and a
    GradScaler's fused step do: no value is read. `groups`: the gradients, as `by_device`
    groups them. Returns the step's flags (0-dim device
    tensors laid out as `TOTAL`...`SCALE`, a tail of defaults left out), whether its skip
    zeroes the gradients (an optimizer that takes no `found_inf`), and a fused optimizer's
    skip flag still to be handed over (measured by an adapter, before the optimizer's hook).

    The clip: the Clip control's limit, and each clipping rule's `limits` (rule → (the
    norm above which it fires, max_norm): `AlertEngine.norm_limits`; grad_explosion
    clips a step above its limit in that step). A fused optimizer takes
    the clip as its `grad_scale` (divided in its own kernel: no pass of nbwatch's over the
    gradients) when measured in its own pre-hook (`in_hook`: nothing else clips after it);
    any other gets one `_foreach_mul_`."""
    opt, fl = rec.opt, rec.flight
    dev = per_param.device
    if fl.found_inf_set or fl.scale_set:  # ours, left by a step that raised before its
        drop_found_inf(rec)  # post-hook
    # A GradScaler hands a fused optimizer its scale and verdict (and, unless unscale_
    # ran, still-scaled gradients); an adapter passes its scaler's verdict. Each op below
    # is a launch on a GPU (a few µs of host time): they are kept few, none per parameter
    scale = getattr(opt, "grad_scale", None)
    if found_inf is None:
        found_inf = getattr(opt, "found_inf", None)
    total = torch.linalg.vector_norm(per_param)  # clip_grad_norm_'s total of its norms
    extra: list[torch.Tensor] = []  # [found_inf, grad_scale], where a GradScaler gave any
    if isinstance(scale, torch.Tensor) or isinstance(found_inf, torch.Tensor):
        # copies: the scaler changes its own in place (update()) before the step's end,
        # where these are copied to the host
        scale = (scale.reshape(()).to(dev, torch.float32, non_blocking=True, copy=True)
                 if isinstance(scale, torch.Tensor) else None)
        if scale is not None:
            total = total / scale
        inf = (found_inf.reshape(()).to(dev, torch.float32, non_blocking=True, copy=True)
               if isinstance(found_inf, torch.Tensor) else _constant(0.0, dev))
        extra = [inf, scale if scale is not None else _constant(1.0, dev)]
    fused = takes_found_inf(opt)
    coef = None
    if groups and (rec.control.clip is not None or limits):
        # torch's rule, min(1, max_norm / (total + 1e-6)), for every limit at once: the
        # smallest max_norm of the Clip control's and of the rules whose norm is passed
        # (a product rounds monotonically: min(d·a, d·b) = d·min(a, b), bit for bit)
        limit = math.inf if rec.control.clip is None else rec.control.clip
        max_norm: float | torch.Tensor = limit
        for above, m in limits.values():  # the smallest of those whose rule fires
            if isinstance(max_norm, float):
                max_norm = torch.where(total > above, _constant(min(m, limit), dev),
                                       _constant(max_norm, dev))
            else:
                max_norm = torch.where(total > above,
                                       torch.fmin(max_norm, _constant(m, dev)), max_norm)
        # fmin: a NaN total scales by 1 (the step is skipped); an infinite one by 0, as
        # torch's own clip does
        coef = torch.fmin((total + 1e-6).reciprocal() * max_norm, _ONE)
        if fused and in_hook:  # the optimizer divides by its grad_scale: no pass of ours
            fl.scale_set = not hasattr(opt, "grad_scale")
            # the fused kernels' own inputs, set on the optimizer as torch's GradScaler does
            # (no attribute an Optimizer declares: hence setattr)
            value = (scale if scale is not None else 1.0) / coef
            setattr(opt, "grad_scale", value)  # noqa: B010
        else:
            for gs in groups:  # torch's fast path: the factor in their dtype
                torch._foreach_mul_(gs, coef.to(gs[0].device, gs[0].dtype,
                                                non_blocking=True))
    kept: torch.Tensor | None = None
    zeroing, fused_skip = False, None
    if rec.skip_nonfinite and groups:
        # a norm is ≥ 0 or NaN, so it is finite where it is < inf; a loss · 0 is 0 where
        # the loss is finite, NaN where not
        checked = total if loss is None else total + loss.to(dev, non_blocking=True) * 0
        kept = checked < math.inf
        if extra:  # a GradScaler's overflow is its own to skip (amp/overflow)
            kept |= extra[0] > 0
        if fused:  # the optimizer's own kernel skips (its found_inf): nothing else moves
            skip = torch.where(kept, _constant(0.0, dev), _constant(1.0, dev))
            if in_hook:
                arm_skip(rec, skip)
            else:
                fused_skip = skip  # handed over at the optimizer's own pre-hook
        else:  # a zero-gradient step, decided on the device
            zeroing = True
            zero_unless(kept, groups)
    flags = [total]  # the tail that holds only defaults is left out: no launch for it
    if coef is not None or kept is not None or extra:
        flags.append(coef if coef is not None else _constant(1.0, dev))
    if kept is not None or extra:
        flags.append(kept if kept is not None else _constant(1.0, dev))
    return flags + extra, zeroing, fused_skip


def act_on_host(rec: Deciding, norms: list[torch.Tensor], grads: list[torch.Tensor],
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
        for gs in by_device(grads):
            torch._foreach_mul_(gs, coef)
    if skip:
        for group in opt.param_groups:
            for param in group["params"]:
                param.grad = None
    return {"norms": per, "staged": staged_v, "clips": clip_v,
            "flags": [total, coef, float(not skip), inf, s]}


def arm_skip(rec: Deciding, skip: torch.Tensor) -> None:
    """Hand a fused optimizer this step's skip as its `found_inf` (with a GradScaler's own
    verdict, if it set one: the scaler deletes it after the step; nbwatch deletes its own
    in the post-hook)."""
    opt = rec.opt
    prior = getattr(opt, "found_inf", None)
    rec.flight.found_inf_set = prior is None and not hasattr(opt, "found_inf")
    flag = skip.float()
    setattr(opt, "found_inf", flag if prior is None else torch.maximum(  # noqa: B010
        prior.float().to(flag.device, non_blocking=True), flag))


def drop_found_inf(rec: Deciding) -> None:
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


def zero_unless(keep: torch.Tensor, groups: list[list[torch.Tensor]]) -> None:
    """Zero every gradient unless `keep` (a 0-dim bool on the device) holds, NaN and inf
    included, without a read: their bits times 0 or 1 (a NaN · 0 is NaN; its bits · 0
    are +0.0), one `_foreach_mul_` per device and dtype, not a launch per gradient.
    `groups`: the gradients, as `by_device` groups them."""
    for gs in groups:
        bits = _BITS.get(gs[0].element_size())
        try:  # one view a gradient is all the host does for it (~0.5 µs)
            views = [g.view(bits) for g in gs] if bits is not None else None
        except (RuntimeError, NotImplementedError):  # sparse; a subclass without views
            views = None
        if views is None:
            _zero_mixed(gs, keep)
        else:
            torch._foreach_mul_(views, keep.to(gs[0].device, bits, non_blocking=True))


def _zero_mixed(grads: list[torch.Tensor], keep: torch.Tensor) -> None:
    """`zero_unless` for a group where some gradient has no bit view of its own: a sparse
    one's values are viewed instead, one without any view (a subclass) is
    `masked_fill_`ed; the views still take one `_foreach_mul_`."""
    bits = _BITS.get(grads[0].element_size())
    views = []
    for g in grads:
        g = g._values() if g.is_sparse else g
        try:
            if bits is not None:
                views.append(g.view(bits))
                continue
        except (RuntimeError, NotImplementedError):
            pass
        g.masked_fill_(~keep.to(g.device, non_blocking=True), 0)
    if views:
        torch._foreach_mul_(views, keep.to(grads[0].device, bits, non_blocking=True))


@functools.lru_cache(maxsize=64)
def _constant(value: float, device: torch.device) -> torch.Tensor:
    """`value` as a 0-dim float32 on `device`, made once (a `where` given a Python float
    fills a new tensor on the device each step: a launch)."""
    return torch.full((), value, dtype=torch.float32, device=device)


def by_device(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The gradients grouped by device and dtype (as `clip_grad_norm_` groups them)."""
    device, dtype = grads[0].device, grads[0].dtype
    if all(g.dtype == dtype and g.device == device for g in grads):
        return [grads]
    by: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        by.setdefault((g.device, g.dtype), []).append(g)
    return list(by.values())
