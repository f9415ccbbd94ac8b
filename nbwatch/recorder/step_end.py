"""The end of an optimizer step: its record. Timings, derived figures (padding ratio,
throughput), the "step" rules, the `Scalars` row, weight and sequence-length histograms;
the step's device figures leave in one copy, read at the next step's end (host_copy.py).

    scheduler.step()
    end of step N     LR factor on · the copy launched (weight histograms binned on the
                      device on a histogram step) · step N - 1's copy read (`land`)
    its read          its gradient figures · its record, batched ("step" rules, the
                      `Scalars` row) · its histograms ("hist" rules)
    a quiet loop      the steps waiting for their batch, and those whose copy landed,
                      recorded from the system sampler's thread (`record_if_quiet`),
                      their alerts raised by the loop at its next step's end
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from .. import controls as ctl
from ..distributed import LENGTHS, SUMMED, rank_figures
from ..probes import late as late_figures
from ..probes.data import NOTED, LengthCounts, mask_notes, packed_figures
from ..probes.grads import Layers, ratio_names
from ..probes.throughput import add_rates, timing_figures
from ..records import Event, Scalars
from . import host_copy
from .batches import BatchIds
from .histograms import (
    HIST_COUNTS,
    HIST_EDGES,
    histogram_groups,
    keep_seq_lens,
    record_histograms,
)
from .host_copy import HostCopy
from .lr_factor import LrFactor
from .optimizer_step import lasting_clip, lower_clip, read_grads
from .own_time import OwnTime, counted
from .quiet import on_sampler, on_sampler_thread, raise_held, raise_or_hold, waiting
from .spec import SMOOTHING, Progress, RunSpec
from .state import InFlight, Landing, Pending, RankMeeting

if TYPE_CHECKING:
    from ..alerts.engine import AlertEngine
    from ..controls import ControlState
    from ..distributed import Dist, NullStore
    from ..store import RunStore
    from .eval_checkpoint import EvalState
    from .layer_changes import LayerWatch
    from .own_clips import OwnClips

# A step's record (its "step" rules, its row, its alerts) waits for a batch: at most this
# many steps, and no step longer than this many seconds. The rules' code and numpy are
# cold after a backward pass (the loss_spike check: 188 µs a call in a live run, ~15 fed
# in a loop), and a batch pays that once (benchmarks/README.md).
RECORD_STEPS = 16
RECORD_EVERY_S = 0.5
# The copy's groups of many values, read as numpy arrays: the batch's sequence lengths (a
# packed step's documents' counts by length) and a histogram step's weight histograms.
ARRAYS = frozenset({"seq_lens", "seq_counts", HIST_EDGES, HIST_COUNTS})
# A loop that has not ended a step for this long is quiet (an eval of its own, a slow
# batch, a hang): the steps waiting are recorded from the system sampler's thread, so that
# readers see them and a kill does not lose them (`record_if_quiet`).
QUIET_S = 0.5

# A step's figures are read at the next boundary (host_copy.py): on an accelerator the
# copy lands while the next step runs, and a host more than a step ahead waits there
# (the device is the bottleneck then: the wait idles nothing). On a CPU a copy costs no
# wait and is read at once (`host_copy.DEFER_ON_CPU` runs the accelerator's order there).

_FROM_ALL_RANKS = ("loss/train", *SUMMED, *LENGTHS)
EVAL_INSIDE = "_eval_inside"  # a step's host figure: its time holds the loop's own eval


class Recording(Protocol):
    """What the record of a step reads and moves of its run (a `StepRecorder`)."""

    own: OwnTime
    step: int
    spec: RunSpec
    opt: torch.optim.Optimizer
    scaler: Any
    layers: Layers
    ratio_names: list[str]
    grad_names: list[str]
    skip_nonfinite: bool
    control: ControlState
    own_clips: OwnClips
    layer_watch: LayerWatch
    framework_clip: float | None
    engine: AlertEngine
    store: RunStore | NullStore  # NullStore on ranks > 0
    dist: Dist | None
    progress: Progress
    lr: LrFactor
    batch_ids: BatchIds
    flight: InFlight
    ranks: RankMeeting
    evals: EvalState
    log: logging.Logger

    def _emit(self, ev: Event, level: int | None = None) -> None: ...
    def _raise_alerts(self, alerts: list) -> None: ...
    def step_done(self, eval_due: bool = False, val: Any = None,
                  probe: bool = False) -> None: ...


@counted
def end_step(rec: Recording, values: dict[str, float], names: list[str] | None = None,
             parts: list[torch.Tensor] | None = None, *, data_s: float | None = None,
             samples: int | None = None, extra_times: dict[str, float] | None = None
             ) -> int:
    """Close the optimizer step just taken: its host `values` and timings, its device
    figures (`parts` named `names`, and what its optimizer hooks measured) sent to the
    host in one copy, read at a later boundary (`land`). Returns the step number."""
    with rec.flight.lock:
        return _end_step(rec, values, names, parts, data_s=data_s, samples=samples,
                         extra_times=extra_times)


def _end_step(rec: Recording, values: dict[str, float], names: list[str] | None,
              parts: list[torch.Tensor] | None, *, data_s: float | None,
              samples: int | None, extra_times: dict[str, float] | None) -> int:
    t_end = time.perf_counter()
    fl = rec.flight
    t = fl.taking
    fl.taking, fl.stepped = None, False
    rec.lr.on(only_if_scheduled=True)
    step = rec.step + 1
    groups: dict[str, list[torch.Tensor]] = {}
    known = None
    if t is None:  # a GradScaler found inf/NaN gradients and skipped the optimizer
        values = {**values, "amp/overflow": 1.0}
        rec.lr.skipped()
        if rec.lr.repair_after_overflow():
            values["lr"] = ctl.lrs(rec.opt)[0]
        if fl.staged is not None:  # the runner's loss, taken by no pre-hook
            names, parts = fl.staged[0] + (names or []), fl.staged[1] + (parts or [])
            fl.staged = None
    else:
        values = dict(values)
        groups.update(t.groups)
        known = t.read
        values["time/probes"] = t.t_probe - t.t_pre
        values["time/optimizer"] = t.t_post - t.t_probe
        if t.ratios is not None:
            groups["ratios"] = [t.ratios]
    # data_s None: a loop of the user's, whose data wait nbwatch does not see
    if fl.timed:
        values.update(timing_figures(t_end - fl.t_boundary, data_s))
    if samples:
        values["_samples"] = float(samples)  # its rate: with tokens/s, once on the host
    if extra_times:
        values.update(extra_times)
    rec.step = step
    rec.progress.step = step
    rec.batch_ids.end_step(step)
    groups["figures"] = list(parts or ())
    names = list(names or ())
    scale = getattr(rec.scaler, "_scale", None) if rec.scaler is not None else None
    if isinstance(scale, torch.Tensor):  # the loss scale after this step's update()
        groups["figures"].append(scale.reshape(()).float())  # (copied with the rest)
        names.append("amp/scale")
    if fl.lengths:  # the batch's sequence lengths on the device, for the histogram
        groups["seq_lens"], fl.lengths = fl.lengths, []
    if fl.length_counts is not None:  # a packed batch's documents', by length
        groups["seq_counts"], fl.length_counts = [fl.length_counts], None
    if t is not None and t.hist:
        groups.update(histogram_groups(rec))
    this = Landing(step, HostCopy.launch(step, groups, known, ARRAYS), t, values, names,
                   rec.lr.planned())
    fl.copies.append(this)
    raise_held(rec)  # where this step's own alerts would be: after its copy is taken
    land(rec)
    fl.limits = rec.engine.norm_limits()  # from every step before this one, in either order
    if not (host_copy.DEFER_ON_CPU or any(s.event is not None for s in this.copy.shares)):
        land(rec, wait=True)  # on a CPU: read at once
    elif fl.copies and fl.copies[-1] is this:  # read later (unless an action read it now):
        # its watching, the landing of the steps before it included, ends here
        this.clock = step_clock(rec)
    if isinstance(scale, torch.Tensor):
        fl.scale_ref = scale.clone()  # no sync: compared on overflow only
    said = rec.lr.end_step()
    if said is not None:
        rec._emit(Event(step, "probe", "warning", said, {"scheduler": "steps"}))
    fl.t_boundary, fl.timed = time.perf_counter(), True
    return step


def land(rec: Recording, wait: bool = False) -> None:
    """Read the copies of the steps before the newest, oldest first, and complete those
    steps (with `wait`, the newest too): each rank, each order, reads step N at the end of
    step N + 1, so that what is decided from them (a clip limit) is the same on every
    rank."""
    copies = rec.flight.copies
    quiet = on_sampler_thread()  # a quiet loop's: the copies landed already, the newest too
    while copies and (copies[0].copy.ready() if quiet else (wait or len(copies) > 1)):
        one = copies.popleft()
        got = one.copy.read(None if quiet else rec.own)
        values, alerts = one.values, []  # type: tuple[dict[str, float], list]
        if one.taking is not None:
            grads, alerts = read_grads(rec, one.taking, got)
            values = {**grads, **values}
            limit = lasting_clip(alerts, grads)
            if not quiet:
                lower_clip(rec.control, limit)
            elif limit is not None:  # the loop's, at its next step's end: where it comes
                rec.flight.held_clips.append(limit)
            if "ratios" in got and "skipped" not in values:
                taken = one.taking.layers
                names = (rec.ratio_names if taken is None or taken is rec.layers
                         else ratio_names(taken))
                values.update(zip(names, got["ratios"]))
        else:
            values = dict(values)
        values.update(zip(one.names, got.get("figures", ())))
        arrays = one.copy.arrays
        if "seq_lens" in arrays:
            keep_seq_lens(rec, torch.from_numpy(arrays["seq_lens"]), one.step)
        if "seq_counts" in arrays:
            keep_seq_lens(rec, LengthCounts(torch.from_numpy(arrays["seq_counts"])), one.step)
        complete(rec, one.step, values, alerts, one.taking is None, one.lr_planned,
                 one.clock)
        if HIST_EDGES in arrays and one.taking is not None:
            layers = one.taking.layers
            record_pending(rec)  # the steps before it first: the rules see them in order
            record_histograms(rec, one.step, rec.layers if layers is None else layers, arrays)


def step_clock(rec: Recording) -> tuple[float, float, float]:
    """The step ending now: its watching, its waits for the device, its row's wall time."""
    return rec.own.take(), rec.own.take_wait(), time.time()


