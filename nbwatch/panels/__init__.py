"""Panel builders (records in → plain dict out) and `Feed`, which keeps a run's downsampled
mirror and turns what is new in the store into one update per refresh.

The live widget and the HTML export use the same builders, so they cannot disagree.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..lifecycle import is_ended
from ..store import RunReader
from . import (
    alerts,
    attention,
    baseline,
    clock,
    data,
    grads,
    header,
    health,
    loss,
    metrics,
    ranks,
    samples,
    spikes,
    system,
    weights,
)
from ._common import layers_of
from .downsample import MAX_POINTS, Downsampler, reduce
from .tail import Delta, Tail

WATCH_STEPS = 50  # "watching x%" in the header: over the newest this many steps

PANELS = ("header", "clock", "loss", "ranks", "grads", "weights", "attention", "health", "system",
          "data", "metrics", "alerts", "samples")
MAX_EVENTS = 500


class Feed:
    """The dashboard's view of one run: a bounded mirror, updated by `update()`.

    `update()` returns the panels' new content (or None when nothing arrived);
    `full()` returns everything held, for a view that renders late.
    `maps`: the attention panel carries every head's map of the newest eval (a page with
    no kernel to ask for one: the HTML export); otherwise only the per-head overview.
    """

    def __init__(self, reader: RunReader, max_points: int = MAX_POINTS, maps: bool = False):
        self.tail = Tail(reader)
        self.maps = maps
        self.postmortems = spikes.Postmortems(reader)
        self.baselines = baseline.Baselines(reader.run_dir)
        self.max_points = max_points
        self.series: dict[str, Downsampler] = {}
        self.latest: dict[str, tuple[int, float]] = {}
        # the newest steps' own time and step time: "watching x%" over them (a step's rules
        # and row are recorded in batches, whose cost lands on one step of the next)
        self._own: deque[float] = deque(maxlen=WATCH_STEPS)
        self._took: deque[float] = deque(maxlen=WATCH_STEPS)
        # the header's rates: the median of the newest steps', as steps/s is (one step's
        # reading jumps: a slow one read 4,221 tok/s beside a median of 39.6k)
        self._rates: dict[str, deque[float]] = {k: deque(maxlen=WATCH_STEPS)
                                                for k in header.RATES}
        # The system timeline, by ticks since its first sample (`system.ticks`), and "step".
        self.system: dict[str, Downsampler] = {}
        self.system_t0: float | None = None
        # The newest points of each `rank{r}/...` key, raw: the ranks panel's medians.
        self.recent: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.events: list[dict[str, Any]] = []
        self.error: dict[str, Any] | None = None
        self.columns: dict[str, list[weights.Column]] = {}
        self.seq_len: tuple[int, np.ndarray, np.ndarray] | None = None
        self.attention: dict[str, Any] | None = None
        self.samples: list[dict[str, Any]] = []
        self.meta: dict[str, Any] = {}
        self.step = 0
        self.walls: list[tuple[int, float]] = []
        # what the x axis switch maps steps onto: {"wall": seconds since clock_t0, "tokens"}
        self.clock: dict[str, Downsampler] = {}
        self.clock_t0: float | None = None
        self._tokens = 0.0
        self._ema: tuple[float, int] = (0.0, 0)
        self._heat: tuple[int, list[str]] | None = None  # (bin width, layers) last sent
        self._waiting: dict[str, str] = {}  # the notes of panels with nothing yet, last sent
        self.more = False
        # a rewind, or a resume of the run (a new `started`), dropped steps this mirror
        # holds: it must be read anew
        self.history_cut = False
        self._caught_up = False  # read to the end once (a rewind read before is history)

    @property
    def ended(self) -> bool:
        """The run is over and everything it wrote has been read."""
        return is_ended(str(self.meta.get("state"))) and not self.more

    def update(self, now: float | None = None) -> dict[str, Any] | None:
        d = self.tail.poll()
        self.more = d.more
        now = time.time() if now is None else now
        if d.empty():
            self._caught_up = self._caught_up or not d.more
            if self.baselines.refresh(self.meta, now):  # one picked, or a live one moved
                return {"loss": {"baselines": self.baselines.panel()}}
            return None
        out = self._fold(d, now)
        if self.baselines.refresh(self.meta, now):
            out.setdefault("loss", {})["baselines"] = self.baselines.panel()
        self._caught_up = self._caught_up or not d.more
        return out

    def _fold(self, d: Delta, now: float) -> dict[str, Any]:
        new: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        if "loss/train" in d.scalars:
            s, v = d.scalars["loss/train"]
            sm, self._ema = loss.smooth(v, self._ema)
            d.scalars["loss/train_smooth"] = (s, sm)
        for key, (s, v) in d.scalars.items():
            ds = self.series.get(key) or self.series.setdefault(key, Downsampler(self.max_points))
            ds.extend(s, v)
            # What the browser folds in: the new points already reduced on the same grid.
            new[key] = reduce(s, v, ds.width)
            self.latest[key] = (int(s[-1]), float(v[-1]))
            if key == "time/nbwatch":
                self._own.extend(v.tolist())
            elif key == "time/step":
                self._took.extend(v.tolist())
            elif key in self._rates:
                self._rates[key].extend(v[np.isfinite(v)].tolist())
            if ranks.is_rank_key(key):
                self.recent[key] = ranks.keep_recent(self.recent.get(key), s, v)
        new_cols: dict[str, list[weights.Column]] = {}
        for step, name, edges, counts in d.histograms:
            if name.startswith("weight/"):
                layer = name.removeprefix("weight/")
                new_cols.setdefault(layer, []).append((step, edges, counts))
                self.columns[layer] = weights.thin([*self.columns.get(layer, []),
                                                    (step, edges, counts)])
            elif name == "data/seq_len":
                self.seq_len = (step, edges, counts)
        for e in d.events:
            if e["kind"] == "action" and (e.get("data") or {}).get("command") == "rewind" \
                    and self._caught_up:
                self.history_cut = True
            if e["kind"] == "error":
                self.error = e
            elif e["kind"] == "state" and _state_of(e) == "running":
                self.error = None  # resumed: the old failure is history, not the state
        self.events = (self.events + d.events)[-MAX_EVENTS:]
        self.postmortems.see(d.events)
        postmortems = self.postmortems.ready(self.latest.get("loss/train", (0, 0.0))[0])
        self.samples = (self.samples + d.samples)[-samples.MAX_ITEMS:]
        if d.attention is not None:
            self.attention = d.attention
        if d.meta is not None:
            def opened(m: Mapping[str, Any]) -> Any:  # (`started` before `opened` was kept)
                return m.get("opened", m.get("started"))
            was = opened(self.meta)
            if was is not None and opened(d.meta) != was:  # resumed: steps redone
                self.history_cut = True
            self.meta = d.meta
        new_system = self._fold_system(d)
        new_clock = self._fold_clock(d)
        walls = self.walls = self.tail.recent_walls()
        self.step = walls[-1][0] if walls else int(self.meta.get("step", 0) or 0)
        seq = self.seq_len if any(h[1] == "data/seq_len" for h in d.histograms) else None
        recent = self.recent if any(map(ranks.is_rank_key, d.scalars)) else None
        out = self._build(new, d.events, new_cols, seq, d.attention, d.samples, walls, now,
                          recent, full=False, heat=self._grad_heat(new), system_new=new_system,
                          clock_new=new_clock, postmortems=postmortems)
        return {k: v for k, v in out.items() if v}

    def full(self, now: float | None = None) -> dict[str, Any]:
        series = {k: (ds.steps, ds.values) for k, ds in self.series.items()}
        held = {k: (ds.steps, ds.values) for k, ds in self.system.items()}
        return self._build(series, self.events, self.columns, self.seq_len, self.attention,
                           self.samples, self.walls, time.time() if now is None else now,
                           self.recent, full=True, heat=self._grad_heat(None),
                           system_new=held,
                           clock_new={k: (ds.steps, ds.values) for k, ds in self.clock.items()},
                           postmortems=self.postmortems.panel())

    def _fold_clock(self, d: Delta) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Fold the new steps' walls and token counts into the clock; their points reduced
        on its grid (what the browser folds in)."""
        got: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        if d.walls is not None and len(d.walls[0]):
            steps, walls = d.walls
            if self.clock_t0 is None:
                started = self.meta.get("started")
                self.clock_t0 = float(started) if isinstance(started, (int, float)) \
                    else float(walls[0])
            got["wall"] = (steps, clock.seconds(walls, self.clock_t0))
        if clock.TOKENS in d.scalars:
            s, v = d.scalars[clock.TOKENS]
            total, self._tokens = clock.tokens_seen(s, v, self._tokens)
            got["tokens"] = (s, total.astype(np.float32))
        new = {}
        for key, (s, v) in got.items():
            ds = self.clock.get(key) or self.clock.setdefault(key, Downsampler(self.max_points))
            ds.extend(s, v)
            new[key] = reduce(s, v, ds.width)
        return new

    def _fold_system(self, d: Delta) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Fold the new system samples into the timeline mirror; their points reduced on
        its grid (what the browser folds in), by key, and "step"."""
        got = dict(d.system)
        steps = d.system_steps  # None only where there are no new samples (Tail._system)
        if steps is not None:
            got["step"] = steps
            if self.system_t0 is None:
                self.system_t0 = float(steps[0][0])
        if not got or steps is None or self.system_t0 is None:
            return {}
        new = {}
        for key, (w, v) in got.items():
            x = system.ticks(w, self.system_t0)
            ds = self.system.get(key) or self.system.setdefault(key, Downsampler(self.max_points))
            ds.extend(x, v)
            new[key] = reduce(x, v, ds.width)
            if key != "step":
                self.latest[key] = (int(steps[1][-1]), float(v[-1]))
        return new

    def _grad_heat(self, new: dict[str, tuple[np.ndarray, np.ndarray]] | None
                   ) -> dict[str, Any] | None:
        """The grad-norm heat map's columns that changed (`new`: this refresh's points), or
        all of it (`new` None, or when its bins or layers changed since the last send)."""
        layers = layers_of(self.latest, "grad_norm/")
        moved = None if new is None else [int(new[f"grad_norm/{n}"][0][0]) for n in layers
                                          if len(new.get(f"grad_norm/{n}", ((),))[0])]
        if not layers or moved == []:
            return None
        held = {f"grad_norm/{n}": (ds.steps, ds.values) for n in layers
                if (ds := self.series.get(f"grad_norm/{n}")) is not None}
        h = grads.heat(held, layers, None if moved is None else min(moved))
        if h is not None and moved is not None and self._heat != (h["w"], layers):
            h = grads.heat(held, layers, None)  # the browser's columns no longer fit
        if h is not None:
            self._heat = (h["w"], layers)
        return h

    def header(self, now: float | None = None) -> dict[str, Any]:
        """The header panel alone, from what is held."""
        latest = {k: v for k, (_, v) in self.latest.items()}
        latest.update({k: float(np.median(d)) for k, d in self._rates.items() if d})
        return header.build(self.meta, self.step, self.walls, latest,
                            time.time() if now is None else now, self.error,
                            header.watch_share_of(self._own, self._took))

    def _waits(self, full: bool) -> dict[str, dict[str, str]]:
        """{"attention": {"until": what its page says until a map comes}, "weights": the
        same of the histograms} for the panels that hold none: all of them in a full state,
        in a refresh those that changed (the page keeps the last one)."""
        now = {}
        if not (self.attention and self.attention.get("samples")):
            now["attention"] = attention.waiting(self.meta, self.step)
        if not self.columns:
            now["weights"] = weights.waiting(self.meta)
        send = now if full else {k: v for k, v in now.items() if self._waiting.get(k) != v}
        self._waiting = now
        return {k: {"until": v} for k, v in send.items()}

    def _build(self, series, events, columns, seq_len, att, new_samples, walls, now, recent,
               full: bool, heat: dict[str, Any] | None = None,
               system_new: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
               clock_new: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
               postmortems: dict[str, Any] | None = None) -> dict[str, Any]:
        waits = self._waits(full)
        att_panel = attention.build(att, self.latest, self.maps, events)
        if "note" in att_panel:  # the probe's word on why no map comes (no attention) stands
            waits.pop("attention", None)
        return {
            "header": self.header(now),
            "clock": clock.build(self.clock_t0, clock_new or {}),
            "loss": loss.build(series, events) | (
                {"baselines": self.baselines.panel()} if full and self.baselines.held else {})
            | ({"postmortems": postmortems} if postmortems else {}),
            "ranks": ranks.build(series, recent, events),
            "grads": grads.build(series, self.latest, events, heat),
            "weights": weights.build(columns, series) | waits.get("weights", {}),
            "attention": att_panel | waits.get("attention", {}),
            "health": health.build(series, events),
            "system": system.build(self.latest, system_new, self.system_t0),
            "data": data.build(series, seq_len),
            "metrics": metrics.build(series, full),
            "alerts": alerts.build(events),
            "samples": samples.build(new_samples),
        }


def _state_of(event: dict[str, Any]) -> str | None:
    """The state a `state` event records: its data (older runs: its message's second word)."""
    state = (event.get("data") or {}).get("state")
    if state is None:
        words = str(event.get("message", "")).split()
        state = words[1] if len(words) > 1 and words[0] == "run" else None
    return state
