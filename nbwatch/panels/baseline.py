"""Baselines: other runs drawn faded under this run's loss — their train loss (smoothed,
as the loss panel smooths this run's), val loss and LR — with what differs in their config
on hover. `Monitor(..., baseline="runs/exp0")` names them (kept in the run's meta, so a
reopened run and its export draw them too); the live dashboard's picker adds one of the
runs beside this one. A baseline still being written is read again every few seconds."""

from __future__ import annotations

import json
import logging
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .._flat import flatten
from ..lifecycle import is_live
from ..store import RunReader, is_run_dir
from . import clock, loss
from .downsample import downsample

log = logging.getLogger("nbwatch.panels")
MAX_POINTS = 1000  # a faded line behind the live one: a coarser grid does
MAX_DIFF = 12  # config rows shown on hover
MAX_BESIDE = 50  # runs offered by the picker
FOLLOW_EVERY = 5.0  # s between reads of a baseline that is still live


def check(baseline: str | os.PathLike | Sequence[str | os.PathLike] | None) -> list[Path]:
    """`Monitor(baseline=...)`: one run folder or several → absolute paths; each must hold a
    run (the error names the one that does not)."""
    if baseline is None:
        return []
    given = [baseline] if isinstance(baseline, (str, os.PathLike)) else list(baseline)
    out = []
    for p in given:
        if not isinstance(p, (str, os.PathLike)) or not is_run_dir(Path(p)):
            raise ValueError(f"baseline={p!r} holds no nbwatch run; pass the run_dir of an "
                             "earlier run (e.g. baseline='runs/exp0'), or a list of them")
        out.append(Path(p).absolute())
    return out


# Baselines given to a Monitor of this process, by the run folder they were given for: the
# only ones taken from outside that folder's own parent (see `resolve`).
_ASKED: dict[Path, set[Path]] = {}


def allow(run_dir: Path, baselines: Sequence[Path]) -> None:
    """Let `run_dir`'s dashboard and export, in this process, draw `baselines` (those that
    `Monitor(baseline=...)` was given) wherever they lie."""
    _ASKED[run_dir.resolve()] = {Path(b).resolve() for b in baselines}


def resolve(path: str, run_dir: Path) -> Path | None:
    """Where a baseline named in a run's meta is: the run of that folder name beside
    `run_dir` (in its own `runs/` folder, also once that is copied or moved), or one given
    to this process's Monitor for `run_dir`. A run folder may come from someone else: a
    name that leads anywhere else (an absolute path, `..`, a link out of the folder) is
    dropped with a warning, so that a received run cannot draw (or export) the receiver's
    own runs. None when nothing is drawn."""
    try:
        found = _found(path, run_dir)
    except (OSError, ValueError):  # a crafted name: too long, a NUL byte in it
        found = None
    if found is not None:
        return found
    warnings.warn(f"nbwatch: baseline {path!r} named by {run_dir / 'nbwatch.db'} dropped: no run"
                  f" of that name beside it in {run_dir.parent} (a run folder may name only the"
                  " runs beside it, so one received from elsewhere cannot draw yours); copy the"
                  " baseline there to draw it", stacklevel=2)
    return None


def _found(path: str, run_dir: Path) -> Path | None:
    """The run `path` leads to under `resolve`'s rule, or None."""
    here = run_dir.resolve()
    asked = Path(path).resolve() if Path(path).is_absolute() else None
    if asked is not None and asked in _ASKED.get(here, ()):
        return Path(path) if is_run_dir(asked) else None
    name = Path(path).name
    cand = run_dir.parent / name
    # beside the run as named (runs/exp1, a link to /scratch/exp1) or as it lies: a link
    # that leads out of those folders is not beside it
    folders = {here.parent, run_dir.absolute().parent.resolve()}
    beside = name not in ("", ".", "..") and cand.resolve().parent in folders
    return cand if beside and is_run_dir(cand) and cand.resolve() != here else None


def _text(v: Any) -> str:
    s = v if isinstance(v, str) else json.dumps(v, default=str)
    return s if len(s) <= 60 else s[:59] + "…"


def config_diff(theirs: Mapping[str, Any] | None, ours: Mapping[str, Any] | None,
                max_rows: int = MAX_DIFF) -> list[list[str]]:
    """[[key, baseline's value, this run's value]] where the two configs differ ("–": not
    set), in the baseline's key order, then this run's new keys."""
    a = flatten(theirs) if isinstance(theirs, Mapping) else {}
    b = flatten(ours) if isinstance(ours, Mapping) else {}
    rows = [[k, _text(a[k]) if k in a else "–", _text(b[k]) if k in b else "–"]
            for k in dict.fromkeys([*a, *b]) if a.get(k, _MISSING) != b.get(k, _MISSING)]
    return rows[:max_rows]


