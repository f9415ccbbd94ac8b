"""Weight figures taken every `hist_every` steps: per-layer histograms and update ratios."""

from __future__ import annotations

import functools

import numpy as np
import torch

from . import sharded
from .grads import Layers, _gather, layer_sum_sq
from .norms import ratio


def snapshot(layers: Layers) -> list[torch.Tensor]:
    """Copies of the weights before an optimizer step (for the update ratio): one
    `_foreach` copy on the device, a few launches whatever the number of tensors."""
    if layers.shards is not None:  # FSDP2: this rank's shards (probes/sharded.py)
        return sharded.snapshot(layers)
    weights = [p.detach() for p in layers.params]
    clone = getattr(torch, "_foreach_clone", None)
    if clone is not None and weights[0].device.type != "cpu":
        return list(clone(weights))
    return [w.clone() for w in weights]


def update_ratios(layers: Layers, before: list[torch.Tensor]) -> torch.Tensor:
    """‖W_after − W_before‖ / ‖W_before‖ per layer (cs231n's update:weight ratio), [L] on
    device; NaN for a layer whose weights were all zero (a fresh LoRA B: no ratio).
    Consumes `before`."""
    if layers.shards is not None:
        return sharded.update_ratios(layers, before)
    after = [p.detach() for p in layers.params]
    dev = after[0].device
    index = layers.index(dev)
    norm = _stacked(torch._foreach_norm(before), dev)  # ‖W‖ before the update
    torch._foreach_sub_(before, after)  # the snapshot becomes the (negated) update
    delta = _stacked(torch._foreach_norm(before), dev)
    n = len(layers)
    return ratio(layer_sum_sq(delta, index, n), layer_sum_sq(norm, index, n))


def _stacked(norms: tuple[torch.Tensor, ...] | list[torch.Tensor], dev: torch.device
             ) -> torch.Tensor:
    """Per-tensor norms as one float vector on `dev`: one stack where they share it."""
    if all(n.device == dev for n in norms):
        return torch.stack(list(norms)).float()
    return _gather(list(norms), dev)


def histogram(x: torch.Tensor, bins: int, host: bool | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(edges [bins+1], counts [bins]) on device, binned as `numpy.histogram(x, bins=edges)`.

    Equal-width bins over [min, max]; the last bin includes its right edge. A constant
    tensor gets the range [v - 0.5, v + 0.5], as numpy does. `host`: see `binned`.
    """
    x = x.detach().reshape(-1).float()
    lo, hi = torch.aminmax(x)
    return binned(x, lo, hi, bins, host)


def binned(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bins: int,
           host: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`histogram` of the flat float `x` over the range [lo, hi] (0-dim tensors) given.
    `host`: counted in numpy, which reads `x` (default: where `x` is on the CPU); else
    with torch ops, which read nothing (a GPU's order, on a CPU too)."""
    same = hi <= lo
    lo = torch.where(same, lo - 0.5, lo)
    hi = torch.where(same, hi + 0.5, hi)
    edges = lo + (hi - lo) * torch.arange(bins + 1, device=x.device, dtype=x.dtype) / bins
    edges[-1] = hi  # exact right edge despite rounding
    if x.device.type == "cpu" if host is None else host:  # numpy: 4-5x less time a layer
        return edges, torch.from_numpy(_binned_np(x.numpy(), edges.numpy(), bins))
    # numpy's own fast path: index by arithmetic, then fix the ±1 ULP misses against the
    # edges (2-3× cheaper than a binary search per element).
    idx = ((x - lo) * (bins / (hi - lo))).long().clamp_(0, bins - 1)
    idx -= (x < edges[idx]).long()
    idx += ((x >= edges[idx + 1]) & (idx < bins - 1)).long()
    # scatter_add, not bincount: on CUDA bincount reads max(idx) back to size its output
    counts = torch.zeros(bins, dtype=torch.int64, device=x.device)
    return edges, counts.scatter_add_(0, idx, torch.ones_like(idx))


def histogram_np(x: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """`histogram` of a flat float32 array on the host: the same edges, the same bins."""
    lo, hi = x.min(), x.max()
    if not hi > lo:
        lo, hi = lo - np.float32(0.5), hi + np.float32(0.5)
    edges = lo + (hi - lo) * np.arange(bins + 1, dtype=np.float32) / np.float32(bins)
    edges[-1] = hi
    return edges, _binned_np(x, edges, bins)


def _binned_np(x: np.ndarray, edges: np.ndarray, bins: int) -> np.ndarray:
    """`binned`'s counts on the host, step for step the same float32 arithmetic (so the
    same bins); numpy's per-call cost is a fraction of torch's on small CPU tensors."""
    lo, hi = edges[0], edges[-1]
    t = (x - lo) * (np.float32(bins) / (hi - lo))
    idx = t.astype(np.intp)
    np.clip(idx, 0, bins - 1, out=idx)
    # Only a value near an edge can be off by one (the edges and t are rounded: by a few
    # ULPs of the range's magnitude, in bins); those alone are checked against the edges.
    near = float(np.spacing(max(abs(lo), abs(hi)))) * 16 * bins / float(hi - lo) + 1e-4
    if near < 0.25:
        frac = t - np.floor(t)
        sel = np.flatnonzero((frac < near) | (frac > 1 - near))
        xs, js = x[sel], idx[sel]
    else:
        xs, js, sel = x, idx, None
    js -= xs < edges[js]
    js += (xs >= edges[js + 1]) & (js < bins - 1)
    if sel is not None:
        idx[sel] = js
    return np.bincount(idx, minlength=bins).astype(np.int64)


def layer_histograms(layers: Layers, bins: int = 64, host: bool | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Histogram of each layer's weights: (edges [L, bins+1], counts [L, bins]) on device.
    `host`: in numpy, reading the weights (default: where they are all on the CPU)."""
    if host is None:
        host = all(p.device.type == "cpu" for p in layers.params)
    if layers.shards is not None:  # FSDP2: of the full weights, from the shards
        return sharded.layer_histograms(layers, bins, functools.partial(binned, host=host))
    groups: list[list[torch.Tensor]] = [[] for _ in layers.names]
    for p, li in zip(layers.params, layers.layer_of):
        # a complex weight's values: its real and imaginary parts (`.float()` drops one)
        w = torch.view_as_real(p.detach()) if p.is_complex() else p.detach()
        groups[li].append(w.reshape(-1))
    dev = layers.params[0].device
    # on the host, numpy throughout: a torch op's dispatch costs more than its work
    if host:
        out = [histogram_np(np.concatenate([t.float().numpy() for t in g]), bins)
               for g in groups]
        return (torch.from_numpy(np.stack([e for e, _ in out])),
                torch.from_numpy(np.stack([c for _, c in out])))
    edges, counts = [], []
    for g in groups:
        e, c = histogram(torch.cat([t.to(dev) for t in g]), bins, host=False)
        edges.append(e)
        counts.append(c)
    return torch.stack(edges), torch.stack(counts)
