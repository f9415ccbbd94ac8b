"""Gradient norms: global and per layer, with one batched norm per step and no host sync.

A *layer* is the module path that owns a parameter directly (`blocks.0.attn.qkv` for
`blocks.0.attn.qkv.weight`), in the model's registration order, which is its depth order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Layers:
    """Trainable parameters grouped by owning module path, in model order."""

    names: tuple[str, ...]
    params: tuple[nn.Parameter, ...]
    layer_of: tuple[int, ...]  # params[i] belongs to names[layer_of[i]]

    @classmethod
    def of(cls, model: nn.Module) -> Layers:
        names: list[str] = []
        index: dict[str, int] = {}
        params, layer_of = [], []
        for pname, p in model.named_parameters():
            if not p.requires_grad:
                continue
            owner = pname.rpartition(".")[0] or "(root)"
            if owner not in index:
                index[owner] = len(names)
                names.append(owner)
            params.append(p)
            layer_of.append(index[owner])
        return cls(tuple(names), tuple(params), tuple(layer_of))

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


def _gather(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.stack([t.float().to(device, non_blocking=True) for t in tensors])


def layer_sum_sq(per_param: torch.Tensor, index: torch.Tensor, n_layers: int) -> torch.Tensor:
    """Sum of squares of per-parameter norms into their layers: [P] -> [L]."""
    out = torch.zeros(n_layers, dtype=per_param.dtype, device=per_param.device)
    return out.index_add_(0, index, per_param.square())


def grad_norms(layers: Layers) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(global norm 0-dim, per-layer norms [L], the grads that exist) — all on device.

    One `torch._foreach_norm` over every gradient; the caller copies the results to the
    host together with the rest of the step's scalars (one sync per step, not one per layer).
    A parameter without a gradient this step counts as zero.
    """
    present = [(p.grad, li) for p, li in zip(layers.params, layers.layer_of) if p.grad is not None]
    dev = layers.params[0].device
    if not present:
        zero = torch.zeros((), device=dev)
        return zero, torch.zeros(len(layers), device=dev), []
    grads = [g for g, _ in present]
    norms = _gather(list(torch._foreach_norm(grads)), dev)  # [P]
    full = len(present) == len(layers.params)
    index = layers.index(dev, None if full else tuple(li for _, li in present))
    sq = layer_sum_sq(norms, index, len(layers))
    return sq.sum().sqrt(), sq.sqrt(), grads


def clip_(grads: list[torch.Tensor], total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Scale `grads` in place so that their global norm is at most `max_norm`.

    Same rule as `torch.nn.utils.clip_grad_norm_`, reusing the norm already computed
    instead of a second pass; returns the norm after clipping (0-dim, on device).
    """
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    for device, gs in by_device.items():
        torch._foreach_mul_(gs, coef.to(device))
    return total * coef