def complete(rec: Recording, step: int, values: dict[str, float], alerts: list,
             overflow: bool = False, lr_planned: bool | None = None,
             clock: tuple[float, float, float] | None = None) -> None:
    """The step's figures are all on the host (or kept for its record: `probes.late`): its
    record (derived figures, the "step" rules, the store's row, the alerts) waits for the
    next batch (`record_pending`).
    `lr_planned`: its LR moved as planned, as the step's end saw it (a GPU step completes
    at the next step's copy, after the scheduler's count was taken); `clock`: its
    (watching, device wait, wall time), taken at its end (None: now, at its end too)."""
    fl = rec.flight
    # a CPU batch's figures, kept among the host figures till here, taken at the record
    late = cast("late_figures.Late | None", values.pop(late_figures.KEY, None))
    loss = values.get("loss/train")
    finite = loss is None or math.isfinite(loss)
    if overflow and finite:
        values.pop("grad_norm/global", None)
    # this step's watching, up to its end, and its row's wall time at the same instant: a
    # pause between the two would count in one step's watching and the other's wall
    if clock is None:  # (the sampler's thread has no watching of the loop's to take)
        clock = (0.0, 0.0, time.time()) if on_sampler_thread() else step_clock(rec)
    own, waited, wall = clock
    values["time/nbwatch"] = own
    if rec.scaler is not None:  # a GradScaler's run: 0 or 1 each step, a rate to plot
        values.setdefault("amp/overflow", 0.0)
    if waited:
        values["time/device_wait"] = waited
    if loss is not None and finite:
        p = rec.progress
        p.train_ema = SMOOTHING * p.train_ema + (1 - SMOOTHING) * loss
        p.train_ema_n += 1
    pending = fl.pending
    now = time.monotonic()
    if not pending:  # the batch's age counts from its first step's start
        fl.pending_since = now - values.get("time/step", 0.0)
    pending.append(Pending(step, values, alerts,
                           rec.lr.planned() if lr_planned is None else lr_planned,
                           overflow and not finite, wall, late))
    # What acts on this step is recorded at once: an alert of the "grads" rules (its
    # checkpoint is the last good state), a non-finite figure (the nonfinite rule reads
    # the loss a loop reports after its optimizer step here), a skipped step; and every
    # step under torchrun, whose ranks meet on recorded steps.
    # So is every step of a run whose "step" rules act (cut the LR, pause, ...): the
    # boundary where an action comes must not depend on timing.
    if (alerts or not _finite(values) or "skipped" in values or rec.dist is not None
            or rec.engine.acts_at_step or len(pending) >= RECORD_STEPS
            or now - fl.pending_since >= RECORD_EVERY_S):
        record_pending(rec)


