"""What one commit of the writer thread writes: a batch of records, grouped by kind, each
kind into its tables (scalars and the system timeline as blocks, histograms as blocks, the
other records a row each), in one transaction."""

from __future__ import annotations

import sqlite3
from typing import Any

from ..records import Histogram, Scalars, SystemSample
from . import histograms
from .histograms import HistTables
from .rows import WRITE, Truncate
from .tables import ScalarTables

# record key names → (first column, second column, value lists) of the records with them
Groups = dict[tuple[str, ...], tuple[list, list, list]]


def _add(groups: Groups, values: dict[str, float], a: float, b: float) -> None:
    g = groups.get(names := tuple(values))
    if g is None:
        g = groups[names] = ([], [], [])
    g[0].append(a)
    g[1].append(b)
    g[2].append(list(values.values()))


def write_batch(con: sqlite3.Connection, tables: ScalarTables, hists: HistTables,
                batch: list[Any]) -> None:
    """Write `batch` (records in the order they were put) in one transaction."""
    steps: Groups = {}  # Scalars: (step, wall, values)
    samples: Groups = {}  # SystemSample: (wall, step, values)
    queued: list[Histogram] = []

    def write_queued() -> None:
        if steps:
            tables.write(steps)
        if queued:
            hists.write(queued)

    with con:
        for r in batch:
            kind = type(r)
            if kind is SystemSample:  # the wall-clock timeline: a truncate keeps it
                _add(samples, r.values, r.wall, r.step)
            elif isinstance(r, Scalars):
                _add(steps, r.values, r.step, r.wall)
            elif kind is Histogram:
                queued.append(r)
            elif kind is Truncate:  # what was queued before a truncate is cut by it
                write_queued()
                tables.truncate(r.step)
                histograms.truncate(con, r.step)
            else:
                WRITE[kind](con, r)
        write_queued()
        if samples:
            tables.write_system(samples)
