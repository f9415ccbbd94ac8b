"""How nbwatch writes a duration, everywhere Python writes one (`ls`, attach's message, the
export's summary); the page's JS `duration` in js/plot.js writes the same from 10 s up."""

from __future__ import annotations

import math


def duration(seconds: float | None) -> str:
    """'0.2s', '12s', '3m05s', '1h02m'; '–' when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "–"
    if seconds < 10:
        return f"{seconds:.1f}s"
    s = int(round(seconds))
    h, m, sec = s // 3600, s % 3600 // 60, s % 60
    return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s" if m else f"{sec}s"
