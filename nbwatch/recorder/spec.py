"""What a run is asked to record (`RunSpec`), what it has done so far (`Progress`), and the
exception that ends a loop nbwatch does not run (`StopTraining`)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..lifecycle import ENDED, RunState, transition


class StopTraining(BaseException):  # noqa: N818 - reads as what it does, like SystemExit
    """Raised by `Monitor.log()` once the run was stopped: it ends a loop that ignores
    log's return value. `Monitor.run()` and `with Monitor(...)` take it as a clean stop.

    A BaseException, so that a loop's `except Exception:` does not swallow it.
    """

    def _render_traceback_(self) -> list[str]:  # IPython: one line, not a traceback
        return [f"nbwatch: {self}"]


@dataclass
class RunSpec:
    """What a run records and when; `step_fn`/`train_data`/`max_steps` drive `start()`."""

    step_fn: Callable[[nn.Module, Any], Any] | None = None
    train_data: Iterable | None = None
    max_steps: int | None = None
    val_fn: Callable[[nn.Module], Any] | None = None
    eval_every: int | None = None
    sample_fn: Callable[[nn.Module], Any] | None = None  # text, an image or a table
    accumulate: int = 1
    hist_every: int = 50
    update_every: int | None = None  # update ratios every N steps (None: hist_every)
    hist_bins: int = 64
    checkpoint_every: int | None = None
    probe_batch: Any = None
    probe_fn: Callable[[nn.Module, Any], Any] | None = None
    probe_tokens: list[list[str]] | None = None
    probe_every: int | None = None  # the probe alone every N steps (a loop of your own)
    attention_samples: int = 2  # 0: no attention probe
    attention_tokens: int = 64
    log_every: int = 50
    trial: bool = False  # preflight: no checkpoints, no pausing
    dry_run: bool = True  # start(): an eval and a checkpoint's state before step 1


_PAUSED = RunState.PAUSED  # read every step: a module constant, not an Enum lookup
_STOP_TAKEN = frozenset({RunState.STOPPING, RunState.STOPPED})

SMOOTHING = 0.9  # panels/loss.py smooth()'s weight: the gap is measured on the drawn curve


@dataclass
class Progress:
    """State shared with the caller's thread: read freely, written only by the recorder."""

    step: int = 0
    state: RunState = RunState.CREATED  # moved only by `move()`
    error: BaseException | None = None
    traceback: str | None = None
    error_tb: Any = None  # the error's own traceback: re-raised with it, never grown
    # the train loss smoothed as the dashboard draws it (debiased EMA, weight 0.9): loss/gap
    train_ema: float = 0.0
    train_ema_n: int = 0
    # set when a failure is fully recorded (error, state, emergency checkpoint), by the
    # thread that records it (a signal handler that interrupts that thread cannot wait)
    failure_recorded: threading.Event = field(default_factory=threading.Event)
    failing_in: threading.Thread | None = None
    error_said: bool = False  # the failure's error event is recorded
    error_message: str | None = None  # … as it says it (or will: a handler says it first)
    # the stop reason recorded before the stop was taken (meta `stopped_by`: a SIGTERM,
    # Ctrl-C, the process's exit): a failure before it was taken keeps it as context only
    stop_said: str | None = None

    # The run's flags, each read off its one state (lifecycle.py), never kept beside it
    @property
    def paused(self) -> bool:
        """The training thread waits at a step boundary for a resume or a stop."""
        return self.state is _PAUSED

    @property
    def stopping(self) -> bool:
        """A stop was taken: the run is stopping, or has stopped by it."""
        return self.state in _STOP_TAKEN

    @property
    def ended(self) -> bool:
        """The run finished, stopped or failed: nothing more is recorded of it."""
        return self.state in ENDED

    def move(self, target: RunState | str) -> RunState:
        """Move the run to `target` (`IllegalTransition` where the lifecycle forbids it)."""
        self.state = transition(self.state, target)
        return self.state

    def train_smooth(self) -> float | None:
        """The smoothed train loss at this step: the curve's value where val is drawn."""
        n = self.train_ema_n
        return self.train_ema / (1 - SMOOTHING**n) if n else None
