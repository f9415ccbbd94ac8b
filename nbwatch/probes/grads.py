"""Gradient norms: global and per layer, from one batched norm per step.

A *layer* is the module path that owns a parameter directly (`blocks.0.attn.qkv` for
`blocks.0.attn.qkv.weight`), in the model's registration order, which is its depth order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from .norms import norms_fp32
from .paths import unwrapped


@dataclass(frozen=True)
class Layers:
    """Trainable parameters grouped by owning module path, in model order."""

    names: tuple[str, ...]
    params: tuple[nn.Parameter, ...]
    layer_of: tuple[int, ...]  # params[i] belongs to names[layer_of[i]]
    shards: Any = None  # FSDP2: how the parameters are sharded (probes/sharded.py)

    @classmethod
    def of(cls, model: nn.Module) -> Layers:
        """The layers of `model`, named as the model names them: a (Distributed)DataParallel
        wrapper's `module.` and torch.compile's `_orig_mod.` left out, so that a run under
        torchrun names its layers as the same model trained alone does."""
        names: list[str] = []
        index: dict[str, int] = {}
        params, layer_of = [], []
        for pname, p in unwrapped(model).named_parameters():
            if not p.requires_grad:
                continue
            # torch.compile wraps the model: its layers are the model's own
            owner = pname.replace("_orig_mod.", "").rpartition(".")[0] or "(root)"
            if owner not in index:
                index[owner] = len(names)
                names.append(owner)
            params.append(p)
            layer_of.append(index[owner])
        from .sharded import shards_of

        return cls(tuple(names), tuple(params), tuple(layer_of), shards_of(tuple(params)))

    def __len__(self) -> int:
        return len(self.names)

    def index(self, device: torch.device, layer_of: tuple[int, ...] | None = None
              ) -> torch.Tensor:
        """`layer_of` (or a subset of it) as a tensor on `device`, made once: building it
        from a list each step would be a host→device copy, which waits for the GPU."""
        key = (device, self.layer_of if layer_of is None else layer_of)
        cache = self.__dict__.setdefault("_index", {})
        if key not in cache:
            if len(cache) > 16:  # parameter subsets without grads vary: keep a few
                cache.clear()
            cache[key] = torch.tensor(key[1], device=device)
        return cache[key]


def grad_names(layers: Layers) -> list[str]:
    """The step record's names of the global and per-layer gradient norms."""
    return ["grad_norm/global"] + [f"grad_norm/{n}" for n in layers.names]


def ratio_names(layers: Layers) -> list[str]:
    """The step record's names of the per-layer update ratios."""
    return [f"update_ratio/{n}" for n in layers.names]


def _gather(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.stack([t.float().to(device, non_blocking=True) for t in tensors])


def layer_sum_sq(per_param: torch.Tensor, index: torch.Tensor, n_layers: int) -> torch.Tensor:
    """Sum of squares of per-parameter norms into their layers: [P] -> [L]."""
    out = torch.zeros(n_layers, dtype=per_param.dtype, device=per_param.device)
    return out.index_add_(0, index, per_param.square())


def param_grad_norms(layers: Layers) -> tuple[list[torch.Tensor], tuple[int, ...],
                                               list[torch.Tensor]]:
    """(norm of each gradient: 0-dim device tensors, the layer of each, the gradients) for
    the parameters that have a gradient this step: one `torch._foreach_norm`, no sync.

    The caller stacks the norms with the step's other figures into one host copy and sums
    them into layers there (`layer_norms`): fewer device ops than an on-device scatter,
    which matters when the step itself is short.
    """
    if layers.shards is not None:  # FSDP2: norms of the full gradients, one all_reduce
        from .sharded import grad_norms

        return grad_norms(layers)
    each = [p.grad for p in layers.params]  # each read once: a property in C
    of = layers.layer_of
    if all(g is not None for g in each):
        grads = cast("list[torch.Tensor]", each)
    else:  # some parameters have none this step
        of = tuple(li for g, li in zip(each, of) if g is not None)
        grads = [g for g in each if g is not None]
        if not grads:
            return [], (), []
    return list(norms_fp32(grads)), of, grads


def layer_norms(norms: list[float], layer_of: tuple[int, ...], n_layers: int
                ) -> tuple[float, list[float | None]]:
    """(global norm, per-layer norms) from per-parameter norms; None for a layer without
    a gradient this step (frozen, unused, an expert no token reached): it has no norm,
    rather than a norm of zero that reads as a vanishing gradient."""
    sq = [0.0] * n_layers
    for n, li in zip(norms, layer_of):
        sq[li] += n * n
    per_layer: list[float | None] = [math.sqrt(x) for x in sq]
    if 0.0 in sq:  # a zero gradient, or none: only a layer of no parameter here has none
        present = set(layer_of)
        per_layer = [v if i in present else None for i, v in enumerate(per_layer)]
    return math.sqrt(math.fsum(sq)), per_layer


def clip_(grads: list[torch.Tensor], total: float, max_norm: float) -> float:
    """Scale `grads` in place so that their global norm (`total`, already measured) is at
    most `max_norm`: the rule of `torch.nn.utils.clip_grad_norm_`, without its second
    pass. Returns the norm after clipping."""
    coef = min(max_norm / (total + 1e-6), 1.0)
    if coef < 1.0:
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for g in grads:
            by_device.setdefault(g.device, []).append(g)
        for gs in by_device.values():
            torch._foreach_mul_(gs, coef)
    return total * coef


def clip_factor(max_norm: float, total: float) -> float:
    """The factor `torch.nn.utils.clip_grad_norm_` (and `clip_grads_with_norm_`) scales
    every gradient it covers by, given the norm it computed: min(1, max_norm / (total +
    1e-6)). One factor for all, so a norm after the clip divided by it is the norm before."""
    return min(1.0, max_norm / (total + 1e-6))