def _finite(values: dict[str, float]) -> bool:
    """Every figure is finite (a sum is not, when one is not: one pass in C)."""
    try:
        return math.isfinite(sum(values.values()))
    except TypeError:  # not all numbers: look at each
        return all(math.isfinite(v) for v in values.values() if isinstance(v, (int, float)))


def record_pending(rec: Recording) -> None:
    """Record the steps waiting, oldest first: each one's "step" rules, its row in the
    store, its alerts and their actions (which may checkpoint, and so come back here)."""
    if on_sampler_thread():  # the sampler's thread: the alerts are the loop's to raise
        _record_pending(rec)
        return
    with rec.own, rec.flight.lock:
        raise_held(rec)
        _record_pending(rec)


def _record_pending(rec: Recording) -> None:
    pending = rec.flight.pending
    late = []
    for p in pending:  # taken once: an alert's action below may come back here
        if p.late is not None:
            late.append((p.step, p.values, p.late))
            p.late = None
    resolve_late(rec, late)
    while pending:
        record(rec, pending.popleft())


def record_if_quiet(rec: Recording) -> bool:
    """Record the steps a loop that has ended no step for `QUIET_S` left waiting: those
    waiting for their batch, and on an accelerator those whose copy has landed, the newest
    too (a long step: its row came only at the next step's end). Called from another
    thread (the system sampler's): the rules run here, without a wait for the device;
    their alerts and actions are the loop's, at its next step's end (`raise_held`, where
    they would have come). Nothing is done while the loop's thread is recording, nor under
    torchrun (whose ranks meet on each step at its end). Returns whether it recorded."""
    fl = rec.flight
    if (rec.dist is not None or rec.progress.ended or not waiting(fl)
            or time.perf_counter() - fl.t_boundary < QUIET_S):
        return False
    if not fl.lock.acquire(blocking=False):
        return False
    on_sampler(True)
    try:
        if not waiting(fl) or time.perf_counter() - fl.t_boundary < QUIET_S:
            return False  # the loop came back meanwhile
        land(rec)
        _record_pending(rec)
        return True
    finally:
        on_sampler(False)
        fl.lock.release()


