"""Step-time split and throughput from timings measured by the runner."""

from __future__ import annotations

from collections.abc import Mapping


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


def batch_samples(batch: object) -> int | None:
    """How many samples a batch holds: the batch dimension of its first tensor (a dict's
    first tensor value, e.g. `input_ids` or a vision model's `pixel_values`; a list's or
    tuple's first tensor; a tensor's own). None where it holds no tensor of 1 dim or more.
    No host sync: a shape only."""
    import torch

    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.ndim else None
    if isinstance(batch, Mapping):  # a dict, or a BatchEncoding
        items = list(batch.values())
    elif isinstance(batch, (list, tuple)):
        items = list(batch)
    else:
        return None
    for x in items:
        if isinstance(x, torch.Tensor) and x.ndim:
            return int(x.shape[0])
    return None
