"""What a `Monitor` was given, checked once: the model, its optimizer and scheduler (looked
up behind a framework's wrappers), the run folder, the checkpointer, the controls' state
and the alert rules. The Monitor's parts read it; none of them replaces a field."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import controls as ctl
from ..alerts.engine import configure, default_rules
from ..alerts.rules import Rule
from ..checkpoint import Checkpointer
from ..panels.baseline import check as check_baselines
from ..sharded_checkpoint import make_checkpointer
from .inputs import check_monitor, check_run_dir, default_run_dir, rank
from .optimizer_hooks import hooked_optimizer, inner_scheduler


@dataclass(frozen=True)
class Setup:
    """One Monitor's given objects (the fields are set once; `control` is the one mutable
    object among them: the controls' state, saved in every checkpoint)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer  # the one that takes the hooks (wrappers looked through)
    scheduler: Any  # the scheduler behind a framework's wrapper, or None
    scaler: Any  # a GradScaler (accelerate's, from its optimizer wrapper), or None
    run_dir: Path  # absolute: a later os.chdir must not send the run elsewhere
    rank: int  # under torchrun, rank 0 alone writes the run folder
    name: str
    config: dict[str, Any]
    baselines: list[Path]  # earlier runs the dashboard draws under this one's loss
    system_interval: float
    on_alert: Callable[[Any], Any] | None
    checkpointer: Checkpointer  # FSDP2: a ShardedCheckpointer, written by every rank
    control: ctl.ControlState
    rules: list[Rule]

    @classmethod
    def of(cls, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
           run_dir: str | os.PathLike | None, config: Any, *, scaler: Any, name: str | None,
           keep_last: int, system_interval: float, alerts: dict[str, Any] | None,
           on_alert: Callable[[Any], Any] | None, baseline: Any) -> Setup:
        """Check what `Monitor(...)` was given and refuse, with the fix, what cannot work."""
        cfg = check_monitor(model, optimizer, scheduler, config, keep_last, system_interval,
                            on_alert)
        rules = configure(default_rules(), alerts)  # validates the overrides now
        folder = (Path(run_dir) if run_dir is not None else default_run_dir(True)).absolute()
        here = rank()
        if here == 0:
            check_run_dir(folder)
        baselines = check_baselines(baseline)
        # the hooks go on the optimizer behind a framework's wrapper (accelerate's), and the
        # scheduler read is the one behind its wrapper; with it, accelerate's GradScaler
        hooked = hooked_optimizer(optimizer)
        if hooked is not optimizer and scaler is None:
            scaler = getattr(optimizer, "scaler", None)
        return cls(
            model=model, optimizer=hooked, scheduler=inner_scheduler(scheduler), scaler=scaler,
            run_dir=folder, rank=here, name=name or folder.name, config=cfg,
            baselines=baselines, system_interval=system_interval, on_alert=on_alert,
            checkpointer=make_checkpointer(folder / "checkpoints", keep_last, model, optimizer),
            control=ctl.ControlState(), rules=rules)
