"""The model and the optimizer changed in the middle of a run: a param group added
(progressive unfreezing, an adapter), a layer replaced (a new head). What the gradient
figures, the clip and the skip cover is read again at the optimizer's pre-hook, and an
event says what changed.

Comparing the module tree costs ~0.7 ms for a 12-layer GPT-2 on two CPU cores: too much
for every step. It is compared when something may have changed: torch's global hooks
mark a module or parameter registered anywhere (`model.head = nn.Linear(...)`), the
optimizer's groups are counted at every step (cheap), the optimizer's parameters frozen
when measured are asked whether they still are (a layer unfrozen, `requires_grad_()`: a
flag read per frozen tensor, nothing where none is), a step where more or fewer measured
parameters than at the last have no gradient asks whether one was frozen in place
(`note_gradless`: nothing while the count holds), a layer whose norm read exactly 0 is
asked whether it was frozen (`frozen_zeros`: a loop that keeps its gradients,
`zero_grad(set_to_none=False)`, leaves a frozen layer's at zeros, not None), and every
`RESCAN_EVERY` seconds (a model parameter no optimizer holds, switched on). Under torchrun
only the optimizer's groups and frozen tensors are compared: every rank sees them change
at the same step, where a clock, a hook of one process or a step read late would re-layer
the ranks at different steps (FSDP2's all-reduce of the per-parameter norms would then
mismatch).
"""

from __future__ import annotations

import operator
import time
import weakref
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from ..probes.grads import Layers
from ..probes.sharded import shards_of

RESCAN_EVERY = 30.0  # s: catches a requires_grad switched on with no registration
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def of_run(model: nn.Module, optimizer: torch.optim.Optimizer) -> Layers:
    """The layers a run measures: the model's trainable parameters by module, then any
    parameter the optimizer holds that the model does not, as `(param group N)`."""
    layers = Layers.of(model)
    known = {id(p) for p in layers.params}
    extra: list[tuple[str, torch.Tensor]] = []
    for i, g in enumerate(optimizer.param_groups):
        for p in g["params"]:
            if id(p) not in known and isinstance(p, torch.Tensor) and p.requires_grad:
                known.add(id(p))
                extra.append((f"(param group {i})", p))
    if not extra:
        return layers
    names = list(layers.names)
    params: list[Any] = list(layers.params)
    layer_of = list(layers.layer_of)
    for name, p in extra:
        if name not in names:
            names.append(name)
        params.append(p)
        layer_of.append(names.index(name))
    return Layers(tuple(names), tuple(params), tuple(layer_of), shards_of(tuple(params)))


def _groups(optimizer: torch.optim.Optimizer) -> tuple[int, ...]:
    return tuple(len(g["params"]) for g in optimizer.param_groups)


def _frozen(optimizer: torch.optim.Optimizer, layers: Layers) -> tuple[torch.Tensor, ...]:
    """The optimizer's tensors that `layers` leave out: frozen when they were read."""
    measured = {id(p) for p in layers.params}
    return tuple(p for g in optimizer.param_groups for p in g["params"]
                 if isinstance(p, torch.Tensor) and id(p) not in measured)


class LayerWatch:
    """Tells, at a step's pre-hook, whether the layers a run measures changed."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, layers: Layers,
                 distributed: bool = False):
        self.model, self.opt, self.distributed = model, optimizer, distributed
        self._groups = _groups(optimizer)
        self._ids = tuple(id(p) for p in layers.params)
        self._frozen = _frozen(optimizer, layers)
        self._dirty = False
        self._froze = False  # a measured parameter was frozen in place (note_gradless)
        self._missing = 0  # how many measured parameters had no gradient, at the last look
        self._next = time.monotonic() + RESCAN_EVERY
        ref = weakref.ref(self)

        def mark(*args: Any) -> None:  # any thread, any module: only a flag
            me = ref()
            if me is not None:
                me._dirty = True

        self._handles = [torch_module.register_module_module_registration_hook(mark),
                         torch_module.register_module_parameter_registration_hook(mark)]

    def changed(self, layers: Layers) -> Layers | None:
        """The layers now, where they are not `layers`' (else None)."""
        groups = _groups(self.opt)
        now = time.monotonic()
        own = not self.distributed and (self._dirty or now >= self._next)
        thawed = any(map(_REQUIRES_GRAD, self._frozen))  # ~75 ns a tensor
        if not (own or thawed or self._froze or groups != self._groups):
            return None
        self._dirty, self._froze, self._groups = False, False, groups
        self._next = now + RESCAN_EVERY
        new = of_run(self.model, self.opt)
        ids = tuple(id(p) for p in new.params)
        if ids == self._ids:
            return None
        self._ids, self._frozen = ids, _frozen(self.opt, new)
        return new

    def note_gradless(self, layers: Layers, missing: int) -> None:
        """`missing` of `layers`' parameters had no gradient at this step: where that count
        changed and one of them was frozen in place (`requires_grad_(False)`), the layers
        are compared at the next step (under torchrun too: a freeze is the program's, the
        same on every rank). A count that holds (an unused pooler) costs no look."""
        if missing == self._missing:
            return
        self._missing = missing
        if missing and any(p.grad is None and not p.requires_grad for p in layers.params):
            self._froze = True

    def frozen_zeros(self, layers: Layers, per_layer: list[float | None]
                     ) -> list[float | None]:
        """`per_layer` with each layer of norm exactly 0 whose parameters were all frozen
        in place left blank, and the layers compared at the next step: a loop that zeroes
        its gradients (`zero_grad(set_to_none=False)`) keeps a frozen layer's, all zeros,
        so it has no gradient as one whose `.grad` is None. Asked only of a norm of 0."""
        if 0.0 not in per_layer:
            return per_layer
        # one pass over the parameters, not one per layer at 0 (under torchrun a layer
        # frozen in place stays measured: this runs at every step)
        trained = {li for p, li in zip(layers.params, layers.layer_of) if p.requires_grad}
        frozen = [li for li, v in enumerate(per_layer) if v == 0.0 and li not in trained]
        if frozen and not self.distributed:  # read late, maybe on the sampler's thread:
            self._froze = True  # under torchrun, blank only
        out = list(per_layer)
        for li in frozen:
            out[li] = None
        return out

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def describe(step: int, old: Layers, new: Layers, groups: int) -> str:
    """What changed, in words, for the run's event."""
    before = dict.fromkeys(old.names)
    after = dict.fromkeys(new.names)
    held = {id(p) for p in old.params}
    replaced = sorted({new.names[li] for p, li in zip(new.params, new.layer_of)
                       if id(p) not in held and new.names[li] in before})
    added = [n for n in after if n not in before]
    left = {old.names.index(n) for n in before if n not in after}
    live = {li for p, li in zip(old.params, old.layer_of) if li in left and p.requires_grad}
    frozen = [old.names[li] for li in sorted(left - live)]  # still there, requires_grad off
    removed = [old.names[li] for li in sorted(live)]
    parts = [f"{what}: {', '.join(names)}" for what, names in
             (("new layers", added), ("replaced", replaced), ("frozen", frozen),
              ("gone", removed)) if names]
    n_old, n_new = len(old.params), len(new.params)
    what = "; ".join(parts) or "the same layers"
    plural = "s" if groups != 1 else ""
    return (f"the model or its optimizer changed before step {step} ({what}; {n_old} → "
            f"{n_new} trainable tensors, {groups} param group{plural}): from this step on the "
            "gradient norms, the clip and the non-finite skip cover what is there now")
