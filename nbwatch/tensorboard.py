"""Interop: write a run's scalars, histograms and samples as TensorBoard event files."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from .store import RunReader

_EVENTS = "events.out.tfevents.*"


def _summary_writer() -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:  # torch's module imports the tensorboard package
        raise ImportError(
            "nbwatch.to_tensorboard needs the tensorboard package: pip install tensorboard"
        ) from e
    return SummaryWriter


def to_tensorboard(
    run_dir: str | os.PathLike, logdir: str | os.PathLike, *, overwrite: bool = False
) -> Path:
    """Write the run's scalars, histograms and samples into TensorBoard event files.

    Scalars keep their names (`loss/train` is the `loss` group's `train` chart), steps and
    wall times; histograms (`weight/<layer>`, `data/seq_len`) are written from the stored
    bin edges and counts, not re-binned; samples become text. Returns `logdir`.

    >>> nbwatch.to_tensorboard("runs/exp1", "tb/exp1")
    >>> # then: tensorboard --logdir tb
    """
    SummaryWriter = _summary_writer()
    reader = RunReader(run_dir)
    out = Path(logdir)
    old = sorted(out.glob(_EVENTS)) if out.is_dir() else []
    if old and not overwrite:
        raise FileExistsError(
            f"{out} already holds TensorBoard event files ({old[0].name}…); TensorBoard "
            "would mix them with these: pass another logdir, or overwrite=True to replace them"
        )
    for p in old:
        p.unlink()
    try:
        walls = reader.walls()
        wall_of = dict(zip(walls.index.tolist(), walls.tolist()))
        default_wall = float(walls.iloc[0]) if len(walls) else None
        writer = SummaryWriter(log_dir=str(out))
        try:
            long = reader.scalars_long()
            long = long.sort_values("step", kind="stable")
            for step, key, value in zip(long["step"].tolist(), long["key"].tolist(),
                                        long["value"].tolist()):
                writer.add_scalar(key, value, step, walltime=wall_of.get(step, default_wall))
            for name in reader.histogram_names():
                steps, edges, counts = reader.histograms(name)
                for step, e, c in zip(steps.tolist(), edges, counts):
                    _histogram(writer, name, int(step), e, c, wall_of.get(step, default_wall))
            samples = reader.samples()
            for step, wall, text in zip(samples["step"], samples["wall"], samples["text"]):
                writer.add_text("samples", str(text), int(step), walltime=float(wall))
        finally:
            writer.close()
    finally:
        reader.close()
    return out


def _histogram(writer: Any, tag: str, step: int, edges: np.ndarray, counts: np.ndarray,
               wall: float | None) -> None:
    """One stored histogram as TensorBoard's: right bucket limits, so an empty first bucket
    ends at the left edge (what `torch.utils.tensorboard` does for `add_histogram`)."""
    counts = np.asarray(counts, dtype=np.float64)
    n = counts.sum()
    if n <= 0:
        return  # TensorBoard refuses an empty histogram
    centers = (edges[:-1] + edges[1:]) / 2  # sums are estimates: the values are gone
    writer.add_histogram_raw(
        tag, min=float(edges[0]), max=float(edges[-1]), num=int(n),
        sum=float(counts @ centers), sum_squares=float(counts @ centers**2),
        bucket_limits=edges.tolist(), bucket_counts=[0.0, *counts.tolist()],
        global_step=step, walltime=wall,
    )
