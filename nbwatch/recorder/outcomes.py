"""A command's one outcome: applied, refused (with the reason) or expired; each handler of
the dispatch table (steering.py) returns one, and the recorder records it as one event."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Applied:
    """The command changed the run: `message` says how (an "action" event, or the event of
    what it made: a checkpoint)."""

    message: str
    kind: str = "action"
    severity: str = "info"
    data: dict[str, Any] = field(default_factory=dict)
    event_data: dict[str, Any] = field(default_factory=dict)
    word = "applied"


@dataclass(frozen=True)
class Refused:
    """The command changed nothing: `reason` says why."""

    reason: str
    data: dict[str, Any] = field(default_factory=dict)
    word = "refused"


@dataclass(frozen=True)
class Expired:
    """The run ended (or had not begun) before the command was taken."""

    reason: str
    data: dict[str, Any] = field(default_factory=dict)
    word = "expired"


Outcome = Applied | Refused | Expired
