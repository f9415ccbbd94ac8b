"""Reading the records that are not scalars (events, samples, histograms, attention maps,
commands) from a run folder: the part of `RunReader` that needs nothing but its `query`."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import pandas as pd

from ..records import Command
from .histograms import decode_block, flatten
from .rows import unpack_attention

COMMANDS_SQL = ("SELECT id, wall, kind, source, payload, cid FROM commands"
                " WHERE taken = 0 AND id > ? ORDER BY id")

class RecordReads:
    """Part of `RunReader`: every method reads through `query` alone (`session` and
    `last_wall` are RunReader's too)."""

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        raise NotImplementedError

    def session(self) -> AbstractContextManager[None]:
        raise NotImplementedError

    def last_wall(self) -> float | None:
        raise NotImplementedError

    # -- the other record kinds ---------------------------------------------------------
    def events(self, after_id: int = 0) -> pd.DataFrame:
        rows = self.query(
            "SELECT id, step, wall, kind, severity, message, data FROM events WHERE id > ?"
            " ORDER BY id",
            (after_id,),
        )
        df = pd.DataFrame(
            rows, columns=["id", "step", "wall", "kind", "severity", "message", "data"]
        )
        df["data"] = [json.loads(d) for d in df["data"]]
        return df

    def samples(self) -> pd.DataFrame:
        """What `sample_fn` returned at each eval: step, wall, text, and `content` (an
        image's PNG or a table's rows, as a dict; None for text)."""
        rows = self.query(f"SELECT step, wall, text, {self._content()} FROM samples ORDER BY id")
        df = pd.DataFrame([r[:3] for r in rows], columns=["step", "wall", "text"])
        # each row by its kind, from the rows themselves: a column of text rows' NULLs and
        # JSON strings would read the NULLs as NaN
        df["content"] = pd.Series([json.loads(r[3]) if r[3] is not None else None
                                   for r in rows], dtype=object)
        return df

    def _content(self) -> str:
        """The samples' content column, or NULL in a folder made before it existed."""
        return "content" if self._has("samples", "content") else "NULL"

    def _has(self, table: str, column: str | None = None) -> bool:
        """Whether the folder has `table` (and its `column`): a folder of an older nbwatch
        that no writer of this one opened lacks what later schemas added."""
        if column is None:
            return bool(self.query(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)))
        return any(r[1] == column for r in self.query(f"PRAGMA table_info({table})"))

    def _hist_layouts(self) -> dict[int, tuple[tuple[str, ...], int]]:
        """{layout id: (names, bins)} of the histogram blocks."""
        if not self._has("hist_layouts"):
            return {}
        return {i: (tuple(json.loads(n)), b)
                for i, n, b in self.query("SELECT id, names, bins FROM hist_layouts ORDER BY id")}

    def histogram_names(self) -> list[str]:
        with self.session():
            old = [r[0] for r in self.query("SELECT DISTINCT name FROM histograms ORDER BY id")]
            layouts = self._hist_layouts()
        return list(dict.fromkeys([*old, *(n for names, _ in layouts.values() for n in names)]))

    def histograms(self, name: str) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
        """(steps, bin_edges per step, counts [steps, bins]) of one histogram series."""
        with self.session():
            got: list[tuple[int, np.ndarray, np.ndarray]] = [
                (s, np.frombuffer(e, dtype=np.float64), np.frombuffer(c, dtype=np.int64))
                for s, e, c in self.query("SELECT step, edges, counts FROM histograms"
                                          " WHERE name = ? ORDER BY step", (name,))]
            layouts = {i: lay for i, lay in self._hist_layouts().items() if name in lay[0]}
            rows = self.query(
                "SELECT layout, steps, edge_kind, edges, count_type, counts FROM hist_blocks"
                f" WHERE layout IN ({','.join('?' * len(layouts))}) ORDER BY first, id",
                list(layouts)) if layouts else []
        for row in rows:
            names, bins = layouts[row[0]]
            s, e, c = decode_block(row, names, bins)
            j = names.index(name)
            got += zip(s.tolist(), e[:, j], c[:, j])
        if not got:
            raise KeyError(f"no histogram series {name!r} in this run ("
                           + named(name, self.histogram_names()) + ")")
        got.sort(key=lambda g: g[0])  # stable: a step's order of writing kept
        return (np.array([g[0] for g in got], dtype=np.int64), [g[1] for g in got],
                np.stack([g[2] for g in got]))

    def attention_steps(self) -> list[int]:
        return [r[0] for r in self.query("SELECT DISTINCT step FROM attention ORDER BY step")]

    def attention(self, step: int | None = None, sample: int = 0) -> dict[str, np.ndarray]:
        """{module path: weights [heads, T, S]} at the newest (or given) probe step."""
        if step is None:
            steps = self.attention_steps()
            if not steps:
                return {}
            step = steps[-1]
        with self.session():
            encoding = "encoding" if self._has("attention", "encoding") else "NULL"
            rows = self.query(
                f"SELECT module, shape, weights, {encoding} FROM attention WHERE step = ?"
                " AND sample = ? ORDER BY id", (step, sample))
        return {m: unpack_attention(enc, w, json.loads(s)) for m, s, w, enc in rows}

    def attention_tokens(self, step: int, sample: int = 0) -> list[str] | None:
        rows = self.query(
            "SELECT tokens FROM attention WHERE step = ? AND sample = ? LIMIT 1", (step, sample)
        )
        return json.loads(rows[0][0]) if rows and rows[0][0] else None

    # -- what a follower reads since its cursors (panels/tail.py) ------------------------
    def events_since(self, after_id: int) -> list[dict[str, Any]]:
        """Events with an id above `after_id`, oldest first, each a dict with its id."""
        rows = self.query("SELECT id, step, wall, kind, severity, message, data FROM events"
                          " WHERE id > ? ORDER BY id", (after_id,))
        return [{"id": r[0], "step": r[1], "wall": r[2], "kind": r[3], "severity": r[4],
                 "message": r[5], "data": json.loads(r[6])} for r in rows]

    def histograms_since(self, after_id: int, limit: int
                         ) -> list[tuple[int, int, str, np.ndarray, np.ndarray]]:
        """(id, step, name, edges, counts) of the histograms of at most `limit` rows past
        `after_id` (a row of schema 2's table holds one, a block a layout's for its steps;
        the id is the row's)."""
        with self.session():
            rows = self.query("SELECT id, step, name, edges, counts FROM histograms"
                              " WHERE id > ? ORDER BY id LIMIT ?", (after_id, limit))
            if rows:
                return [(r[0], r[1], r[2], np.frombuffer(r[3], dtype=np.float64),
                         np.frombuffer(r[4], dtype=np.int64)) for r in rows]
            if not self._has("hist_blocks"):
                return []
            blocks = self.query("SELECT id, layout, steps, edge_kind, edges, count_type, counts"
                                " FROM hist_blocks WHERE id > ? ORDER BY id LIMIT ?",
                                (after_id, limit))
            layouts = self._hist_layouts() if blocks else {}
        out = []
        for row in blocks:
            names, bins = layouts[row[1]]
            out += [(row[0], *h) for h in flatten([(*decode_block(row, names, bins), names)])]
        return out

    def attention_since(self, after_id: int) -> tuple[int, int] | None:
        """(newest id, newest step) of attention maps past `after_id`, or None."""
        rows = self.query("SELECT MAX(id), MAX(step) FROM attention WHERE id > ?", (after_id,))
        return (int(rows[0][0]), int(rows[0][1])) if rows and rows[0][0] is not None else None

    def attention_samples(self, step: int) -> int:
        """How many probe samples the attention maps of `step` hold."""
        n = self.query("SELECT MAX(sample) FROM attention WHERE step = ?", (step,))[0][0]
        return int(n) + 1 if n is not None else 0

    def samples_since(self, after_id: int) -> list[tuple[int, int, str, dict | None]]:
        """(id, step, text, content) of the samples past `after_id`."""
        return [(i, s, t, json.loads(c) if c is not None else None) for i, s, t, c in self.query(
            f"SELECT id, step, text, {self._content()} FROM samples WHERE id > ? ORDER BY id",
            (after_id,))]

    def meta_rows(self) -> list[tuple[str, str]]:
        """Meta as stored (key, JSON text), by key: cheap to compare between polls."""
        return [tuple(r) for r in self.query("SELECT key, value FROM meta ORDER BY key")]

    def events_of(self, kinds: Sequence[str], limit: int) -> tuple[list[dict[str, Any]], int]:
        """The newest `limit` events of `kinds` (newest first), and how many there are."""
        marks = ",".join("?" * len(kinds))
        total = self.query(f"SELECT COUNT(*) FROM events WHERE kind IN ({marks})", kinds)[0][0]
        rows = self.query(f"SELECT step, kind, severity, message, data, id FROM events WHERE"
                          f" kind IN ({marks}) ORDER BY id DESC LIMIT ?", (*kinds, limit))
        return [{"step": r[0], "kind": r[1], "severity": r[2], "message": r[3],
                 "data": json.loads(r[4]), "id": r[5]} for r in rows], int(total)

    def last_error(self) -> tuple[str, dict[str, Any]] | None:
        """(message, data) of the newest `error` event."""
        rows = self.query("SELECT message, data FROM events WHERE kind = 'error'"
                          " ORDER BY id DESC LIMIT 1")
        return (rows[0][0], json.loads(rows[0][1])) if rows else None

    def last_signs_of_life(self) -> tuple[float | None, float | None, float | None]:
        """Wall times of the newest step, the newest event and the sampler's heartbeat."""
        with self.session():
            step_wall = self.last_wall()
            rows = self.query("SELECT (SELECT MAX(wall) FROM events),"
                              " (SELECT value FROM meta WHERE key = 'heartbeat')")
        event_wall, beat = rows[0] if rows else (None, None)
        return step_wall, event_wall, float(json.loads(beat)) if beat is not None else None

    def command_rows(self, after_id: int = 0, fresh: bool = False) -> list[tuple]:
        """The rows of the commands not yet taken, with an id above `after_id`."""
        try:
            return self.query(COMMANDS_SQL, (after_id,))
        except sqlite3.OperationalError:  # a store of an older nbwatch: no payload column
            return []

    def pending_commands(self, after_id: int = 0, fresh: bool = False
                         ) -> list[tuple[int, float, Command | str]]:
        """Commands not yet taken (with an id above `after_id`: `taken` is committed late):
        (row id, wall, command), or the reason in place of a command that cannot be read
        (a kind this version does not know, or a row of an older nbwatch). `fresh`: read
        now, not what the run's writer read last (`RunStore.command_rows`)."""
        rows = self.command_rows(after_id, fresh)
        out: list[tuple[int, float, Command | str]] = []
        for rid, wall, kind, source, payload, cid in rows:
            try:
                cmd: Command | str = Command.from_wire(kind, json.loads(payload or "{}"),
                                                       source, cid or f"row{rid}")
            except (ValueError, TypeError) as e:
                cmd = f"command row {rid} ({kind!r}) cannot be read: {e}"
            out.append((rid, float(wall), cmd))
        return out


def named(name: str, known: list[str], show: int = 8) -> str:
    """The names a run holds, for an error about `name`: the closest first, then the
    others up to `show`, and how many more there are."""
    import difflib

    if not known:
        return "none recorded yet"
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    shown = list(dict.fromkeys([*close, *known]))[:show]
    more = len(known) - len(shown)
    return ("did you mean " + " or ".join(map(repr, close)) + "? " if close else "") + (
        "known: " + ", ".join(shown) + (f", … and {more} more" if more else ""))
