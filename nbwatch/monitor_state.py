"""The state of a `Monitor` that its parts share, declared once with its types: what
`Monitor.__init__` sets and what opening a run sets (opening.py); its hooks on the
optimizer are a part of their own (optimizer_hooks.OptimizerWatch). mypy checks every part
against these declarations."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from . import controls as ctl
from .alerts.rules import Rule
from .distributed import NullStore
from .lifecycle import RunState
from .optimizer_hooks import OptimizerWatch
from .options import Options
from .probes.system import SystemSampler
from .recorder import Progress, Rewound, StepRecorder
from .records import CommandKind
from .store import RunStore


class MonitorState:
    """Declarations only (no behaviour): the attributes of a `Monitor`."""

    # given to Monitor(...), checked there
    model: nn.Module
    optimizer: torch.optim.Optimizer  # the one that takes the hooks (wrappers looked through)
    scheduler: Any
    scaler: Any
    run_dir: Path
    _rank: int
    name: str
    config: dict[str, Any]
    _baselines: list[Path]  # earlier runs the dashboard draws under this one's loss
    _system_interval: float
    _on_alert: Callable[[Any], Any] | None
    checkpointer: Any  # Checkpointer, or ShardedCheckpointer under FSDP2
    control: ctl.ControlState
    rules: list[Rule]
    _options: Options  # the run's options: start() overrides them one by one
    rewound: Rewound | None  # set by log() after a rewind (own loop)
    skip_batches: int  # set by log(): batches the own loop is asked to skip now
    _clip_asked: Any  # float | None given (wins over a resumed checkpoint's), or NOT_GIVEN
    _commands: ctl.CommandQueue
    _resumed_step: int | None  # restored when the Monitor was created
    # one run of it, while open (opening.py)
    _mode: str | None  # "start" | "run" | "loop" once a run was opened
    _progress: Progress
    _progress_start: int
    _store: RunStore | NullStore | None
    _recorder: StepRecorder | None
    _sampler: SystemSampler | None
    _log_handler: logging.Handler | None
    _thread: threading.Thread | None
    _done: threading.Event | None  # set when the training thread ends
    _pid: int  # the process that owns the run (not a forked child of it)
    _closed: threading.Event  # set when the run's store and sampler are closed
    _finalizer: threading.Thread | None
    _stop_asked: bool
    _exc_at_open: BaseException | None
    _loop_thread: threading.Thread | None  # where an own loop's log() runs
    _cell_hook: Callable[[], None] | None  # unregisters the own loop's after-cell record
    _framework: str | None  # an adapter's loop ("hf", "lightning")
    _resumed_data: tuple[int, int] | None = None  # a restored checkpoint's data position
    _optimizer_watch: OptimizerWatch  # its hooks on the optimizer (optimizer_hooks.py)

    if TYPE_CHECKING:  # provided by Monitor and its other parts
        @property
        def step(self) -> int: ...
        @property
        def state(self) -> RunState: ...
        @property
        def running(self) -> bool: ...
        def send(self, kind: str | CommandKind, source: str = "api", **args: Any) -> str: ...
        def show(self) -> Any: ...
        def _open_loop(self, start_step: int | None = None,
                       framework: str | None = None) -> StepRecorder: ...
        def _at_exit(self) -> None: ...
        def _stop_at_exit(self) -> None: ...
        def _stop_for_exit(self, ended: threading.Event,
                           threads: tuple[threading.Thread | None, ...] = ()) -> None: ...
        def _record_sigterm(self, store: Any) -> None: ...
        def _end_loop(self, exc: BaseException | None) -> None: ...
