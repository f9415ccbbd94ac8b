"""What the recorder's parts carry between the moments of a step, each in one object that
its part owns: the step in flight between the optimizer's hooks and its record
(`InFlight`, what its pre-hook measured: `Taking`), the ranks' meeting (`RankMeeting`),
the command inbox (`Inbox`) and who may rewind and skip (`RewindState`)."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..probes.data import LengthCounts
from ..probes.late import Late

if TYPE_CHECKING:
    from ..probes.grads import Layers
    from .host_copy import HostCopy


@dataclass
class Taking:
    """The optimizer step being taken: what its pre-hook measured (device tensors, copied
    at the step's end) and knew on the host."""

    step: int
    host: dict[str, float]  # the LR this step used
    groups: dict[str, list[torch.Tensor]]  # "norms" [P], "flags" [≤5], "clips", "staged"
    layer_of: tuple[int, ...]
    staged: list[str]  # names of the runner's figures in the "staged" group
    clips: list = field(default_factory=list)  # the loop's own clips (ClipCall)
    clip_note: str | None = None
    present: tuple[int, ...] | None = None  # which parameters had a gradient (own clips)
    zeroing: bool = False  # a non-finite step's skip zeroes its gradients (no found_inf)
    limits: dict[str, tuple[float, float]] = field(default_factory=dict)  # rules' clips
    t_pre: float = 0.0
    t_probe: float = 0.0
    t_post: float = 0.0
    explicit: bool = False  # measured by a framework adapter, not the optimizer's hook
    hist: bool = False  # a histogram step: weight histograms at its end
    before: list | None = None  # weights snapshot on update-ratio steps
    ratios: torch.Tensor | None = None  # update ratios [L] on device, after the update
    skip: torch.Tensor | None = None  # a fused optimizer's skip, for its own pre-hook
    read: dict[str, list[float]] | None = None  # on a CPU: the groups, read at once
    layers: Layers | None = None  # what `layer_of` indexes, where the model changed since


@dataclass
class RewindState:
    """Who may rewind and skip, and what the loop must still be told."""

    can_rewind: bool = False  # set by who opens the run: its step count is nbwatch's
    runs_loop: bool = False  # start()'s runner: the data stream is nbwatch's to skip
    skip_batches: int = 0  # batches to skip before the next step (the loop's, or ours)
    rewinds: int = 0  # rewinds so far: the branch number of the next
    rewound_to: int | None = None  # the step a rewind went back to, until told
    # start()'s data stream after the last step: (epoch, its next batch), which a checkpoint
    # keeps; a resumed start() is given its checkpoint's, and skips to it
    data_at: tuple[int, int] | None = None
    # the RNG states its pass over the data was opened with (epoch_order.py), kept with it
    data_order: dict[str, Any] | None = None


@dataclass
class Landing:
    """A step whose figures are on their way to the host (`HostCopy`): what its record
    needs besides them."""

    step: int
    copy: HostCopy
    taking: Taking | None  # None: the optimizer did not step (overflow)
    values: dict[str, float]  # the step's host figures (timings, the loop's floats)
    names: list[str]  # the loop's device figures, in the copy's "figures" group
    lr_planned: bool  # its LR moved as planned, as its end saw it
    # (own, waited, wall): its watching, its waits for the device and its row's wall time,
    # taken at its end when it is read later (None: read at once, taken then)
    clock: tuple[float, float, float] | None = None


@dataclass
class Pending:
    """A step whose figures are all on the host, its record (the "step" rules, the store's
    row, the alerts) waiting for the next batch (step_end.py: `record_pending`)."""

    step: int
    values: dict[str, float]
    alerts: list  # the "grads" rules' alerts, raised with the step's own
    lr_planned: bool  # its LR moved as planned (the scheduler stepped, a control)
    late_nan: bool  # a GradScaler overflow with a non-finite loss: the "grads" rules see it
    wall: float = field(default_factory=time.time)  # when it ended: its row's wall time
    late: Late | None = None  # its CPU batch's figures, taken with its record


@dataclass
class InFlight:
    """A step between its optimizer hooks (optimizer_step.py) and its record
    (step_end.py)."""

    taking: Taking | None = None  # set by the pre-hook, taken at the end
    stepped: bool = False  # the optimizer stepped since the last end of step
    staged: tuple[list[str], list[torch.Tensor]] | None = None  # the runner's loss
    copies: deque[Landing] = field(default_factory=deque)  # steps whose copy is under way
    found_inf_set: bool = False  # nbwatch gave the optimizer its `found_inf` this step
    said_no_grad: bool = False  # a layer without a gradient was said (once a run)
    scale_set: bool = False  # nbwatch gave the optimizer its `grad_scale` (the clip)
    measure_in_hook: bool = False  # this step is measured in the optimizer's pre-hook
    # (step, layers, weights) a closure's step starts from, before the closure moved them
    early: tuple[int, Any, list[torch.Tensor]] | None = None  # (SAM)
    # the clipping rules' limits for the next step (AlertEngine.norm_limits), from the
    # steps before the last one: the same in either order of reading (step_end.end_step)
    limits: dict[str, tuple[float, float]] | None = None
    scale_ref: torch.Tensor | None = None  # the GradScaler's scale at the last end
    t_boundary: float = field(default_factory=time.perf_counter)  # the step's clock
    # t_boundary is when the step began (a loop of one's own opens inside its first step,
    # whose start nbwatch did not see: no time/step for it)
    timed: bool = True
    # (step, lengths) on the host, for the next histogram step; a device tensor's ride the
    # step's copy (`lengths`, `length_counts`: the step being taken's) and join them when
    # it is read
    seq_lens: list[tuple[int, torch.Tensor | LengthCounts]] = field(default_factory=list)
    lengths: list[torch.Tensor] = field(default_factory=list)
    length_counts: torch.Tensor | None = None
    reduction_saved: bool = False
    # the step mask counts said (probes.data's BAD, ZEROS: once a run; rank 0's, of every rank)
    masks_said: set[str] = field(default_factory=set)
    pending: deque[Pending] = field(default_factory=deque)  # steps not recorded yet, in order
    pending_since: float = 0.0  # monotonic time the oldest of them began
    # held by the loop's thread while it ends a step or records, and by the system
    # sampler's thread while it records the steps of a quiet loop (step_end.record_if_quiet)
    lock: threading.RLock = field(default_factory=threading.RLock)
    held_alerts: list = field(default_factory=list)  # raised at the loop's next boundary
    held_clips: list[float] = field(default_factory=list)  # and these clips applied


@dataclass
class RankMeeting:
    """Under torchrun: what each rank brings to the next exchange, and rank 0's view of
    the ranks' step times (for the straggler rule)."""

    rows: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    sync_s: float = 0.0  # the last exchange's duration, recorded with the next step
    # perf_counter as this rank left its last exchange: a fast rank's wait there for a
    # slow one is no part of the next step's busy time (probes/forward_time.py)
    met_at: float = 0.0
    step_times: dict[int, deque[float]] = field(default_factory=dict)


@dataclass
class Inbox:
    """Which commands from the store this run has taken, and which have their outcome."""

    last_poll: float = 0.0  # monotonic time of the last read of the store
    last_id: int = 0  # the newest store command taken
    opened_wall: float = field(default_factory=time.time)  # older commands: an earlier run's
    ended: set[str] = field(default_factory=set)  # the commands whose outcome is recorded
