"""The step's one device→host copy, and the one function that reads a device value.

A step's figures stay on the device until its end, then leave in one copy per device:
each group (a list of 0-dim or 1-d tensors) is flattened into one buffer, copied with
`non_blocking=True` (into pinned host memory on CUDA) behind an event, and read at a
later step boundary, once the event has completed. Nothing on the step path waits for the
device; a wait happens only where a figure is needed at once (an eval, a checkpoint, the
run's end, a pause), and it is timed apart from nbwatch's own work (`time/device_wait`).

    end of step N    HostCopy.launch(groups)      stack → copy_(non_blocking) → event
    boundary N+k     copy.ready()                 event.query(): never waits
                     copy.read(own)               the values, [float] per group
                                                  (`.arrays`: numpy, for the large ones)

`fetch` is the only place a device tensor is read on the step path (tests hold the rest
of the code to that: tests/recorder/test_sync_audit.py).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

# On a CPU a read costs no wait: the step is measured and read at once, on the host
# (optimizer_step.act_on_host). Tests set this to run the accelerator's order on a CPU;
# NBWATCH_GPU_ORDER=1 sets it for a whole process (the suite, its subprocesses included,
# run in a GPU's order: docs/performance.md).
DEFER_ON_CPU = os.environ.get("NBWATCH_GPU_ORDER", "") == "1"
_READING = threading.local()  # set while `fetch` reads: the sync audit allows it there


def deferred(device: torch.device) -> bool:
    """Whether figures on `device` take the accelerator's path: decided on the device,
    copied at the step's end and read at the next boundary."""
    return DEFER_ON_CPU or device.type != "cpu"


def reading() -> bool:
    """Whether this thread is inside `fetch` (the one read the sync audit allows)."""
    return getattr(_READING, "on", False)


def fetch(t: torch.Tensor) -> torch.Tensor:
    """`t` on the host: THE device→host read (a CPU-GPU sync point when `t` is on a GPU)."""
    _READING.on = True
    try:
        return t.detach().cpu() if t.device.type != "cpu" else t.detach()
    finally:
        _READING.on = False


def to_numpy(t: torch.Tensor) -> Any:
    """`t` as a numpy array on the host, read through `fetch`."""
    return _host(t, "numpy")


def values(t: torch.Tensor) -> list[float]:
    """A 1-d tensor's values as floats, read through `fetch`."""
    return _host(t, "tolist")


def _host(t: torch.Tensor, how: str) -> Any:
    """`fetch(t)` turned into a host value by its method `how`, inside the one read."""
    got = fetch(t)
    _READING.on = True
    try:
        return getattr(got, how)()
    finally:
        _READING.on = False


def flat(parts: list[torch.Tensor]) -> torch.Tensor:
    """0-dim or 1-d tensors as one flat float tensor, on the first accelerator's device
    among them (one stack/cat; a part elsewhere is moved there without a host sync: a
    host part into an accelerator's stream, never the reverse, which would be read
    before it landed)."""
    dev = next((p.device for p in parts if p.device.type != "cpu"), parts[0].device)
    parts = [p if p.device == dev else p.to(dev, non_blocking=True) for p in parts]
    if all(p.dim() == 0 for p in parts):
        out = torch.stack(parts)
    else:
        out = torch.cat([p.reshape(-1) for p in parts])
    return out if out.dtype in (torch.float32, torch.float64) else out.float()


def to_host(parts: list[torch.Tensor]) -> list[float]:
    """0-dim tensors read at once (a sync on a GPU): where a figure is needed now."""
    if len(parts) == 1 and parts[0].numel() == 1:
        _READING.on = True
        try:
            return [parts[0].item()]
        finally:
            _READING.on = False
    return values(flat(parts)) if parts else []


@dataclass
class _OnDevice:
    """One device's share of a copy: where each group's values lie in its buffer."""

    spans: list[tuple[str, int, int]]  # (group, start, stop)
    host: torch.Tensor  # the buffer on the host (pinned on CUDA), filled by the copy
    event: Any = None  # the CUDA event recorded after the copy; None: filled at once


@dataclass
class HostCopy:
    """One step's figures on their way to the host, as named groups of floats."""

    step: int
    shares: list[_OnDevice] = field(default_factory=list)
    sizes: dict[str, int] = field(default_factory=dict)
    known: dict[str, list[float]] = field(default_factory=dict)  # groups read already
    # groups of many values (a batch's lengths, histograms) read as arrays, not floats
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    array_names: frozenset[str] = frozenset()

    @classmethod
    def launch(cls, step: int, groups: dict[str, list[torch.Tensor]],
               known: dict[str, list[float]] | None = None,
               arrays: frozenset[str] = frozenset()) -> HostCopy:
        """Start the copy of `groups` (name → 0-dim or 1-d tensors); never waits. `known`:
        groups already on the host (a CPU step's, read at once); `arrays`: the groups read
        into `.arrays` as numpy arrays (thousands of values: a Python float each would
        cost the host ~10 µs a hundred)."""
        copy = cls(step, known=dict(known or {}), array_names=arrays)
        by_device: dict[torch.device, list[tuple[str, list[torch.Tensor]]]] = {}
        for name, parts in groups.items():
            if not parts:
                continue
            dev = next((p.device for p in parts if p.device.type != "cpu"), parts[0].device)
            if not deferred(dev):  # host memory, read once at the end anyway
                if name in arrays:
                    copy.arrays[name] = to_numpy(flat(parts))
                else:
                    copy.known[name] = to_host(parts)
                continue
            by_device.setdefault(dev, []).append((name, parts))
        for dev, named in by_device.items():  # one stack or cat per device: one launch
            spans, parts, at = [], [], 0
            for name, group in named:
                n = sum(p.numel() for p in group)
                spans.append((name, at, at + n))
                copy.sizes[name] = n
                at += n
                parts.extend(group)
            buf = flat(parts)
            if dev.type == "cuda":
                # pinned memory from torch's caching host allocator; the copy is queued
                # behind the step's kernels and the event says when it has landed
                host = buf.to("cpu", non_blocking=True)
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(dev))
                copy.shares.append(_OnDevice(spans, host, event))
            elif dev.type == "cpu":
                copy.shares.append(_OnDevice(spans, buf))
            else:  # another accelerator (mps, xpu): no event to ask; read at `read`
                copy.shares.append(_OnDevice(spans, buf, "read"))
        return copy

    def ready(self) -> bool:
        """Whether every share has landed on the host (asks the events; never waits)."""
        return all(s.event is None or (s.event != "read" and s.event.query())
                   for s in self.shares)

    def read(self, own: Any = None) -> dict[str, list[float]]:
        """The groups' values (those named `arrays` at the launch into `.arrays`); waits
        for a share still under way, the wait timed apart from nbwatch's own work on
        `own` (an `OwnTime`)."""
        out: dict[str, list[float]] = dict(self.known)
        for s in self.shares:
            if s.event == "read":
                t0 = time.perf_counter()
                host = fetch(s.host)
                if own is not None:
                    own.exclude(time.perf_counter() - t0)
            else:
                if s.event is not None and not s.event.query():
                    t0 = time.perf_counter()
                    s.event.synchronize()
                    if own is not None:
                        own.exclude(time.perf_counter() - t0)
                host = s.host
            got = to_numpy(host)
            for name, a, b in s.spans:
                if name in self.array_names:  # a copy: the pinned buffer goes back
                    self.arrays[name] = got[a:b].copy()
                else:
                    out[name] = got[a:b].tolist()
        return out
