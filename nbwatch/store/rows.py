"""One SQL row per record that is neither a scalar nor a histogram (attention map, event,
sample, command) and the writer's own operations, each a small record too:
`WRITE[type(r)]`. Attention maps are packed (`pack_attention`)."""

from __future__ import annotations

import json
import sqlite3
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..counts import as_python
from ..records import Attention, Command, Event, Sample
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


def pack_attention(weights: np.ndarray) -> tuple[str, bytes]:
    """Attention weights → (encoding, bytes), exact in float16 (what was recorded before;
    the maps `run.attention()` returns keep that precision). Its two byte planes, high bytes
    first (sign, exponent, top of the mantissa: what compresses), zlib-packed; of a causal
    map (square, zero above the diagonal) only the lower triangle. 5-30% smaller than the
    float16 bytes zlib-packed as they lie ("f2+z", still read); most where heads attend
    broadly, as a young model's do. ("u1/255+z", uint8 steps
    of 1/255, is read but no longer written: it lost precision that users rely on.)"""
    w = np.ascontiguousarray(weights, dtype=np.float16)
    encoding = "f2p+z"
    if w.ndim >= 2 and w.shape[-1] == w.shape[-2] and w.shape[-1] > 1:
        upper = np.triu_indices(w.shape[-1], 1)
        if not w[..., upper[0], upper[1]].any():
            lower = np.tril_indices(w.shape[-1])
            w = np.ascontiguousarray(w[..., lower[0], lower[1]])
            encoding = "f2pt+z"
    planes = w.view(np.uint8).reshape(-1, 2)[:, ::-1].T  # little-endian: the high byte last
    return encoding, zlib.compress(planes.tobytes(), 6)


def unpack_attention(encoding: str | None, data: bytes, shape: list[int]) -> np.ndarray:
    """→ float32 weights of `shape`; `encoding` None: schema 2's raw float16."""
    if encoding is None:
        return np.frombuffer(data, dtype=np.float16).reshape(shape).astype(np.float32)
    raw = zlib.decompress(data)
    if encoding == "u1/255+z":
        return (np.frombuffer(raw, dtype=np.uint8).reshape(shape).astype(np.float32)
                / np.float32(255))
    if encoding == "f2+z":
        return np.frombuffer(raw, dtype=np.float16).reshape(shape).astype(np.float32)
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(2, -1)
    values = np.ascontiguousarray(planes[::-1].T).view(np.float16).reshape(-1)
    if encoding == "f2pt+z":
        out = np.zeros(shape, dtype=np.float32)
        lower = np.tril_indices(shape[-1])
        out[..., lower[0], lower[1]] = values.reshape(*shape[:-2], -1)
        return out
    return values.reshape(shape).astype(np.float32)


def _attention(con: sqlite3.Connection, r: Attention) -> None:
    encoding, packed = pack_attention(r.weights)
    con.execute("INSERT INTO attention (step, module, sample, shape, weights, tokens, encoding)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (r.step, r.module, r.sample, json.dumps(list(np.shape(r.weights))), packed,
                 json.dumps(list(r.tokens)) if r.tokens is not None else None, encoding))


def _event(con: sqlite3.Connection, r: Event) -> None:
    con.execute("INSERT INTO events (step, wall, kind, severity, message, data)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (r.step, r.wall, r.kind, r.severity, r.message,
                 json.dumps(r.data, default=as_python)))


def _sample(con: sqlite3.Connection, r: Sample) -> None:
    con.execute("INSERT INTO samples (step, wall, text, content) VALUES (?, ?, ?, ?)",
                (r.step, r.wall, r.text,
                 json.dumps(r.content) if r.content is not None else None))


def _command(con: sqlite3.Connection, r: Command) -> None:
    con.execute(*command_row(r))


def _meta(con: sqlite3.Connection, r: Meta) -> None:
    con.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (r.key, r.value))


def _taken(con: sqlite3.Connection, r: Taken) -> None:
    con.execute("UPDATE commands SET taken = 1 WHERE id = ?", (r.command_id,))


WRITE: dict[type, Callable[[sqlite3.Connection, Any], None]] = {
    Attention: _attention, Event: _event, Sample: _sample,
    Command: _command, Meta: _meta, Taken: _taken,
}
