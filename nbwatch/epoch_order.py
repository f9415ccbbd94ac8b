"""The order of a pass over the training data, kept so that a resume skips the batches the
checkpointed run trained on, not others.

A shuffling `DataLoader` draws its order when a pass starts: its sampler's permutation (and
its workers' seeds) from its `generator`, or from torch's global RNG where it has none. So
`start()`'s loop keeps, for the pass it is in, the RNG states it was opened with (torch's,
Python's, numpy's and the loader's generators'), and a checkpoint keeps them; a resumed run
opens that pass again under them, skips the batches already trained on, and goes on with
the RNG the checkpoint restored. An order that comes from elsewhere (a streaming dataset's
own shuffle buffer) is not covered.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from .checkpoint import rng_state, set_rng_state


def generators(data: Any) -> list[torch.Generator]:
    """The generators a DataLoader's pass draws its order from: its own, its sampler's,
    its batch sampler's sampler's (each once)."""
    found: list[torch.Generator] = []
    sampler = getattr(data, "sampler", None)
    batch_sampler = getattr(data, "batch_sampler", None)
    for holder in (data, sampler, getattr(batch_sampler, "sampler", None)):
        g = getattr(holder, "generator", None)
        if isinstance(g, torch.Generator) and all(g is not f for f in found):
            found.append(g)
    return found


def restorable(data: Any) -> bool:
    """Whether the order of `data`'s passes is one a resume draws again: a fixed sequence,
    or a DataLoader over a map-style dataset (its sampler draws from the RNGs kept). An
    iterable dataset's own shuffle (a streaming buffer), a generator's: not known."""
    if isinstance(data, (list, tuple, range)):
        return True
    from torch.utils.data import DataLoader, IterableDataset

    return isinstance(data, DataLoader) and not isinstance(data.dataset, IterableDataset)


def _reused(data: Any) -> bool:
    """A DataLoader with persistent workers whose iterator is made already: its next pass
    resets it, which draws its sampler's seed alone (a new one draws the workers' first)."""
    return bool(getattr(data, "persistent_workers", False)
                and getattr(data, "_iterator", None) is not None)  # DataLoader's own


def open_pass(data: Iterable, order: dict[str, Any] | None = None
              ) -> tuple[Iterator, dict[str, Any]]:
    """A pass over `data` from its start, its first batch drawn at once (a sampler draws its
    order then), and the RNG states it was opened with. `order`: open it under these (a
    resume); the RNG states are then those of before the call again."""
    gens = generators(data)
    now = None
    if order is None:
        order = {"rng": rng_state(), "generators": [g.get_state() for g in gens],
                 "reused": _reused(data), "known": restorable(data)}
    else:
        now = rng_state()
        if order.get("reused") and not _reused(data):
            iter(data)  # made (its draws are not the pass's), so that the pass is a reset
        set_rng_state(order["rng"])
        if len(order["generators"]) == len(gens):
            for g, state in zip(gens, order["generators"]):
                g.set_state(state)
    try:
        it = iter(data)
        try:
            first = next(it)
        except StopIteration:
            return iter(()), order
    finally:
        if now is not None:
            set_rng_state(now)
    return itertools.chain((first,), it), order
