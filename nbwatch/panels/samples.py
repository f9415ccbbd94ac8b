"""Samples: what `sample_fn` returned at each eval, newest first: text (drawn as text,
never as HTML), an image (its PNG) or a table (its rows)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

MAX_ITEMS = 50


def build(samples: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    items = [{"step": int(s["step"]), "text": str(s["text"]),
              **({"content": s["content"]} if s.get("content") else {})} for s in samples]
    return {"items": items[::-1][:MAX_ITEMS]} if items else {}
