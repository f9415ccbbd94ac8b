"""The options of a run, in one place: `Monitor(...)` sets them, `start()` (and the
framework adapters, through the Monitor's keywords) override them one by one, and the run
records the ones in force (`run.meta["options"]`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

from torch import nn

from .recorder.spec import RunSpec


def check_peak_flops(peak: float | None) -> float | None:
    """`Monitor(peak_flops=...)`: the device's peak FLOP/s (e.g. 989e12), or None."""
    if peak is None:
        return None
    if isinstance(peak, bool) or not isinstance(peak, (int, float)) or not (
            0 < peak < float("inf")):
        raise ValueError(f"peak_flops must be the device's peak FLOP/s, a positive number "
                         f"such as 989e12 (an H100 SXM at bf16), or None; got {peak!r}")
    return float(peak)


@dataclass(frozen=True)
class Options:
    """What a run records and how often; every loop (start(), run(), a loop of your own,
    the Trainer and Lightning) takes the same ones."""

    max_steps: int | None = None  # a loop of your own: for the progress bar and ETA
    hist_every: int = 50  # weight/grad histograms every N steps
    update_every: int | None = None  # update ratios every N steps (None: with hist_every)
    checkpoint_every: int | None = None  # periodic checkpoints (evals checkpoint too)
    log_every: int = 50  # a line in the run log every N steps
    clip: float | None = None  # clip the global gradient norm from step 1
    probe_batch: Any = None  # the attention probe's fixed samples
    probe_fn: Callable[[nn.Module, Any], Any] | None = None  # its forward pass
    probe_tokens: list[list[str]] | None = None  # its token labels
    attention_samples: int = 2  # 0: no attention probe
    attention_tokens: int = 64
    rank_every: int = 10  # torchrun: the ranks meet every N steps
    dist_timeout: float = 60.0  # torchrun: a rank silent this long ends the run
    display: bool | None = None  # the dashboard in the cell (None: in a notebook)
    peak_flops: float | None = None  # the device's peak FLOP/s for MFU (None: by its name)

    def merged(self, **given: Any) -> Options:
        """These options with those given overridden; None means "not given"."""
        unknown = set(given) - {f.name for f in fields(self)}
        if unknown:
            raise TypeError(f"unknown option(s) {sorted(unknown)}")
        return replace(self, **{k: v for k, v in given.items() if v is not None})

    def spec(self) -> RunSpec:
        """What a run records, from these options (start() adds its step_fn, data, evals)."""
        return RunSpec(max_steps=self.max_steps, hist_every=self.hist_every,
                       update_every=self.update_every,
                       checkpoint_every=self.checkpoint_every, log_every=self.log_every,
                       probe_batch=self.probe_batch, probe_fn=self.probe_fn,
                       probe_tokens=self.probe_tokens,
                       attention_samples=self.attention_samples,
                       attention_tokens=self.attention_tokens)

    def record(self) -> dict[str, Any]:
        """The options in force, as the run's meta stores them (objects by their type)."""
        out: dict[str, Any] = {}
        for k, v in self.__dict__.items():  # not asdict(): it would deep-copy a batch
            if k == "probe_batch":
                v = None if v is None else type(v).__name__
            elif callable(v):
                v = getattr(v, "__qualname__", type(v).__name__)
            elif k == "probe_tokens":
                v = None if v is None else len(v)
            out[k] = v
        return out
