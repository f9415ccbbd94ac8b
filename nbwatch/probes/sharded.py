"""FSDP2 (`fully_shard`): the figures of sharded parameters, as those of the full ones.

Under FSDP2 a parameter and its gradient are DTensors: each rank holds one shard
(`to_local()`), and a norm taken on one rank is that shard's. Squares add up across
ranks, so the gradient norms of a step are ONE `all_reduce(SUM)` of every parameter's
local squared norm, stacked into one [P] tensor: every rank then has the norms of the full
gradients, per parameter, hence per layer and global (what `clip_grad_norm_` returns on the
sharded model, as `.full_tensor()`), and clip, skip and the rules decide alike on every
rank. A tensor held whole by several ranks (a Replicate placement, as in HSDP; a parameter
left plain) is counted once: its square is divided by the number of ranks holding it.

Every `hist_every` steps (off the hot path) the update ratios take one more all_reduce,
and the weight histograms two: the full parameter's range (MIN over ranks), then the
counts of each rank's shard in those shared bins (SUM): the histogram of every element
of the full parameter, without gathering it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .norms import norms_fp32, ratio


@dataclass(frozen=True)
class Shards:
    """How the monitored parameters are spread over the ranks."""

    weight: tuple[float, ...]  # per parameter: 1 / the ranks holding the same values
    counted: tuple[bool, ...]  # per parameter: this rank counts its values in histograms

    def weights(self, device: torch.device) -> torch.Tensor | None:
        """`weight` as a tensor on `device` (made once), None when all are 1."""
        if all(w == 1.0 for w in self.weight):
            return None
        cache = self.__dict__.setdefault("_w", {})
        if device not in cache:
            cache[device] = torch.tensor(self.weight, device=device)
        return cache[device]


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: a DTensor's local shard (same storage), else `t`."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def shards_of(params: tuple[torch.Tensor, ...]) -> Shards | None:
    """The sharding of `params`, None when none is a DTensor (no FSDP2)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without torch.distributed
        return None
    if not any(isinstance(p, DTensor) for p in params):
        return None
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    weight, counted = [], []
    for p in params:
        if isinstance(p, DTensor):
            mesh = p.device_mesh
            sharded_over = math.prod(mesh.size(i) for i, pl in enumerate(p.placements)
                                     if pl.is_shard())
            coord = mesh.get_coordinate() or [0] * mesh.ndim
            weight.append(sharded_over / world)  # world / sharded_over ranks hold a copy
            counted.append(all(c == 0 for c, pl in zip(coord, p.placements)
                               if not pl.is_shard()))
        else:  # whole on every rank
            weight.append(1.0 / world)
            counted.append(rank == 0)
    return Shards(tuple(weight), tuple(counted))


def _all_reduce(t: torch.Tensor, op: Any = None) -> torch.Tensor:
    import torch.distributed as dist

    dist.all_reduce(t, op=dist.ReduceOp.SUM if op is None else op)
    return t


def _sum_sq(norms: list[torch.Tensor], shards: Shards) -> torch.Tensor:
    """Per-parameter squared norms [P], each counted once across the ranks."""
    sq = torch.stack([n.float() for n in norms]).square()
    w = shards.weights(sq.device)
    return sq if w is None else sq * w


def grad_norms(layers: Any) -> tuple[list[torch.Tensor], tuple[int, ...], list[torch.Tensor]]:
    """`param_grad_norms` of a sharded model: (the full gradient's norm of every parameter,
    0-dim tensors; the layer of each; the local gradient shards, for clipping in place).
    One `_foreach_norm` and one all_reduce; no host sync."""
    shards: Shards = layers.shards
    grads = [local(p.grad) if p.grad is not None else None for p in layers.params]
    present = [g for g in grads if g is not None]
    if not present:
        return [], (), []
    norms = list(norms_fp32(present))
    if len(present) == len(grads):
        sq = _sum_sq(norms, shards)
    else:  # a parameter without a gradient counts as 0, so that every rank sends [P]
        sq = torch.zeros(len(grads), device=norms[0].device)
        at = [i for i, g in enumerate(grads) if g is not None]
        sq[layers.index(sq.device, tuple(at))] = torch.stack(
            [n.float() for n in norms]).square()
        w = shards.weights(sq.device)
        sq = sq if w is None else sq * w
    # the step's one collective: [P] floats, whatever the number of layers
    return list(_all_reduce(sq).sqrt().unbind()), layers.layer_of, present


def snapshot(layers: Any) -> list[torch.Tensor]:
    """Copies of this rank's weight shards before an optimizer step."""
    return [local(p.detach()).clone() for p in layers.params]


def update_ratios(layers: Any, before: list[torch.Tensor]) -> torch.Tensor:
    """‖ΔW‖ / ‖W before‖ per layer of the full weights, [L]: one all_reduce. Consumes
    `before`."""
    after = [local(p.detach()) for p in layers.params]
    norm = _sum_sq(list(torch._foreach_norm(before)), layers.shards)
    torch._foreach_sub_(before, after)
    n = len(layers)
    dev = after[0].device
    index = layers.index(dev)
    delta = _sum_sq(list(torch._foreach_norm(before)), layers.shards)
    both = torch.zeros(2 * n, device=dev)
    both[:n].index_add_(0, index, delta)
    both[n:].index_add_(0, index, norm)
    _all_reduce(both)
    return ratio(both[:n], both[n:])


def layer_histograms(layers: Any, bins: int, binned: Any
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Histogram of each layer's full weights, (edges [L, bins+1], counts [L, bins]), the
    same on every rank: two all_reduces (the range, then the counts). `binned(x, lo, hi,
    bins)`: weights.binned, the binning of one flat tensor over a range given."""
    import torch.distributed as dist

    shards: Shards = layers.shards
    dev = layers.params[0].device
    groups: list[list[torch.Tensor]] = [[] for _ in layers.names]
    for p, li, mine in zip(layers.params, layers.layer_of, shards.counted):
        if mine:
            groups[li].append(local(p.detach()).reshape(-1).float().to(dev))
    flat = [torch.cat(g) if g else torch.empty(0, device=dev) for g in groups]
    inf = torch.tensor(math.inf, device=dev)
    lo_hi = torch.stack([*(x.min() if x.numel() else inf for x in flat),
                         *(-x.max() if x.numel() else inf for x in flat)])
    _all_reduce(lo_hi, dist.ReduceOp.MIN)
    n = len(flat)
    edges, counts = [], []
    for i, x in enumerate(flat):
        e, c = binned(x, lo_hi[i], -lo_hi[n + i], bins)
        edges.append(e)
        counts.append(c)
    counts_t = _all_reduce(torch.stack(counts))
    return torch.stack(edges), counts_t