def resolve_late(rec: Recording, steps: list) -> None:
    """The figures kept for the record of `steps` ((step, values, Late)), and their
    sequence lengths for the next histogram."""
    if steps:
        got = late_figures.resolve([(values, late) for _, values, late in steps])
        for (step, _, _), lengths in zip(steps, got):
            if lengths is not None:
                keep_seq_lens(rec, lengths, step)


def derive(rec: Recording, step: int, values: dict[str, float]) -> dict[str, float]:
    """The figures drawn from others: the padding ratio, samples/s and tokens/s, a packed
    batch's sequence figures (and a bad mask's figures dropped, said once a run). Returns
    the step's mask counts (`NOTED`): under torchrun rank 0 says every rank's, once a
    job, from its row at the ranks' meeting (steering.record_ranks), not this rank."""
    counts = {k: values[k] for k in NOTED if values.get(k)}
    notes = mask_notes(values, set() if rec.dist else rec.flight.masks_said)  # (popped)
    for note in notes if rec.dist is None else []:
        rec._emit(Event(step, "probe", "warning", note))
    tokens = values.get("tokens/real")
    padded = values.pop("_padded", None)
    if tokens is not None and padded:
        values["data/padding_ratio"] = 1.0 - tokens / padded
    samples = values.pop("_samples", None)
    samples = packed_figures(values) or samples  # a packed batch's: its documents
    if not values.pop(EVAL_INSIDE, None):
        add_rates(values, int(samples) if samples else None)
    return counts


