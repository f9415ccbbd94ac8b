"""The export's extra sections (records in → plain lists out): a summary, the alerts and
actions table, the loss spikes' post-mortems, the checkpoints table, config and environment
as key/value rows."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import PurePath
from typing import Any

from .._flat import flatten
from ..alerts.postmortem import timeline
from ..text import duration

MAX_ROWS = 1000
MAX_CHARS = 2000  # one cell: a config value that is a long list is cut, not dropped
TABLE_KINDS = ("alert", "action", "error")


def _text(v: Any, max_chars: int = MAX_CHARS) -> str:
    s = v if isinstance(v, str) else json.dumps(v, default=str, ensure_ascii=False)
    return s if len(s) <= max_chars else s[: max_chars - 1] + "…"


def key_values(d: Mapping[str, Any] | None, max_rows: int = MAX_ROWS) -> list[list[str]]:
    """A (nested) mapping → [[dotted key, value as text]], at most `max_rows`."""
    if not isinstance(d, Mapping):
        return []
    return [[_text(k, 200), _text(v)] for k, v in list(flatten(d).items())[:max_rows]]


def events_table(events: Iterable[Mapping[str, Any]], total: int) -> dict[str, Any]:
    """Events, newest first (already capped by the caller) → {rows: [step, kind, severity,
    message], total}."""
    rows = [[int(e["step"]), str(e["kind"]), str(e["severity"]), _text(e["message"])]
            for e in events]
    return {"rows": rows, "total": int(total)}


def checkpoints_table(events: Iterable[Mapping[str, Any]], total: int,
                      kept: set[str] | None = None) -> dict[str, Any]:
    """Checkpoint events, newest first → {rows: [step, file, size, seconds, best, reason,
    kept], total}; `kept`: the files in the run's checkpoints folder, by their path in it
    (rotation deletes the older ones; rewind N sets those it went back over aside in
    `rewind/N/`, an event's `branch`); an event's `present`: whether a framework's own
    save, outside that folder, is still there (a top-k or `save_total_limit` deletes)."""
    rows = []
    for e in events:
        d = e.get("data") or {}
        name = PurePath(str(d.get("path", ""))).name
        branch = e.get("branch") or 0
        here = f"rewind/{branch}/{name}" if branch else name
        size = d.get("bytes")
        secs = d.get("seconds")
        rows.append([
            int(e["step"]), name,
            f"{size / 2**20:.1f} MiB" if isinstance(size, (int, float)) else None,
            f"{secs:.2f}" if isinstance(secs, (int, float)) else None,
            "best" if d.get("best") else "",
            str(d.get("reason", "")),
            "failed" if d.get("failed") else
            ("yes" if e["present"] else "deleted") if "present" in e else
            None if kept is None else "rotated out" if here not in kept else
            f"set aside (rewind {branch})" if branch else "yes",
        ])
    return {"rows": rows, "total": int(total)}


def summary(meta: Mapping[str, Any], step: int, best_val: tuple[int, float] | None,
            tokens: float | None, wall_s: float | None) -> list[list[str]]:
    """[[label, value]]: state, steps, best val loss and its step, tokens seen, wall time,
    model and optimizer."""
    raw_run = meta.get("run")
    run: Mapping[str, Any] = raw_run if isinstance(raw_run, Mapping) else {}
    max_steps = meta.get("max_steps")
    rows = [
        ["state", str(meta.get("state", "unknown"))],
        ["steps", f"{step:,}" + (f" / {int(max_steps):,}" if max_steps else "")],
        ["best val loss", f"{best_val[1]:.4f} at step {best_val[0]:,}" if best_val else "–"],
        ["tokens seen", f"{tokens:,.0f}" if tokens is not None else "–"],
        ["wall time", duration(wall_s)],
    ]
    if run.get("model"):
        params, trained = run.get("parameters"), run.get("trainable")
        count = f" ({params:,} parameters" if isinstance(params, int) else ""
        # a LoRA, a frozen backbone: the weights that train
        if isinstance(params, int) and isinstance(trained, int) and trained < params:
            count += f", {trained:,} trainable"
        rows.append(["model", str(run["model"]) + (count and count + ")")])
    if run.get("optimizer"):
        rows.append(["optimizer", str(run["optimizer"]) + (
            f" + {run['scheduler']}" if run.get("scheduler") else "")])
    return [[k, _text(v, 300)] for k, v in rows]


def spikes_table(spikes: Any, total: int | None = None, max_rows: int = MAX_ROWS
                 ) -> dict[str, Any]:
    """`run.spikes` (or its first rows, of `total`) → {rows: [step, loss, z, moved first,
    lead, timeline], total}."""
    rows = []
    for r in spikes.to_dict("records")[:max_rows]:
        lead = r.get("lead")
        rows.append([int(r["step"]), f"{r['loss']:.4g}", f"{r['z']:.1f}",
                     ", ".join(r.get("first") or []) or None,
                     None if lead is None or lead != lead else int(lead),
                     _text(timeline(r))])
    return {"rows": rows, "total": len(spikes) if total is None else total}
