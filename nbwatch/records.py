"""The small, immutable records that cross module boundaries (probes → store → panels)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

SEVERITIES = ("info", "warning", "critical")


@dataclass(frozen=True)
class Scalars:
    """All scalars of one step, keyed by `/`-grouped name (`loss/train`, `grad_norm/global`)."""

    step: int
    values: dict[str, float]
    wall: float = field(default_factory=time.time)


@dataclass(frozen=True)
class SystemSample:
    """One reading of the system sampler (`system/...` figures) on the run's wall-clock
    timeline, with `step`, the steps completed when it was taken: many samples may share a
    step (a long compile or eval step), none replaces another."""

    values: dict[str, float]
    step: int
    wall: float = field(default_factory=time.time)


@dataclass(frozen=True)
class Histogram:
    """One histogram of one series at one step: `len(edges) == len(counts) + 1`."""

    step: int
    name: str
    edges: np.ndarray
    counts: np.ndarray


@dataclass(frozen=True)
class Attention:
    """Attention weights of one module for one probe sample: `weights` is [heads, T, S]."""

    step: int
    module: str
    sample: int
    weights: np.ndarray
    tokens: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Event:
    """Something that happened at a step: an action, an alert, a checkpoint, a state change."""

    step: int
    kind: str
    severity: str
    message: str
    data: dict[str, Any] = field(default_factory=dict)
    wall: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, got {self.severity!r}")


@dataclass(frozen=True)
class Sample:
    """What `sample_fn` produced at an eval step: text (a generation from a fixed prompt),
    or an image or a small table (`content`, made by `nbwatch.samples.sample_content`;
    `text` then says what it is)."""

    step: int
    text: str
    wall: float = field(default_factory=time.time)
    content: dict[str, Any] | None = None


class CommandKind(str, Enum):
    """What a command asks; its arguments are in `Command.payload`."""

    PAUSE = "pause"            # {}
    RESUME = "resume"          # {}
    STOP = "stop"              # {}
    CHECKPOINT = "checkpoint"  # {}
    CLIP = "clip"              # {"max_norm": float | None}
    SCALE_LR = "scale_lr"      # {"factor": float}
    REWIND = "rewind"          # {"steps": int, "skip": int}
    SKIP = "skip"              # {"batches": int}

    __hash__ = str.__hash__

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


OUTCOMES = ("applied", "refused", "expired")  # each command ends with exactly one


def new_command_id() -> str:
    return uuid.uuid4().hex[:12]


@dataclass(frozen=True)
class Command:
    """A control request, applied between steps by the recorder's one dispatch table; its
    one outcome event (applied, refused or expired) carries `id` in its data."""

    kind: CommandKind
    payload: dict[str, Any] = field(default_factory=dict)
    source: str = "api"
    id: str = field(default_factory=new_command_id)

    def __post_init__(self) -> None:
        object.__setattr__(self, "payload", dict(self.payload or {}))
        try:
            object.__setattr__(self, "kind", CommandKind(self.kind))
        except ValueError:
            known = ", ".join(k.value for k in CommandKind)
            raise ValueError(f"unknown command {self.kind!r}; known: {known}") from None

    def to_wire(self) -> tuple[str, dict[str, Any], str, str]:
        """Plain values, for another process (a torchrun exchange, the store's row)."""
        return self.kind.value, dict(self.payload), self.source, self.id

    @classmethod
    def from_wire(cls, kind: str, payload: dict[str, Any], source: str, cid: str) -> Command:
        return cls(CommandKind(kind), dict(payload), source, cid)


def branches(events: Sequence[Mapping[str, Any]]) -> list[int]:
    """For each event (oldest first), the branch it is on: N where rewind N later went back
    over its step (that step's records and checkpoints set aside as branch N), 0 on the
    line the run kept."""
    out = [0] * len(events)
    for i, e in enumerate(events):
        d = e.get("data") or {}
        if (e.get("kind") != "action" or d.get("command") != "rewind"
                or not {"branch", "from", "to"} <= d.keys()):
            continue
        for j in range(i):
            if not out[j] and d["to"] < events[j]["step"] <= d["from"]:
                out[j] = int(d["branch"])
    return out
