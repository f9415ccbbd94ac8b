"""Ranks (torchrun / DDP): per-rank step time and tokens/s over the recent window, the
slowest rank, the straggler warning, per-rank loss and time in nbwatch's exchange over time.

Rank 0 stores `rank{r}/<figure>` columns (see `nbwatch.distributed.RANK_KEYS`). A run of one
process has none, and the panel is absent.

"Busy" is time/busy (from the step's start to its last training forward's end; under
`start()`, time/data + time/forward): the part of a step a rank spends on its own. The rest
of time/step is mostly waiting for the slowest rank in DDP's gradient all-reduce, so every
rank's total looks alike and only "busy" tells who holds the others up (the same figure the
straggler alert rule compares).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from ._common import Series, trace

WINDOW = 50  # recorded steps per rank the bars summarise (their median; time/sync: mean)
RANK_KEY = re.compile(r"^rank(\d+)/(.+)$")
# Bar figures: output name → the per-rank figure (medians over the window, None when absent).
FIGURES = {"step_s": "time/step", "data_s": "time/data", "forward_s": "time/forward",
           "tokens_per_s": "throughput/tokens_per_s", "sync_s": "time/sync",
           "mem_gb": "gpu/mem_gb"}
LINES = {"loss": "loss", "sync": "time/sync"}  # per-rank traces over time


def is_rank_key(key: str) -> bool:
    return RANK_KEY.match(key) is not None


def ranks_of(keys: Iterable[str]) -> list[int]:
    """The ranks that have `rank{r}/...` keys, sorted."""
    return sorted({int(m.group(1)) for k in keys if (m := RANK_KEY.match(k))})


def keep_recent(old: tuple[np.ndarray, np.ndarray] | None, steps: np.ndarray,
                values: np.ndarray, n: int = WINDOW) -> tuple[np.ndarray, np.ndarray]:
    """The newest `n` (step, value) points of `old` followed by the new ones."""
    if old is not None:
        steps, values = np.concatenate([old[0], steps]), np.concatenate([old[1], values])
    return steps[-n:], values[-n:]


def _stat(v: np.ndarray | None, how: Callable[[np.ndarray], Any] = np.median
          ) -> float | None:
    """`how` (median) of the finite values, None when there are none."""
    if v is None:
        return None
    v = np.asarray(v, dtype=np.float64)
    v = v[np.isfinite(v)]
    return float(how(v)) if len(v) else None


def _busy(recent: Series, r: int) -> float | None:
    """Median over the window of time/busy, else (start()) of data + forward, summed step
    by step."""
    busy = recent.get(f"rank{r}/time/busy")
    if busy is not None:
        return _stat(busy[1])
    d, f = recent.get(f"rank{r}/time/data"), recent.get(f"rank{r}/time/forward")
    if f is None:
        return None
    if d is None:
        return _stat(f[1])
    _, di, fi = np.intersect1d(d[0], f[0], return_indices=True)
    return _stat(d[1][di].astype(np.float64) + f[1][fi])


def bars(recent: Series) -> dict[str, Any]:
    """Per-rank medians of `recent` ({`rank{r}/...`: (steps, values)}, the newest WINDOW
    points of each) and the slowest rank by busy time (or by step time, lacking it).

    time/sync is the mean: the exchange happens every `rank_every` steps and records 0 on
    the others, so its mean is its cost per step."""
    ranks = ranks_of(recent)
    out: dict[str, Any] = {"ranks": ranks}
    for name, fig in FIGURES.items():
        how = np.mean if fig == "time/sync" else np.median
        vals = [_stat(recent[k][1], how) if (k := f"rank{r}/{fig}") in recent else None
                for r in ranks]
        if any(v is not None for v in vals):
            out[name] = vals
    out["busy_s"] = [_busy(recent, r) for r in ranks]
    steps = [int(s[-1]) for s, _ in recent.values() if len(s)]
    out["to_step"] = max(steps) if steps else None
    out["window"] = max((len(s) for s, _ in recent.values()), default=0)
    by = out["busy_s"] if any(v is not None for v in out["busy_s"]) else out.get("step_s")
    if by and any(v is not None for v in by):
        t = np.array([np.nan if v is None else v for v in by])
        i = int(np.nanargmax(t))
        others = np.delete(t, i)
        base = float(np.nanmedian(others)) if np.isfinite(others).any() else float("nan")
        out["slowest"] = ranks[i]
        out["slower_by"] = float(t[i] / base - 1) if base > 0 else None
    return out


def straggler(events: Iterable[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The newest straggler alert: {step, message}."""
    found = None
    for e in events:
        if e["kind"] == "alert" and (e.get("data") or {}).get("rule", _rule_of(e)) == "straggler":
            found = {"step": int(e["step"]), "message": str(e["message"])}
    return found


def build(series: Series, recent: Series | None, events: Iterable[Mapping[str, Any]] = ()
          ) -> dict[str, Any]:
    """`series`: the (downsampled) traces, new or whole; `recent`: the newest WINDOW points of
    every `rank{r}/...` key, or None when none arrived (the bars are then not resent).

    {} for a run of one rank. Otherwise: the bars' per-rank medians (`ranks`, `busy_s`,
    `step_s`, `data_s`, `forward_s`, `tokens_per_s`, `sync_s`, `mem_gb` where recorded),
    `slowest` and `slower_by`, `straggler`, and `loss`/`sync` traces by rank."""
    out: dict[str, Any] = {}
    if recent and len(ranks_of(recent)) > 1:
        out.update(bars(recent))
    ranks = ranks_of(series)
    if len(ranks) > 1 or "ranks" in out:
        for name, fig in LINES.items():
            lines = {str(r): t for r in ranks if (t := trace(series, f"rank{r}/{fig}"))}
            if name == "sync":  # only the steps where the exchange ran
                lines = {r: {"x": t["x"][m], "y": t["y"][m]} for r, t in lines.items()
                         if (m := t["y"] > 0).any()}
            if lines:
                out[name] = lines
    if (s := straggler(events)) is not None:
        out["straggler"] = s
    return out


def _rule_of(event: Mapping[str, Any]) -> str:
    """An alert's rule for a run recorded before alerts carried it: its message's prefix."""
    return str(event.get("message", "")).split(":", 1)[0]
