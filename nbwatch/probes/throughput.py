"""Step-time split and throughput: what each loop's step records as time/* and throughput/*."""

from __future__ import annotations

from collections.abc import Mapping


def timing_figures(step_s: float, data_s: float | None = None) -> dict[str, float]:
    """`time/step` (the whole step, boundary to boundary) and, where nbwatch iterates the
    data, `time/data` (waiting for the loader) and `time/compute` (the rest)."""
    out = {"time/step": step_s}
    if data_s is not None:
        out["time/data"] = data_s
        out["time/compute"] = max(step_s - data_s, 0.0)
    return out


def add_rates(values: dict[str, float], samples: int | None) -> None:
    """The step's throughput, the one place it is computed for every loop: samples/s from
    its sample count, tokens/s from `tokens/real` (real tokens, padding excluded), both
    over `time/step`."""
    step_s = values.get("time/step")
    if not step_s or step_s <= 0:
        return
    if samples:
        values["throughput/samples_per_s"] = samples / step_s
    tokens = values.get("tokens/real")
    if tokens is not None:
        values["throughput/tokens_per_s"] = tokens / step_s


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
