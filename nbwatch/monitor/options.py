"""The options of a run, in one place: `Monitor(...)` sets them, `start()` (and the
framework adapters, through the Monitor's keywords) override them one by one, and the run
records the ones in force (`run.meta["options"]`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from torch import nn

from ..controls import check_clip
from ..counts import integral, real
from ..probes.attention import take_samples
from ..recorder.spec import RunSpec

SQLITE_MAX_PATH = 512  # bytes: SQLite (its unix VFS) opens no file whose full path is longer
# The longest path a run folder may have: SQLite's limit less its longest file there,
# "/nbwatch.db-journal", and a margin (a 493-byte folder was the longest that opened here).
MAX_RUN_DIR_BYTES = SQLITE_MAX_PATH - len("/nbwatch.db-journal") - 8


def check_run_dir_length(run_dir: Path) -> None:
    """Refuse a run folder whose path (or real path: SQLite follows links) SQLite cannot
    open files in, where it is given rather than at the run's first write."""
    for path in dict.fromkeys((run_dir, Path(os.path.realpath(run_dir)))):
        n = len(os.fsencode(path))
        if n > MAX_RUN_DIR_BYTES:
            real = "" if path == run_dir else " (its real path, links followed)"
            raise ValueError(
                f"run_dir is too long for SQLite: {n} bytes{real}, over the "
                f"{MAX_RUN_DIR_BYTES} a run folder may have (SQLite opens no file whose path "
                f"passes {SQLITE_MAX_PATH} bytes); pass a shorter path, e.g. "
                "run_dir='runs/exp1' under your project")


def check_peak_flops(peak: float | None) -> float | None:
    """`Monitor(peak_flops=...)`: the device's peak FLOP/s (e.g. 989e12), or None."""
    if peak is None:
        return None
    if not real(peak) or not (
            0 < peak < float("inf")):
        raise ValueError(f"peak_flops must be the device's peak FLOP/s, a positive number "
                         f"such as 989e12 (an H100 SXM at bf16), or None; got {peak!r}")
    return float(peak)


_NONE_MEANS = {
    "eval_every": "None (the default) evals every tenth of the run when a val_fn is given; "
                  "without a val_fn there is no eval",
    "checkpoint_every": "None (the default) takes no periodic checkpoint (an eval still "
                        "checkpoints)",
    "update_every": "None (the default) takes them with the weight histograms, every "
                    "hist_every steps",
}


def check_every(**values: Any) -> None:
    for label, v in values.items():
        if v is not None and (not integral(v) or v < 1):
            means = _NONE_MEANS.get(label)
            raise ValueError(f"{label} must be a positive int or None, got {v!r}"
                             + (f"; {means}" if means else ""))


class NotGiven:
    """The default of `start()`'s options: "not given", so the Monitor's stands; `None`
    given is a value (`start(clip=None)` turns off a `Monitor(clip=1.0)`)."""

    _one: NotGiven | None = None

    def __new__(cls) -> NotGiven:
        if cls._one is None:
            cls._one = super().__new__(cls)
        return cls._one

    def __repr__(self) -> str:
        return "NOT_GIVEN"

    def __bool__(self) -> bool:
        return False


NOT_GIVEN: Any = NotGiven()


# (option, least value, what its least value means): the counts of Options
_COUNTS = (("hist_every", 0, " (0: no histograms)"),
           ("log_every", 0, " (0: no step lines in the run log)"),
           ("attention_samples", 0, " (0: no attention probe)"),
           ("attention_tokens", 1, ""), ("rank_every", 1, ""))


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
    probe_every: int | None = None  # a loop of your own: the probe every N steps, no val
    attention_samples: int = 2  # 0: no attention probe
    attention_tokens: int = 64
    rank_every: int = 10  # torchrun: the ranks meet every N steps
    dist_timeout: float = 60.0  # torchrun: a rank silent this long ends the run
    display: bool | None = None  # the dashboard in the cell (None: in a notebook)
    peak_flops: float | None = None  # the device's peak FLOP/s for MFU (None: by its name)

    def __post_init__(self) -> None:
        """Each option checked where it is given, not where the training thread reads it."""
        check_every(max_steps=self.max_steps, checkpoint_every=self.checkpoint_every,
                    update_every=self.update_every, probe_every=self.probe_every)
        for name, low, what in _COUNTS:
            v = getattr(self, name)
            if not integral(v) or v < low:
                raise ValueError(f"{name} must be an int ≥ {low}{what}, got {v!r}")
        t = self.dist_timeout
        if not real(t) or not 0 < t < float("inf"):
            raise ValueError(f"dist_timeout must be seconds, a positive number such as 60, "
                             f"got {t!r}")
        # numpy's numbers as Python's: the run's meta is JSON, and a step count compared
        # or hashed as an np.int64 behaves as an int only almost everywhere
        for f in fields(self):
            v = getattr(self, f.name)
            if integral(v):
                object.__setattr__(self, f.name, int(v))
        object.__setattr__(self, "dist_timeout", float(t))
        if self.clip is not None:
            object.__setattr__(self, "clip", float(self.clip))
        if self.display is not None and not isinstance(self.display, bool):
            raise TypeError(f"display must be True, False or None (in a notebook), got "
                            f"{self.display!r}")
        if self.probe_fn is not None and not callable(self.probe_fn):
            raise TypeError(f"probe_fn must be callable as probe_fn(model, batch), got "
                            f"{self.probe_fn!r}")
        if self.probe_tokens is not None and not isinstance(self.probe_tokens, (list, tuple)):
            raise TypeError("probe_tokens must be one list of token strings per probe sample, "
                            f"got {type(self.probe_tokens).__name__}")
        object.__setattr__(self, "peak_flops", check_peak_flops(self.peak_flops))

    def merged(self, **given: Any) -> Options:
        """These options with those given overridden (`NOT_GIVEN` leaves one as it is;
        None given is a value), `clip` checked and `probe_batch` cut to the samples kept."""
        unknown = set(given) - {f.name for f in fields(self)}
        if unknown:
            raise TypeError(f"unknown option(s) {sorted(unknown)}")
        given = {k: v for k, v in given.items() if v is not NOT_GIVEN}
        if "clip" in given:
            given["clip"] = check_clip(given["clip"])
        out = replace(self, **given)
        if "probe_batch" in given:
            out = replace(out, probe_batch=probe_samples(out.probe_batch, out.attention_samples))
        return out

    def spec(self) -> RunSpec:
        """What a run records, from these options (start() adds its step_fn, data, evals)."""
        return RunSpec(max_steps=self.max_steps, hist_every=self.hist_every,
                       update_every=self.update_every,
                       checkpoint_every=self.checkpoint_every, log_every=self.log_every,
                       probe_batch=self.probe_batch, probe_fn=self.probe_fn,
                       probe_tokens=self.probe_tokens, probe_every=self.probe_every,
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


def probe_samples(batch: Any, n: int) -> Any:
    """The attention probe's samples: the first `n` of `batch` (None: no probe)."""
    if not integral(n) or n < 0:
        raise ValueError(f"attention_samples must be an int ≥ 0 (0: no attention probe), "
                         f"got {n!r}")
    if batch is None or n == 0:
        return None
    return take_samples(batch, n)
