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
    eval filled the feed), and routine best ones one after another in the feed are one item,
    "best checkpoint ×N, last at step S" (`routine`, `count`, `first`: js/views/alerts.js
    folds a refresh's into the item before it the same way). The report's checkpoints table
    lists them all."""
    items: list[dict[str, Any]] = []
    for e in events:
        if e["kind"] not in FEED_KINDS or _routine(e):
            continue
        data = e.get("data") or {}
        it = {"step": int(e["step"]), "kind": str(e["kind"]), "severity": str(e["severity"]),
              "message": str(e["message"]), "wall": float(e.get("wall", 0.0)),
              **({"reason": str(data.get("reason"))} if e["kind"] == "checkpoint" else {}),
              **({"outcome": str(data.get("outcome"))}  # refused, expired
                 if e["kind"] == "command" else {})}
        if _routine_best(e):
            it |= {"routine": True, "count": 1, "first": it["step"]}
            if items and items[-1].get("routine"):
                it = fold(items.pop(), it)
        items.append(it)
    return {"items": items[::-1][:MAX_ITEMS]} if items else {}


def fold(older: Mapping[str, Any], newer: Mapping[str, Any]) -> dict[str, Any]:
    """Two feed items of routine best checkpoints, one after the other → one."""
    n = int(older["count"]) + int(newer["count"])
    return {**newer, "count": n, "first": older["first"],
            "message": f"best checkpoint ×{n}, last at step {newer['step']}"}


def _routine(e: Mapping[str, Any]) -> bool:
    data = e.get("data") or {}
    return (e["kind"] == "checkpoint" and data.get("reason") in ROUTINE
            and not data.get("best") and e.get("severity") == "info")


def _routine_best(e: Mapping[str, Any]) -> bool:
    """A best checkpoint nobody asked for: saved on a schedule, the newest best so far."""
    data = e.get("data") or {}
    return (e["kind"] == "checkpoint" and data.get("reason") in ROUTINE
            and bool(data.get("best")) and e.get("severity") == "info")
