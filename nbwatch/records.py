"""The small, immutable records that cross module boundaries (probes → store → panels)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
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
    """Text produced by `sample_fn` at an eval step (e.g. a generation from a fixed prompt)."""

    step: int
    text: str
    wall: float = field(default_factory=time.time)


@dataclass(frozen=True)
class Command:
    """A control request (pause, resume, stop, checkpoint, clip, scale_lr), run between steps."""

    kind: str
    value: float | None = None
    source: str = "api"
