"""Nested mappings as dotted keys (config tables, config comparisons)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"optim": {"lr": 1e-3}} → {"optim.lr": 1e-3}."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out
