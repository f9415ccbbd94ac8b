"""Read what is new in a run's store since the last call, by id cursors.

Every query is `WHERE id > cursor` on a primary key, capped at `chunk` rows, so one call
costs what arrived since the previous one, not what the run holds. Each poll reads in
one snapshot (`reader.session()`). A run folder being
written by another process is read the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..store import RunReader
from ..store.blocks import decode


@dataclass
class Delta:
    """What arrived since the previous `Tail.poll()`."""

    scalars: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    histograms: list[tuple[int, str, np.ndarray, np.ndarray]] = field(default_factory=list)
    attention: dict[str, Any] | None = None  # the newest probe step, whole, when it changed
    samples: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] | None = None  # when it changed
    # the system timeline: {key: (walls f8 epoch s, values f4)} and (walls, steps) of the
    # samples, each in wall order
    system: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    system_steps: tuple[np.ndarray, np.ndarray] | None = None
    # (steps i8, walls f8 epoch s) of the steps recorded since: the trend panels' time axes
    walls: tuple[np.ndarray, np.ndarray] | None = None
    more: bool = False  # a chunk cap was hit: poll again at once

    def empty(self) -> bool:
        return not (self.scalars or self.events or self.histograms or self.samples
                    or self.attention is not None or self.meta is not None or self.system
                    or self.walls is not None)


class Tail:
    """Incremental reader of one run folder."""

    def __init__(self, reader: RunReader, chunk: int = 200_000, blocks: int = 4096,
                 max_bytes: int = 32 << 20):
        self.reader = reader
        self.chunk = chunk
        self.blocks = blocks
        self.max_bytes = max_bytes  # of scalar blocks a poll reads: a late view's memory
        self._delivered: dict[int, int] = {}  # layout → highest step handed out
        self._delivered_wall: dict[int, float] = {}  # system layout → newest wall handed out
        self.scalar_id = self.event_id = self.hist_id = self.attn_id = self.sample_id = 0
        self.system_id = self.wall_id = 0
        self._wall_step = 0  # the newest step whose wall was handed out (a merge re-sends)
        self._meta_raw: list[tuple] | None = None

    def poll(self) -> Delta:
        """What arrived since the previous call. The cursors move only when every query has
        succeeded, so a failed poll (sqlite3.OperationalError while the writer is still
        creating the schema) loses nothing: call it again."""
        with self.reader.session():
            return self._poll()

    def _poll(self) -> Delta:
        d = Delta()
        scalar_id, event_id, hist_id, attn_id, sample_id, system_id = (
            self.scalar_id, self.event_id, self.hist_id, self.attn_id, self.sample_id,
            self.system_id)
        rows: list[tuple] = []
        held = 0
        while len(rows) < self.blocks and held < self.max_bytes:
            page = self.reader.block_rows(after_id=scalar_id, limit=4)
            rows += page  # small pages: a merged block holds up to 8 MiB
            held += sum(len(r[4]) for r in page)
            if len(page) < 4:
                break
            scalar_id = page[-1][0]
        else:
            d.more = True
        if rows:
            d.scalars = self._group(rows, self.scalar_id)
            scalar_id = rows[-1][0]
        r = self.reader
        system = r._system_rows(after_id=system_id, limit=self.blocks)
        if system:
            d.more = d.more or len(system) == self.blocks
            d.system, d.system_steps = self._system(system, system_id)
            system_id = system[-1][0]
        wall_id, n_walls, ws, ww = r.walls_since(self.wall_id, self.blocks)
        if n_walls:
            d.more = d.more or n_walls == self.blocks
            new = ws > self._wall_step
            if new.any():
                d.walls = (ws[new], ww[new])
        events = r.events_since(event_id)
        if events:
            event_id = events[-1]["id"]
            d.events = events
        hists = r.histograms_since(hist_id, self.chunk // 100)
        if hists:
            hist_id = hists[-1][0]
            d.more = d.more or len(hists) == self.chunk // 100
            d.histograms = [h[1:] for h in hists]
        newest = r.attention_since(attn_id)
        if newest is not None:
            attn_id = newest[0]
            d.attention = self._attention(newest[1])
        samples = r.samples_since(sample_id)
        if samples:
            sample_id = samples[-1][0]
            d.samples = [{"step": step, "text": text, "content": content}
                         for _, step, text, content in samples]
        meta = r.meta_rows()
        if meta != self._meta_raw:
            self._meta_raw = meta
            d.meta = {k: r.decoded(k, v) for k, v in meta}
        self.scalar_id, self.event_id, self.hist_id, self.attn_id, self.sample_id = (
            scalar_id, event_id, hist_id, attn_id, sample_id)
        self.system_id, self.wall_id = system_id, wall_id
        if d.walls is not None:
            self._wall_step = int(d.walls[0][-1])
        return d

    def _system(self, rows: list[tuple], cursor: int
                ) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]],
                           tuple[np.ndarray, np.ndarray] | None]:
        """System timeline rows → ({key: (walls, values f4)}, (walls, steps)), in wall order.
        A row merged from rows this Tail has partly read brings only the newer samples."""
        acc: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {}
        all_w: list[np.ndarray] = []
        all_s: list[np.ndarray] = []
        for row in rows:
            lay, w, s, v = self.reader.decode_system(row)
            if row[5] is not None and row[5] <= cursor:
                new = w > self._delivered_wall.get(lay.id, -np.inf)
                w, s, v = w[new], s[new], v[new]
            if not len(w):
                continue
            self._delivered_wall[lay.id] = max(self._delivered_wall.get(lay.id, -np.inf),
                                               float(w.max()))
            all_w.append(w)
            all_s.append(s)
            for j, key in enumerate(lay.keys):
                a = acc.get(key) or acc.setdefault(key, ([], []))
                a[0].append(w)
                a[1].append(v[:, j].astype(np.float32))
        out = {}
        for k, (ws, vs) in acc.items():
            w, v = np.concatenate(ws), np.concatenate(vs)
            order = np.argsort(w, kind="stable")
            out[k] = (w[order], v[order])
        if not all_w:
            return out, None
        w, s = np.concatenate(all_w), np.concatenate(all_s)
        order = np.argsort(w, kind="stable")
        return out, (w[order], s[order])

    def _attention(self, step: int) -> dict[str, Any]:
        """Every probe sample of one step: {step, samples: [{tokens, maps: {module: [H,T,S]}}]}."""
        samples = []
        for i in range(self.reader.attention_samples(step)):
            samples.append({"tokens": self.reader.attention_tokens(step, i),
                            "maps": self.reader.attention(step, i)})
        return {"step": step, "samples": samples}

    def recent_walls(self, n: int = 64) -> list[tuple[int, float]]:
        """(step, wall) of the newest `n` recorded steps, oldest first (for rates and ETA)."""
        return self.reader.recent_walls(n)

    def _group(self, rows: list[tuple], cursor: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Block rows → {key: (steps int64, values float32)}, keys in order of first
        appearance (for per-layer keys: the model's depth order), steps in order.

        A block that compaction merged from blocks this Tail has partly read (its
        `merged_from` at or below `cursor`) brings only the steps past those read."""
        per_layout: dict[int, tuple[list[np.ndarray], list[np.ndarray]]] = {}
        for _, lid, first, steps, values, merged_from in rows:
            s, v = decode(first, steps, values, self.reader.layout(lid))
            if merged_from is not None and merged_from <= cursor:
                new = s > self._delivered.get(lid, -1)
                s, v = s[new], v[new]
            if len(s):
                got = per_layout.get(lid) or per_layout.setdefault(lid, ([], []))
                got[0].append(s)
                got[1].append(v)
        acc: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {}
        for lid, (ss, vs) in per_layout.items():
            lay = self.reader.layout(lid)
            s = ss[0] if len(ss) == 1 else np.concatenate(ss)
            v = (vs[0] if len(vs) == 1 else np.concatenate(vs)).astype(np.float32, copy=False)
            self._delivered[lid] = max(self._delivered.get(lid, -1), int(s.max()))
            for j, key in enumerate(lay.keys):
                a = acc.get(key) or acc.setdefault(key, ([], []))
                a[0].append(s)
                a[1].append(v[:, j])
        out = {}
        for k, (ss, vs) in acc.items():
            if len(ss) == 1:
                out[k] = (ss[0], np.ascontiguousarray(vs[0]))
                continue
            # a key in two layouts (a first step's extra keys): interleaved steps
            steps, vals = np.concatenate(ss), np.concatenate(vs)
            order = np.argsort(steps, kind="stable")
            out[k] = (steps[order], vals[order])
        return out
