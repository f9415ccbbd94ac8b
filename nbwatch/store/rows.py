"""One SQL row per record that is not a scalar (histogram, attention map, event, sample,
command) and the writer's own operations, each a small record too: `WRITE[type(r)]`."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..records import Attention, Command, Event, Histogram, Sample
from .schema import command_row


@dataclass(frozen=True)
class Meta:
    """Set one meta key (its value as JSON text)."""

    key: str
    value: str


@dataclass(frozen=True)
class Taken:
    """A command the run has applied: never handed out again."""

    command_id: int


@dataclass(frozen=True)
class Truncate:
    """Drop every record of a step after `step` (a resumed run records them again)."""

    step: int


def _histogram(con: sqlite3.Connection, r: Histogram) -> None:
    con.execute("INSERT INTO histograms (step, name, edges, counts) VALUES (?, ?, ?, ?)",
                (r.step, r.name, np.ascontiguousarray(r.edges, dtype=np.float64).tobytes(),
                 np.ascontiguousarray(r.counts, dtype=np.int64).tobytes()))


def _attention(con: sqlite3.Connection, r: Attention) -> None:
    w = np.ascontiguousarray(r.weights, dtype=np.float16)
    con.execute("INSERT INTO attention (step, module, sample, shape, weights, tokens)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (r.step, r.module, r.sample, json.dumps(list(w.shape)), w.tobytes(),
                 json.dumps(list(r.tokens)) if r.tokens is not None else None))


def _event(con: sqlite3.Connection, r: Event) -> None:
    con.execute("INSERT INTO events (step, wall, kind, severity, message, data)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (r.step, r.wall, r.kind, r.severity, r.message, json.dumps(r.data, default=str)))


def _sample(con: sqlite3.Connection, r: Sample) -> None:
    con.execute("INSERT INTO samples (step, wall, text) VALUES (?, ?, ?)",
                (r.step, r.wall, r.text))


def _command(con: sqlite3.Connection, r: Command) -> None:
    con.execute(*command_row(r))


def _meta(con: sqlite3.Connection, r: Meta) -> None:
    con.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (r.key, r.value))


def _taken(con: sqlite3.Connection, r: Taken) -> None:
    con.execute("UPDATE commands SET taken = 1 WHERE id = ?", (r.command_id,))


WRITE: dict[type, Callable[[sqlite3.Connection, Any], None]] = {
    Histogram: _histogram, Attention: _attention, Event: _event, Sample: _sample,
    Command: _command, Meta: _meta, Taken: _taken,
}
