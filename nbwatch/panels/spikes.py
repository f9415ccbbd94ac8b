"""The loss chart's spike post-mortems: each `loss_spike` alert's post-mortem
(`postmortem.py`: what moved first and its lead, the first layers by gradient norm, and by
update ratio where it is recorded every step, grad_z, the LR and its last move, the
batches, the alerts before), made once by the kernel as `diagnose()`'s timeline lines, and
sent with the loss panel; a click on the spike's marker shows it."""

from __future__ import annotations

import logging
import math
import sqlite3
from collections.abc import Iterable, Mapping
from typing import Any

from ..alerts.postmortem import from_reader, is_spike, timeline
from ..store import RunReader

log = logging.getLogger("nbwatch.panels")
MAX_HELD = 200  # post-mortems kept for a late view (the newest spikes)


class Postmortems:
    """The post-mortems of the spikes a Feed has seen. A spike's is made once the store
    holds its step's scalars (its alert may arrive in a poll before them)."""

    def __init__(self, reader: RunReader):
        self.reader = reader
        self.pending: set[int] = set()
        self.held: dict[int, dict[str, Any]] = {}

    def see(self, events: Iterable[Mapping[str, Any]]) -> None:
        for e in events:
            if is_spike(e.get("kind"), e.get("data")) and int(e["step"]) not in self.held:
                self.pending.add(int(e["step"]))

    def ready(self, upto: int) -> dict[str, dict[str, Any]]:
        """Make the pending post-mortems of spikes at or before step `upto`; the new ones
        by step (a string: a JSON key)."""
        due = sorted(s for s in self.pending if s <= upto)
        if not due:
            return {}
        try:  # the newest MAX_HELD only: those older would be dropped as made
            rows = from_reader(self.reader, due[-MAX_HELD:]).to_dict("records")
        except sqlite3.OperationalError as e:  # a busy store: the next poll tries again
            log.debug("nbwatch dashboard: spike post-mortems not read (%s)", e)
            return {}
        new = {}
        for r in rows:
            step = int(r["step"])
            new[step] = one(r)
        self.pending.difference_update(due)
        self.held.update(new)
        for step in sorted(self.held)[:-MAX_HELD]:
            del self.held[step]
        return {str(k): v for k, v in new.items()}

    def panel(self) -> dict[str, dict[str, Any]]:
        return {str(k): v for k, v in self.held.items()}


def one(row: Mapping[str, Any]) -> dict[str, Any]:
    """A spike's post-mortem as the page shows it: {lines (diagnose()'s timeline), first
    (the signals that moved first), lead (steps before the spike, or None)}."""
    lead = row.get("lead")
    if isinstance(lead, float) and math.isnan(lead):
        lead = None
    return {"lines": timeline(dict(row)).splitlines(),
            "first": [str(f) for f in row.get("first") or []],
            "lead": None if lead is None else int(lead)}
