"""Transformer health: the early signs of a loss spike or divergence, from the eval-time
probe pass (never a training step), and the rules that watch them."""

from __future__ import annotations

from .rules import Rule


def rules() -> list[Rule]:
    """The health rules, appended to `alerts.default_rules()`."""
    return []
