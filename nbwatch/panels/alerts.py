"""Alerts: a feed of alerts, actions, checkpoints and errors, newest first, with severities."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

FEED_KINDS = ("alert", "action", "command", "checkpoint", "error", "probe")
MAX_ITEMS = 200
ROUTINE = ("periodic", "periodic (Trainer)", "Lightning")  # checkpoints nobody asked for


def build(events: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Events (oldest first) → {"items": newest first, at most MAX_ITEMS}. A routine
    checkpoint (nbwatch's periodic one, a Trainer's `save_steps`, a Lightning
    `ModelCheckpoint`'s) is left out unless it is the best (nobody asked for it; one every
    eval filled the feed): the report's checkpoints table lists them all."""
    items = [{"step": int(e["step"]), "kind": str(e["kind"]), "severity": str(e["severity"]),
              "message": str(e["message"]), "wall": float(e.get("wall", 0.0)),
              **({"reason": str((e.get("data") or {}).get("reason"))}
                 if e["kind"] == "checkpoint" else {}),
              **({"outcome": str((e.get("data") or {}).get("outcome"))}  # refused, expired
                 if e["kind"] == "command" else {})}
             for e in events if e["kind"] in FEED_KINDS and not _routine(e)]
    return {"items": items[::-1][:MAX_ITEMS]} if items else {}


def _routine(e: Mapping[str, Any]) -> bool:
    data = e.get("data") or {}
    return (e["kind"] == "checkpoint" and data.get("reason") in ROUTINE
            and not data.get("best") and e.get("severity") == "info")