_MISSING = object()


def load(path: Path, config: Mapping[str, Any] | None, max_points: int = MAX_POINTS
         ) -> dict[str, Any] | None:
    """One baseline run → {name, path, state, step, train (smoothed at 0.9, over every
    step), raw (its train loss: the page smooths it at the slider's other weights), val,
    lr: {x, y}, diff}; None when its folder cannot be read."""
    reader = None
    try:
        reader = RunReader(path)
        meta = reader.meta()
        series = reader.series(["loss/train", "loss/val", "lr", clock.TOKENS])
        walls = reader.walls()
    except Exception as e:  # noqa: BLE001 - a damaged baseline must not cost this run's view
        log.warning("nbwatch: baseline %s could not be read (%s); not drawn", path, e)
        return None
    finally:
        if reader is not None:
            reader.close()
    out: dict[str, Any] = {"name": str(meta.get("name") or path.name), "path": str(path),
                           "state": str(meta.get("state", "unknown")),
                           "diff": config_diff(meta.get("config"), config)}
    step = 0
    for name, key in (("train", "loss/train"), ("raw", "loss/train"), ("val", "loss/val"),
                      ("lr", "lr")):
        if key not in series or not len(series[key][0]):
            continue
        s, v = series[key]
        if name == "train":
            v, _ = loss.smooth(v)
        s, v = downsample(s, v, max_points)
        out[name] = {"x": s.astype(np.int32), "y": v.astype(np.float32)}
        step = max(step, int(s[-1]))
    out["step"] = step
    # its own clock: on the time and token axes a baseline is drawn by its own walls
    started = meta.get("started")
    if len(walls):
        t0 = float(started) if isinstance(started, (int, float)) else float(walls.iloc[0])
        s, v = downsample(walls.index.to_numpy(), clock.seconds(walls.to_numpy(), t0),
                          max_points)
        out["wall"] = {"x": s.astype(np.int32), "y": v}
    if clock.TOKENS in series:
        s, v = series[clock.TOKENS]
        total, _ = clock.tokens_seen(s, v, 0.0)
        s, v = downsample(s, total.astype(np.float32), max_points)
        out["tokens"] = {"x": s.astype(np.int32), "y": v}
    return out


def beside(run_dir: Path, limit: int = MAX_BESIDE) -> list[str]:
    """Names of the run folders beside `run_dir` (the picker's choices), newest first."""
    parent = run_dir.parent
    try:
        found = [p for p in parent.iterdir() if p.is_dir() and p.name != run_dir.name
                 and is_run_dir(p)]
    except OSError:
        return []
    found.sort(key=lambda p: (p / "nbwatch.db").stat().st_mtime, reverse=True)
    return [p.name for p in found[:limit]]


class Baselines:
    """The baselines of one run's dashboard: those its meta names and the one picked, read
    once (a live one again every FOLLOW_EVERY s)."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.picked: list[str] = []  # names beside run_dir, from the page's picker
        self.held: dict[str, dict[str, Any]] = {}  # resolved path → load()
        self._wanted: list[str] = []
        self._checked = 0.0

    def wanted(self, meta: Mapping[str, Any]) -> list[str]:
        named = meta.get("baselines")
        names = [str(p) for p in named] if isinstance(named, list) else []
        return list(dict.fromkeys([*names, *self.picked]))

    def refresh(self, meta: Mapping[str, Any], now: float) -> bool:
        """Read what is new or due; True when what the page should draw changed."""
        wanted = self.wanted(meta)
        config = meta.get("config") if isinstance(meta.get("config"), Mapping) else None
        if wanted != self._wanted:
            self._wanted = wanted
            self.held = {}
            for name in wanted:
                where = resolve(name, self.run_dir)
                if where is not None and (got := load(where, config)) is not None:
                    self.held[str(where)] = got
            self._checked = now
            return True
        if now - self._checked < FOLLOW_EVERY or not any(
                is_live(b["state"]) for b in self.held.values()):
            return False
        self._checked = now
        moved = False
        for p, b in list(self.held.items()):
            if is_live(b["state"]) and (got := load(Path(p), config)) is not None:
                moved = moved or (got["step"], got["state"]) != (b["step"], b["state"])
                self.held[p] = got
        return moved

    def panel(self) -> list[dict[str, Any]]:
        return list(self.held.values())