def record(rec: Recording, p: Pending) -> None:
    """One step's record: its derived figures, the "step" rules on its figures (which add
    the spike score and MFU to them), its row in the store, its alerts."""
    step, values, alerts = p.step, p.values, p.alerts
    counts = derive(rec, step, values)
    if p.late_nan:
        alerts = alerts + rec.engine.observe("grads", step, values)  # a real NaN
    if p.lr_planned:
        rec.engine.explain_lr()
    alerts = alerts + rec.engine.observe("step", step, values)
    if rec.dist is not None:
        rk = rec.ranks
        rk.rows.append((step, {**rank_figures(values), **counts, "time/sync": rk.sync_s}))
        rk.sync_s = 0.0
        # run-level loss, tokens and throughput come from all ranks, at the next exchange
        stored = {k: v for k, v in values.items() if k not in _FROM_ALL_RANKS}
    else:
        stored = values
    rec.store.put(Scalars(step, stored, p.wall))
    raise_or_hold(rec, alerts)
    every = rec.spec.log_every
    if every and step % every == 0:
        rec.log.info("step", extra={"step": step, "data": {
            k: values[k] for k in ("loss/train", "grad_norm/global", "lr", "time/step")
            if k in values}})


def record_step(rec: Recording, host: dict[str, float], names: list[str],
                parts: list[torch.Tensor], *, lengths: torch.Tensor | LengthCounts | None = None,
                samples: int | None = None, val: Any = None,
                reduction: str | None = None) -> int:
    """The end of an optimizer step in a loop nbwatch does not run (`Monitor.log`, the
    framework adapters): its record, its eval if `val`, a periodic checkpoint."""
    if lengths is not None:
        keep_seq_lens(rec, lengths)
    save_reduction(rec, reduction)
    if val is not None and rec.evals.last_val_step != rec.step:
        # the loop's eval ran inside this step's time: a rate over it would read as a
        # throughput drop at every eval (a val every step is part of every step's time)
        host = {**host, EVAL_INSIDE: 1.0}
    step = end_step(rec, host, names, parts, samples=samples)
    every = rec.spec.probe_every  # the probe alone, where no val comes
    rec.step_done(val=val, probe=every is not None and val is None and step % every == 0)
    return step


def flush_deferred(rec: Recording) -> None:
    """Record every step taken so far: read the copies under way (waiting for them: a
    sync on a GPU) and record the steps waiting for their batch."""
    with rec.flight.lock:
        if rec.flight.copies:
            land(rec, wait=True)
        if rec.flight.pending or rec.flight.held_alerts:
            record_pending(rec)


def save_reduction(rec: Recording, reduction: str | None) -> None:
    """The loss's reduction (mean, sum, token-mean), in the run's meta once."""
    if not rec.flight.reduction_saved and reduction:
        rec.store.set_meta("loss_reduction", reduction)
        rec.flight.reduction_saved = True
