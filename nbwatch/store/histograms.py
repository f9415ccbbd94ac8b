"""Histograms as blocks: the histograms of one layer set for a run of steps in one row.

A step's histograms with the same number of bins form a *layout* (their names, in the
order they arrived: the model's layers). One `hist_blocks` row holds a layout's histograms
for consecutive records of it: steps, counts [steps, names, bins] in the smallest integer
type that holds them (zlib-packed when that is smaller), and edges in the most compact form
that gives them back exactly: the range alone ("range": float32 [lo, hi], the bins
recomputed as the probes compute them), float32, or float64 edges. Schema 2 kept one
`histograms` row per histogram (float64 edges, int64 counts): those are read as they are,
and a writer that opens such a folder rewrites them as blocks (`migrate_histograms`).
"""

from __future__ import annotations

import json
import sqlite3
import zlib
from collections.abc import Iterable

import numpy as np

from ..records import Histogram

# (step, name, edges, counts) of one histogram, read back
Read = tuple[int, str, np.ndarray, np.ndarray]


def range_edges(lo: np.ndarray, hi: np.ndarray, bins: int) -> np.ndarray:
    """Equal-width float32 edges [..., bins + 1] over [lo, hi], computed as
    `probes.weights.binned` computes them (the right edge exact)."""
    k = np.arange(bins + 1, dtype=np.float32)
    e = lo[..., None] + (hi - lo)[..., None] * k / np.float32(bins)
    e[..., -1] = hi
    return e


def encode_edges(edges: np.ndarray) -> tuple[str, bytes]:
    """Edges [n, L, bins + 1] (float64) → (kind, bytes) that decode to them exactly."""
    e32 = edges.astype(np.float32)
    if not np.array_equal(e32.astype(np.float64), edges):
        return "f8", np.ascontiguousarray(edges, dtype=np.float64).tobytes()
    ends = np.ascontiguousarray(e32[..., [0, -1]])
    if np.array_equal(range_edges(ends[..., 0], ends[..., 1], edges.shape[-1] - 1), e32):
        return "range", ends.tobytes()
    return "f4", e32.tobytes()


def decode_edges(kind: str, data: bytes, shape: tuple[int, int], bins: int) -> np.ndarray:
    """→ float64 edges [n, L, bins + 1]."""
    if kind == "range":
        ends = np.frombuffer(data, dtype=np.float32).reshape(*shape, 2)
        return range_edges(ends[..., 0], ends[..., 1], bins).astype(np.float64)
    dtype = np.float32 if kind == "f4" else np.float64
    return np.frombuffer(data, dtype=dtype).reshape(*shape, bins + 1).astype(np.float64)


def encode_counts(counts: np.ndarray, planes: bool = True) -> tuple[str, bytes]:
    """Integer counts → (dtype, bytes): u1/u2/u4 when they fit (i8 else), "+z" when
    zlib makes them smaller; counts of more than a byte as byte planes, low bytes first
    ("p+z": a histogram's neighbouring bins share their high bytes, which then pack to
    almost nothing: ~0.5 of the bytes against ~0.67 zlib-packed as they lie), whichever
    is smallest. `planes=False`: schema 3's forms only."""
    c = counts.astype(np.int64)
    lo, hi = (int(c.min()), int(c.max())) if c.size else (0, 0)
    dtype = "i8"
    if lo >= 0:
        dtype = next((d for d, top in (("u1", 1 << 8), ("u2", 1 << 16), ("u4", 1 << 32))
                      if hi < top), "i8")
    a = np.ascontiguousarray(c, dtype=dtype)
    raw = a.tobytes()
    forms = [(dtype, raw), (dtype + "+z", zlib.compress(raw, 6))]
    if planes and a.itemsize > 1:
        by_byte = a.reshape(-1).view(np.uint8).reshape(-1, a.itemsize).T  # little-endian
        forms.append((dtype + "p+z", zlib.compress(by_byte.tobytes(), 6)))
    return min(forms, key=lambda f: len(f[1]))  # the first of equals: the simplest


def decode_counts(dtype: str, data: bytes, shape: tuple[int, int, int]) -> np.ndarray:
    """→ int64 counts [n, L, bins]; "+z" (zlib-packed as they lie) still read."""
    if dtype.endswith("p+z"):
        dtype = dtype[:-3]
        planes = np.frombuffer(zlib.decompress(data), dtype=np.uint8)
        planes = planes.reshape(np.dtype(dtype).itemsize, -1)
        return np.ascontiguousarray(planes.T).view(dtype).reshape(shape).astype(np.int64)
    if dtype.endswith("+z"):
        dtype, data = dtype[:-2], zlib.decompress(data)
    return np.frombuffer(data, dtype=dtype).reshape(shape).astype(np.int64)


