"""What the recorder's parts carry between the moments of a step, each in one object that
its part owns: the step in flight between the optimizer's hooks and its record
(`InFlight`), the ranks' meeting (`RankMeeting`) and the command inbox (`Inbox`)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..probes.late import Late

if TYPE_CHECKING:
    from .host_copy import HostCopy
    from .optimizer_step import Taking


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

    taking: Any = None  # optimizer_step.Taking: set by the pre-hook, taken at the end
    stepped: bool = False  # the optimizer stepped since the last end of step
    staged: tuple[list[str], list[torch.Tensor]] | None = None  # the runner's loss
    copies: deque[Landing] = field(default_factory=deque)  # steps whose copy is under way
    found_inf_set: bool = False  # nbwatch gave the optimizer its `found_inf` this step
    scale_set: bool = False  # nbwatch gave the optimizer its `grad_scale` (the clip)
    measure_in_hook: bool = False  # this step is measured in the optimizer's pre-hook
    # the clipping rules' limits for the next step (AlertEngine.norm_limits), from the
    # steps before the last one: the same in either order of reading (step_end.end_step)
    limits: dict[str, tuple[float, float]] | None = None
    scale_ref: torch.Tensor | None = None  # the GradScaler's scale at the last end
    t_boundary: float = field(default_factory=time.perf_counter)  # the step's clock
    seq_lens: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (step, lengths)
    reduction_saved: bool = False
    mask_said: bool = False  # a bad GPU mask was said (once a run)
    pending: deque[Pending] = field(default_factory=deque)  # steps not recorded yet, in order
    pending_since: float = 0.0  # monotonic time the oldest of them began


@dataclass
class RankMeeting:
    """Under torchrun: what each rank brings to the next exchange, and rank 0's view of
    the ranks' step times (for the straggler rule)."""

    rows: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    sync_s: float = 0.0  # the last exchange's duration, recorded with the next step
    step_times: dict[int, deque[float]] = field(default_factory=dict)


@dataclass
class Inbox:
    """Which commands from the store this run has taken."""

    last_poll: float = 0.0  # monotonic time of the last read of the store
    last_id: int = 0  # the newest store command taken
    opened_wall: float = field(default_factory=time.time)  # older commands: an earlier run's
