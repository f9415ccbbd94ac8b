"""A histogram step's figures: the weight histograms per layer, computed on the device and
sent with the step's copy (read with it, no wait), the "hist" rules on them, and the batches'
sequence lengths since the last one as `data/seq_len`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from ..alerts.engine import weight_std
from ..probes import weights as wprobe
from ..probes.data import LengthCounts
from ..probes.grads import Layers
from ..records import Histogram
from . import host_copy
from .host_copy import to_numpy
from .quiet import raise_or_hold

if TYPE_CHECKING:
    from ..alerts.engine import AlertEngine
    from ..controls import ControlState
    from ..distributed import NullStore
    from ..store import RunStore
    from .spec import RunSpec
    from .state import InFlight

HIST_EDGES, HIST_COUNTS = "hist_edges", "hist_counts"  # a histogram step's copy's groups


class Histograms(Protocol):
    """What a histogram step reads and records of its run (a `StepRecorder`)."""

    step: int
    spec: RunSpec
    layers: Layers
    engine: AlertEngine
    store: RunStore | NullStore
    flight: InFlight
    control: ControlState

    def _raise_alerts(self, alerts: list) -> None: ...


def keep_seq_lens(rec: Histograms, lengths: torch.Tensor | LengthCounts,
                  step: int | None = None) -> None:
    """A batch's sequence lengths (one a sequence, or a packed step's documents' counts by
    length), for the next histogram step's `data/seq_len`; `step`: its step (default: the
    one being taken), so that a rewind drops those it goes back over."""
    if rec.spec.hist_every <= 0:
        return
    counted = isinstance(lengths, LengthCounts)
    t = lengths.counts if isinstance(lengths, LengthCounts) else lengths
    if step is None and host_copy.deferred(t.device):  # read with the step's copy
        if counted:
            rec.flight.length_counts = t  # one a step
        else:
            rec.flight.lengths.append(t.reshape(-1))
    else:
        rec.flight.seq_lens.append((rec.step + 1 if step is None else step, lengths))


def histogram_groups(rec: Histograms) -> dict[str, list[torch.Tensor]]:
    """A histogram step's weight histograms per layer, computed on the device and sent
    with the step's copy (`record_histograms` takes them when it is read: no wait). The
    counts in float64, and so the whole copy: exact to 2^53, not float32's 2^24."""
    layers = rec.layers
    host = not host_copy.deferred(layers.params[0].device)
    edges, counts = wprobe.layer_histograms(layers, rec.spec.hist_bins, host=host)
    return {HIST_EDGES: [edges], HIST_COUNTS: [counts.double()]}


def record_histograms(rec: Histograms, step: int, layers: Layers,
                      got: dict[str, np.ndarray]) -> None:
    """The weight histograms of `step` (its `layers`), read from its copy, and the "hist"
    rules on them; the sequence lengths of the steps up to it as one histogram (the steps
    before it recorded first by the caller: the rules see the steps in order)."""
    n, bins = len(layers.names), rec.spec.hist_bins
    e_np = np.asarray(got[HIST_EDGES], dtype=np.float64).reshape(n, bins + 1)
    c_np = np.asarray(got[HIST_COUNTS], dtype=np.float64).reshape(n, bins).astype(np.int64)
    for i, name in enumerate(layers.names):
        rec.store.put(Histogram(step, f"weight/{name}", e_np[i], c_np[i]))
    stds = {name: weight_std(e_np[i], c_np[i]) for i, name in enumerate(layers.names)}
    raise_or_hold(rec, rec.engine.observe("hist", step, weight_std=stds))
    fl = rec.flight
    seq = [t for s, t in fl.seq_lens if s <= step]
    fl.seq_lens[:] = [(s, t) for s, t in fl.seq_lens if s > step]
    # on the host, all of them (a device's came with their step's copy)
    lens = np.concatenate([t.lengths() if isinstance(t, LengthCounts)
                           else to_numpy(t).astype(np.float32).reshape(-1) for t in seq]
                          or [np.zeros(0, np.float32)])
    if lens.size:
        hi = max(float(lens.max()), 1.0)
        anchors = np.array([0.0, hi], dtype=np.float32)
        e, c = wprobe.histogram_np(np.concatenate([lens, anchors]), 32)
        c[0] -= 1  # the two range anchors are not data: pin the range at [0, max]
        c[-1] -= 1
        rec.store.put(Histogram(step, "data/seq_len", e.astype(np.float64), c))
