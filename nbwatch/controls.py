"""The one narrow channel back: control commands, and LR arithmetic that survives a scheduler.

Buttons, `Monitor.pause()` etc. and other processes (through the store) put `Command`s
here; the runner drains them between steps and records each as an event.
"""

from __future__ import annotations

import queue
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from .records import Command

KINDS = ("pause", "resume", "stop", "checkpoint", "clip", "scale_lr", "rewind", "skip")


@dataclass
class ControlState:
    """What the controls have set; saved in every checkpoint."""

    clip: float | None = None
    lr_factor: float = 1.0
    paused: bool = False
    lr_raw: bool = False  # the optimizer's LRs hold the plain schedule (factor divided out)

    def to_dict(self) -> dict:
        return {"clip": self.clip, "lr_factor": self.lr_factor, "lr_raw": self.lr_raw}


class CommandQueue:
    """Thread-safe FIFO of commands; `get` waits (used while paused)."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[Command] = queue.SimpleQueue()

    def put(self, command: Command) -> None:
        if command.kind not in KINDS:
            raise ValueError(f"unknown command {command.kind!r}; known: {', '.join(KINDS)}")
        self._q.put(command)

    def drain(self) -> list[Command]:
        if self._q.empty():  # the common case, without raising queue.Empty
            return []
        out = []
        while True:
            try:
                out.append(self._q.get_nowait())
            except queue.Empty:
                return out

    def get(self, timeout: float) -> Command | None:
        try:
            return self._q.get(timeout=timeout)
        except queue.Empty:
            return None


class Controls:
    """The control surface shared by `Monitor` and `Attached` (what the buttons call).

    Subclasses implement `_send(kind, value)`: a queue in this process, or a row in the
    store for a run written by another.
    """

    def _send(self, kind: str, value: float | None = None) -> object:
        raise NotImplementedError

    def pause(self) -> None:
        """Pause after the current step (the training thread waits; the kernel stays free)."""
        self._send("pause")

    def resume(self) -> None:
        self._send("resume")

    def stop(self) -> None:
        """Stop after the current step, with a final checkpoint."""
        self._send("stop")

    def checkpoint(self) -> None:
        """Write a checkpoint after the current step."""
        self._send("checkpoint")

    def set_clip(self, max_norm: float | None) -> None:
        """Clip the global gradient norm to `max_norm` from the next step (None: no clipping)."""
        self._send("clip", check_clip(max_norm))

    def scale_lr(self, factor: float) -> None:
        """Multiply the LR by `factor` from the next step; the scheduler does not undo it."""
        self._send("scale_lr", check_factor(factor))

    def rewind(self, steps: int = 100, skip: int = 200) -> None:
        """PaLM's remedy for a loss spike: reload the newest checkpoint at least `steps`
        steps back (model, optimizer, scheduler, RNG) and go on from there, on the data that
        comes `skip` batches after the current one; the batches since the checkpoint and
        those `skip` are not trained on. The rewound-over steps stay in the history as a
        branch (`rewind/<n>/loss/train`). Needs nbwatch to run the loop (`start()`)."""
        steps, skip = check_count("steps", steps, 1), check_count("skip", skip, 0)
        self._send("rewind", float(steps))
        self._send("skip", float(skip))  # also 0: it closes the rewind's answer

    def skip(self, batches: int) -> None:
        """Skip the next `batches` batches of the data stream (`start()` only)."""
        self._send("skip", float(check_count("batches", batches, 1)))


def check_count(name: str, v: int, least: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < least:
        raise ValueError(f"{name} must be an int ≥ {least}, got {v!r}")
    return v


def check_clip(max_norm: float | None) -> float | None:
    if max_norm is None:
        return None
    v = float(max_norm)
    if not v > 0 or v != v or v == float("inf"):
        raise ValueError(
            f"clip max_norm must be a positive finite number or None, got {max_norm!r}"
        )
    return v


def check_factor(factor: float) -> float:
    v = float(factor)
    if not v > 0 or v != v or v == float("inf"):
        raise ValueError(f"LR factor must be a positive finite number, got {factor!r}")
    return v


def scale_lrs(optimizer: torch.optim.Optimizer, factor: float) -> None:
    """Multiply every param group's LR by `factor` (a tensor LR is scaled in place)."""
    for g in optimizer.param_groups:
        if isinstance(g["lr"], torch.Tensor):
            g["lr"].mul_(factor)
        else:
            g["lr"] *= factor


def lrs(optimizer: torch.optim.Optimizer) -> list[float]:
    return [float(g["lr"]) for g in optimizer.param_groups]


def chains(scheduler: Any) -> bool:
    """Whether `scheduler.step()` scales the current LR (chainable: StepLR, ExponentialLR)
    rather than recomputing it from `base_lrs` (closed form: LambdaLR, OneCycleLR)."""
    cached = _CHAINS.get(scheduler)  # never an attribute: state_dict() is its __dict__
    if cached is not None:
        return cached
    groups = scheduler.optimizer.param_groups
    saved = [g["lr"] for g in groups]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            a = list(scheduler.get_lr())
            for g in groups:
                g["lr"] = g["lr"] * 2.0
            b = list(scheduler.get_lr())
        chains = any(x != y for x, y in zip(a, b))
    except Exception:  # a hand-written scheduler: assume closed form, the common case
        chains = False
    finally:
        for g, lr in zip(groups, saved):
            g["lr"] = lr
    _CHAINS[scheduler] = chains
    return chains


_CHAINS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def steps_taken(scheduler: Any) -> Any:
    """A counter that moves when the scheduler steps (None if it has none)."""
    for attr in ("_step_count", "last_epoch"):
        n = getattr(scheduler, attr, None)
        if n is not None:
            return n
    return None
