"""Step-time split and throughput from timings measured by the runner."""

from __future__ import annotations


def timing_figures(
    step_s: float, data_s: float, tokens: float | None, samples: int | None
) -> dict[str, float]:
    """`time/step` (whole step), `time/data` (waiting for the loader), `time/compute` and rates."""
    out = {
        "time/step": step_s,
        "time/data": data_s,
        "time/compute": max(step_s - data_s, 0.0),
    }
    if step_s > 0:
        if tokens is not None:
            out["throughput/tokens_per_s"] = tokens / step_s
        if samples is not None:
            out["throughput/samples_per_s"] = samples / step_s
    return out