class HistTables:
    """Writes histograms as blocks on one connection, inside the caller's transaction."""

    def __init__(self, con: sqlite3.Connection):
        self.con = con
        self.layouts: dict[tuple[int, tuple[str, ...]], int] = {
            (bins, tuple(json.loads(names))): i
            for i, names, bins in con.execute("SELECT id, names, bins FROM hist_layouts")}

    def layout(self, bins: int, names: tuple[str, ...]) -> int:
        lid = self.layouts.get((bins, names))
        if lid is None:
            cur = self.con.execute("INSERT INTO hist_layouts (names, bins) VALUES (?, ?)",
                                   (json.dumps(list(names)), bins))
            assert cur.lastrowid is not None
            lid = self.layouts[(bins, names)] = cur.lastrowid
        return lid

    def write(self, records: list[Histogram]) -> None:
        """Histograms in arrival order: each step's histograms of one bin count are one
        layout, and a layout's steps in this batch one block."""
        by_step: dict[tuple[int, int], list[Histogram]] = {}
        for r in records:
            by_step.setdefault((r.step, len(r.counts)), []).append(r)
        runs: dict[int, list[list[Histogram]]] = {}  # a layout's steps, in step order
        for (_, bins), hs in sorted(by_step.items(), key=lambda kv: kv[0][0]):
            runs.setdefault(self.layout(bins, tuple(h.name for h in hs)), []).append(hs)
        rows = []
        for lid, steps in runs.items():
            edges = np.stack([np.stack([np.asarray(h.edges, dtype=np.float64) for h in hs])
                              for hs in steps])
            counts = np.stack([np.stack([np.asarray(h.counts) for h in hs]) for hs in steps])
            s = np.array([hs[0].step for hs in steps], dtype=np.int64)
            rows.append((lid, int(s.min()), int(s.max()), s.tobytes(), *encode_edges(edges),
                         *encode_counts(counts)))
        self.con.executemany(
            "INSERT INTO hist_blocks (layout, first, last, steps, edge_kind, edges, count_type,"
            " counts) VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)
        records.clear()


def migrate_histograms(con: sqlite3.Connection) -> None:
    """Rewrite schema 2's one-row-per-histogram table as blocks (ids continue after its
    own, so a follower's cursor stays ordered), inside the caller's transaction."""
    top = con.execute("SELECT MAX(id) FROM histograms").fetchone()[0]
    if top is None:
        return
    records = [Histogram(step, name, np.frombuffer(e, dtype=np.float64),
                         np.frombuffer(c, dtype=np.int64))
               for step, name, e, c in con.execute(
                   "SELECT step, name, edges, counts FROM histograms ORDER BY step, id")]
    con.execute("INSERT OR REPLACE INTO sqlite_sequence (name, seq) VALUES ('hist_blocks', ?)",
                (top,))
    HistTables(con).write(records)
    con.execute("DELETE FROM histograms")


def decode_block(row: tuple, names: tuple[str, ...], bins: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A `hist_blocks` row (…, steps, edge_kind, edges, count_type, counts) as its last
    five columns → (steps [n], edges [n, L, bins + 1] f8, counts [n, L, bins] i8)."""
    steps, edge_kind, edges, count_type, counts = row[-5:]
    s = np.frombuffer(steps, dtype=np.int64)
    shape = (len(s), len(names))
    return (s, decode_edges(edge_kind, edges, shape, bins),
            decode_counts(count_type, counts, (*shape, bins)))


def flatten(rows: Iterable[tuple[np.ndarray, np.ndarray, np.ndarray, tuple[str, ...]]]
            ) -> list[Read]:
    """Decoded blocks → one (step, name, edges, counts) per histogram, block order."""
    out: list[Read] = []
    for s, e, c, names in rows:
        for i, step in enumerate(s.tolist()):
            out += [(step, n, e[i, j], c[i, j]) for j, n in enumerate(names)]
    return out


def truncate(con: sqlite3.Connection, step: int) -> None:
    """Drop every histogram of a step after `step`, inside the caller's transaction."""
    con.execute("DELETE FROM hist_blocks WHERE first > ?", (step,))
    cut = con.execute("SELECT b.id, b.layout, l.names, l.bins, b.steps, b.edge_kind, b.edges,"
                      " b.count_type, b.counts FROM hist_blocks b JOIN hist_layouts l"
                      " ON l.id = b.layout WHERE b.last > ?", (step,)).fetchall()
    for row in cut:
        bid, lid, names, bins = row[:4]
        s, e, c = decode_block(row, tuple(json.loads(names)), bins)
        keep = s <= step  # kept in place: a follower past this row read these steps
        con.execute("UPDATE hist_blocks SET first = ?, last = ?, steps = ?, edge_kind = ?,"
                    " edges = ?, count_type = ?, counts = ? WHERE id = ?",
                    (int(s[keep].min()), int(s[keep].max()), s[keep].tobytes(),
                     *encode_edges(e[keep]), *encode_counts(c[keep]), bid))
