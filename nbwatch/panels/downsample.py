"""Bounded, min/max-preserving downsampling on a fixed grid of steps.

Steps fall into buckets `step // width`, `width` a power of two chosen from the span of
steps (from the first step rounded down to a multiple of `GRAIN`, so that a run whose
steps begin at 1,000,001 is not drawn in a dozen points) to the last, so bucket boundaries
do not move as points arrive: appending only rewrites the last bucket, and when the run
outgrows the grid the width doubles and pairs of buckets merge.
Each bucket keeps its first minimum and first maximum (one point when they coincide), so
spikes survive and `reduce(reduce(x, w), 2w) == reduce(x, 2w)`: the browser can fold new
points into what it holds and end up with what a full recomputation would give
(`js/downsample.js` is the same algorithm).
"""

from __future__ import annotations

import numpy as np

MAX_POINTS = 5000
# The span's start is the first step rounded down to a multiple of this: a power of two at
# least every width in use (a span under ~10M steps), so the grid stays `step // w`, and the
# page, which sees the first kept point (in the same first bucket), finds the same start.
GRAIN = 4096


def bucket_width(last_step: int, max_points: int = MAX_POINTS, first_step: int = 0) -> int:
    """Smallest power of two `w` for which the steps from `first_step` (rounded down to a
    multiple of GRAIN) to `last_step` fill ≤ max_points/2 buckets."""
    buckets = max(max_points // 2, 1)
    start = max(first_step, 0) // GRAIN * GRAIN
    w = 1
    while last_step // w - start // w + 1 > buckets:
        w *= 2
    return w


def reduce(steps: np.ndarray, values: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Keep the first min and first max of each bucket of `width` steps, in input order.

    Input is ordered by step; non-finite values are dropped (a gap, not a point).
    """
    steps = np.asarray(steps, dtype=np.int64)
    values = np.asarray(values, dtype=np.float32)
    ok = np.isfinite(values)
    if not ok.all():
        steps, values = steps[ok], values[ok]
    if len(steps) == 0:
        return steps, values
    if len(steps) > 1 and (np.diff(steps) < 0).any():  # a resumed run's re-recorded steps
        order = np.argsort(steps, kind="stable")
        steps, values = steps[order], values[order]
    b = steps // width
    starts = np.flatnonzero(_starts(b))  # buckets are contiguous runs
    seg = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, len(steps))))
    first_min = _first_per_bucket(values == np.minimum.reduceat(values, starts)[seg], seg)
    first_max = _first_per_bucket(values == np.maximum.reduceat(values, starts)[seg], seg)
    keep = np.union1d(first_min, first_max)  # sorted positions: input order
    return steps[keep], values[keep]


def _starts(b: np.ndarray) -> np.ndarray:
    """True where a run of equal values begins (np.r_ costs 10× more on small arrays)."""
    out = np.empty(len(b), dtype=bool)
    out[:1] = True
    np.not_equal(b[1:], b[:-1], out=out[1:])
    return out


def _first_per_bucket(hit: np.ndarray, seg: np.ndarray) -> np.ndarray:
    """Position of the first True of each bucket (every bucket has one)."""
    idx = np.flatnonzero(hit)
    s = seg[idx]
    return idx[_starts(s)]


def downsample(
    steps: np.ndarray, values: np.ndarray, max_points: int = MAX_POINTS
) -> tuple[np.ndarray, np.ndarray]:
    """At most `max_points` points of a whole series, min and max of every bucket kept."""
    steps = np.asarray(steps, dtype=np.int64)
    if len(steps) == 0:
        return steps, np.asarray(values, dtype=np.float32)
    return reduce(steps, values, bucket_width(int(steps.max()), max_points, int(steps.min())))


class Downsampler:
    """One series, downsampled incrementally: `extend()` with new points, read `.steps`/`.values`.

    Equal to `downsample()` of everything extended so far. Points older than the last bucket
    held (a resumed run re-recording steps) are dropped.
    """

    def __init__(self, max_points: int = MAX_POINTS):
        self.max_points = max_points
        self.width = 1
        self.first: int | None = None  # the first step extended: where the span begins
        self.steps = np.empty(0, dtype=np.int64)
        self.values = np.empty(0, dtype=np.float32)

    def __len__(self) -> int:
        return len(self.steps)

    def extend(self, steps: np.ndarray, values: np.ndarray) -> None:
        steps = np.asarray(steps, dtype=np.int64)
        values = np.asarray(values, dtype=np.float32)
        if len(steps) == 0:
            return
        last, low = int(steps.max()), int(steps.min())
        if len(self.steps):
            last = max(last, int(self.steps[-1]))
        self.first = low if self.first is None else min(self.first, low)
        w = bucket_width(last, self.max_points, self.first)
        if w != self.width or not len(self.steps):
            self.width = w
            self.steps, self.values = reduce(
                np.concatenate((self.steps, steps)), np.concatenate((self.values, values)), w
            )
            return
        start = (int(self.steps[-1]) // w) * w  # the open bucket: the only one that changes
        i = int(np.searchsorted(self.steps, start))
        new = steps >= start
        tail_s, tail_v = reduce(np.concatenate((self.steps[i:], steps[new])),
                                np.concatenate((self.values[i:], values[new])), w)
        self.steps = np.concatenate((self.steps[:i], tail_s))
        self.values = np.concatenate((self.values[:i], tail_v))
