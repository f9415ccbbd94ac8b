"""Samples: text from `sample_fn` at each eval, newest first (drawn as text, never as HTML)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

MAX_ITEMS = 50


def build(samples: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    items = [{"step": int(s["step"]), "text": str(s["text"])} for s in samples]
    return {"items": items[::-1][:MAX_ITEMS]} if items else {}
