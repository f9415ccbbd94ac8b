"""The host time of a module's training forwards: `time/forward` and `time/busy` for a
loop of one's own under torchrun, where they tell a straggler (a fast rank's step also
holds its wait for the slow one, inside backward's gradient sync, so step times alone look
alike). `start()`'s runner times its own forwards and data, less the waits counted here.

Two hooks on the model the Monitor was given; a forward with gradients off (an eval of
the loop's own) is not counted, nor one being traced by torch.compile (the hooks then
add nothing to its graph): a model compiled in place (`model.compile()`), or run through
`torch.compile(model)` while the Monitor holds `model`, has no `time/busy`, and its
straggler goes untold; give the Monitor the compiled module.

A third hook, where the module's own forward begins (a DDP wrapper's inner module; after
FSDP2's pre-forward hook on its root), tells the wait before it: DDP broadcasts the
model's buffers from rank 0 as each synchronised forward begins (every Hugging Face
Llama holds its rotary `inv_freq`), FSDP2 all-gathers the root's parameters, and there a
fast rank waits for the slow one. That wait is not the rank's work: it is left out of
both figures (with it in, the fast rank's busy time held the slow one's, so the slow
rank went unnamed, or the fast one was named)."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn


class ForwardClock:
    """Sums the host time of `module`'s forwards with gradients on, and notes when the
    last one ended, until `take()`; `waited` sums the waits before their own forwards
    began (a collective's), over the run."""

    def __init__(self, module: nn.Module):
        self.total = 0.0
        self.last_end: float | None = None  # perf_counter at the last timed forward's end
        self.waited = 0.0  # seconds, all forwards so far: DDP's buffer sync, FSDP2's gather
        self._waited_at_take = 0.0
        self._t0: float | None = None
        self._began = False
        inner = module.module if isinstance(module, nn.parallel.DistributedDataParallel) \
            else module
        self._handles = [module.register_forward_pre_hook(self._pre, prepend=True),
                         inner.register_forward_pre_hook(self._begin),
                         module.register_forward_hook(self._post)]

    def _pre(self, module: nn.Module, args: Any) -> None:
        # (a forward whose hook after it never ran, a checkpointed recompute cut short,
        # leaves no start behind for the next one)
        timed = torch.is_grad_enabled() and not torch.compiler.is_compiling()
        self._t0 = time.perf_counter() if timed else None
        self._began = False

    def _begin(self, module: nn.Module, args: Any) -> None:
        # the inner module compiled in place (`DDP(m)` of `m.compile()`): its hooks are
        # traced, where the clock would break the graph (refused under fullgraph=True)
        if torch.compiler.is_compiling():
            return
        if self._t0 is not None and not self._began:
            self._began = True
            self.waited += time.perf_counter() - self._t0

    def _post(self, module: nn.Module, args: Any, out: Any) -> None:
        if self._t0 is not None:
            self.last_end = time.perf_counter()
            self.total += self.last_end - self._t0
            self._t0 = None

    def take(self, since: float) -> dict[str, float]:
        """The step that began at `since` (perf_counter): `time/forward`, its forwards'
        time, and `time/busy`, from its start to its last forward's end (data, the loop's
        own work and the forwards: all but the backward, its gradient sync and the
        optimizer), both less the waits before the forwards began. Empty where no forward
        was timed."""
        total, last = self.total, self.last_end
        waited, self._waited_at_take = self.waited - self._waited_at_take, self.waited
        self.total, self.last_end = 0.0, None
        if not total or last is None:
            return {}
        total = max(total - waited, 0.0)
        return {"time/forward": total, "time/busy": max(last - since - waited, total)}

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
